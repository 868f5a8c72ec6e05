"""``atlasfs export``: a tree's shard folders as WebDataset tar files, without FUSE.

Each tar is written in one pass over a shard folder's members
(:func:`~atlasfs.tree.tarview.write_tar`): the bytes a
:class:`~atlasfs.tree.tarview.TarLayout` places, so exactly those of ``<shard>.tar``
in the mount's tar view: the shard's files in example order (:meth:`~atlasfs.tree.base.Tree.members`), a
sample's files adjacent, named by their full key paths without a ``./``
prefix, so ``webdataset`` yields the samples in the dataset's order. Beside
the tars goes ``shards.json``, the same wids index the tar view shows.

Shards are written in parallel processes (:mod:`atlasfs.commands.jobs`), each worker
with its own tree keeping one shard's table at a time, so memory does not grow with the
dataset; every tar is the same bytes whatever the number of processes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from atlasfs.commands.jobs import LOST, Done, Opener, Report, per_machine, run
from atlasfs.formats.source import Source, SourceShard
from atlasfs.progress import progress_bar, say
from atlasfs.sizes import format_size
from atlasfs.tree.base import Tree
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.tarview import INDEX_NAME, Written, shard_index, write_tar


def write_shard_tar(tree: Tree, folder: str, out_path: str, on_sample: Callable[[], None] | None = None) -> Written:
    """Write every file below ``folder`` into the tar ``out_path`` (in one pass: see
    :func:`~atlasfs.tree.tarview.write_tar`); returns what it wrote.

    The tar is written beside ``out_path`` under a temporary name and renamed
    when complete, so a failed export leaves no partial shard behind.
    """
    partial = out_path + ".partial"
    try:
        with _create(partial) as out:
            written = write_tar(tree, folder, out, on_sample)
        os.replace(partial, out_path)
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise
    return written


def _create(partial: str) -> Any:
    """A new file at ``partial`` for writing, never through a link: OUTDIR may be another
    user's folder, whose owner could put ``0.tar.partial -> /etc/passwd`` there (names are
    predictable), and open(..., "wb") had root's export write the tar into the link's target.
    A leftover file there (a killed run's) is removed first; whatever appears after that
    makes the open fail (O_EXCL), never followed."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(partial)  # the link itself, if it is one
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    return os.fdopen(os.open(partial, flags, 0o666), "wb")


def write_index(outdir: str, shards: Sequence[tuple[str, int]]) -> str:
    """Write ``shards.json`` (the wids index of ``(tar name, samples)`` pairs) into ``outdir``."""
    path = os.path.join(outdir, INDEX_NAME)
    partial = path + ".partial"
    try:
        with _create(partial) as f:
            f.write(shard_index(shards))
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    return path


@dataclass
class Exported:
    """What an export run wrote: ``(tar name, samples)`` of each shard written, in the order
    asked, and how many shards failed (each said in one line as it came). ``samples``: the
    samples of each shard position written so far (as they come: an interrupted run's)."""

    written: list[tuple[str, int]] = field(default_factory=list)
    failed: int = 0
    samples: dict[int, int] = field(default_factory=dict)
    #: Bytes of the tars written.
    size: int = 0


def _setup(source: Source, cache_bytes: int, outdir: str) -> tuple[BlockTree, str]:
    # A bad shard or block fails its own tar and is named by the parent once, in export's
    # words: the tree does not log it.
    return BlockTree(source, cache_bytes=cache_bytes, log_failures=False), outdir


def shard_weight(shard: SourceShard) -> int:
    """What a shard counts for in export's bar: the bytes its files take (at least 1: a shard
    that cannot be opened still moves the bar once). Known before any shard is read, so the
    bar's total is right from the start (samples are known only once a shard was prepared:
    a Dolma shard's pass over its file); a shard's bytes go by as its samples are written."""
    return max(int(shard.data_size or 0), 1)


class _Counted:
    """Samples written, reported as the part of the shard's :func:`shard_weight` they are, a
    few hundred samples at a time (a worker's report takes a lock). The shard's samples are
    counted as its first one comes: its source has prepared it by then (writing does first)."""

    def __init__(self, report: Report, shard: SourceShard, every: int = 256) -> None:
        self.report, self.shard, self.every = report, shard, every
        self.weight = shard_weight(shard)
        self.total: int | None = None
        self.written = self.held = self.sent = 0

    def one(self) -> None:
        if self.total is None:
            shard = self.shard
            self.total = max(sum(shard.block_length(block) for block in range(shard.num_blocks)), 1)
        self.held += 1
        if self.held >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.held and self.total is not None:
            self.written, self.held = self.written + self.held, 0
            reached = self.weight * min(self.written, self.total) // self.total
            if reached > self.sent:
                self.report("done", reached - self.sent)
                self.sent = reached

    def finish(self) -> None:
        """Move the bar to the shard's end (its last samples, or those a failure left unwritten)."""
        self.flush()
        if self.weight > self.sent:
            self.report("done", self.weight - self.sent)
            self.sent = self.weight


def _export_shard(state: tuple[BlockTree, str], s: int, report: Report) -> Done:
    """Write shard position ``s``'s tar into the output folder; one line if it fails."""
    tree, outdir = state
    name = tree.shards[s].name
    out = os.path.join(outdir, f"{name}.tar")
    counted = _Counted(report, tree.shards[s])
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)  # a shard named with slashes (Dolma)
        written = write_shard_tar(tree, f"/{name}", out, counted.one)
    except OSError as exc:
        return Done(s, f"{exc.strerror or exc}")
    finally:
        counted.finish()
        tree.forget(s)
    return Done(s, value=(out, written.samples, written.files, written.size))


def export_all(source: Source, opener: Opener, shards: Sequence[int], outdir: str, cache_bytes: int,
               jobs: int, result: Exported | None = None, verbose: bool = False, quiet: bool = False) -> Exported:
    """Write the tars of shard positions ``shards`` of ``source`` into ``outdir`` in ``jobs``
    processes (each with a ``cache_bytes / jobs`` block cache), with a progress bar of the
    shards' bytes on a terminal (none if ``quiet``); a failure is one line on stderr, each tar
    written one line on stdout if ``verbose``. Fills and returns ``result``. Interrupted
    (KeyboardInterrupt), it stops the workers and leaves no partial tar: the tars written
    are in ``result.samples``."""
    result = Exported() if result is None else result
    names = [shard.name for shard in source.shards]
    samples = result.samples
    running: set[int] = set()
    try:
        _export(source, opener, shards, outdir, cache_bytes, jobs, result, running, verbose, quiet)
    except BaseException:
        for s in running:  # the shards in hand: a worker killed before it removed its partial tar
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(outdir, f"{names[s]}.tar.partial"))
        raise
    result.written = [(f"{names[s]}.tar", samples[s]) for s in shards if s in samples]
    return result


def _export(source: Source, opener: Opener, shards: Sequence[int], outdir: str, cache_bytes: int, jobs: int,
            result: Exported, running: set[int], verbose: bool, quiet: bool) -> None:
    names = [shard.name for shard in source.shards]
    setup = functools.partial(_setup, cache_bytes=cache_bytes // per_machine(jobs), outdir=outdir)
    total = sum(shard_weight(source.shards[s]) for s in shards)
    with progress_bar("export", total, "B", quiet) as bar:

        def report(what: str, n: int) -> None:
            if what == "done":
                bar.update(n)

        with contextlib.closing(run(source, opener, setup, _export_shard, shards, jobs, report, running)) as dones:
            for done in dones:
                _said(done, names, outdir, len(shards), result, verbose)


def _said(done: Done, names: list[str], outdir: str, shards: int, result: Exported, verbose: bool) -> None:
    """Say what became of one shard, and count it."""
    name = names[done.shard]
    if done.error is not None:
        result.failed += 1
        partial = os.path.join(outdir, f"{name}.tar.partial")
        if os.path.exists(partial):  # its worker died: no one else removes what it left
            os.unlink(partial)
        others = "; the other shards are written" if shards > 1 and done.error != LOST else ""
        say(f"atlasfs: export of shard {name} failed: {done.error}{others}")
        return
    out, samples, files, size = done.value
    result.samples[done.shard] = samples
    result.size += size
    if verbose:  # 400 shards are not 400 lines unless asked: the closing line sums them up
        say(f"{out}: {samples} samples, {files} files, {format_size(size)}", sys.stdout)
