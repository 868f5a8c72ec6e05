"""``atlasfs verify`` with its shards checked by an executor (``--ray``): each shard's pass
and the decoding of its blocks in a task of its own; the findings said in the order the
one-process check (:func:`~atlasfs.commands.inspection.verify`) says them.

That order: every shard's pass (its error, or its own problems), shard by shard, then the
dataset's problems across shards and its warnings, then the blocks that do not decode,
shard by shard. The dataset-wide checks run here, in the driver, as they do in one process.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from atlasfs.commands.export import shard_weight
from atlasfs.commands.jobs import Done, Executor, Opener, Report, executor_from_args, run
from atlasfs.errors import AtlasFormatError
from atlasfs.formats.source import Source
from atlasfs.progress import progress_bar

#: Blocks decoded between two progress reports of a task.
EVERY = 16


def verifier(args: argparse.Namespace, verify: Callable[..., Any]) -> Callable[..., Any]:
    """``verify`` itself, or with ``--ray`` the same check with one task per shard."""
    executor = executor_from_args(args, None)
    if executor is None:
        return verify
    settings = args.settings
    opener = Opener(args.dataset, settings.format, settings.source_options(), settings.storage, bool(args.verbose))
    return functools.partial(verify_shards, executor, opener, quiet=bool(getattr(args, "quiet", False)))


def _setup(source: Source) -> Source:
    return source


def _check_shard(source: Source, s: int, report: Report) -> Done:
    """Shard position ``s``: ``(pass problems, block problems, blocks, examples, passed)``.
    Its blocks move the bar by the shard's :func:`shard_weight` (bytes) in all, the shard's
    end (a failure too) by what is left of it."""
    shard = source.shards[s]
    weight, sent = shard_weight(shard), 0
    try:
        try:
            if shard.error is not None:
                raise shard.error
            shard.prepare()
        except AtlasFormatError as exc:
            return Done(s, value=([str(exc)], [], 0, 0, False))
        first = list(shard.problems())
        later: list[str] = []
        examples = 0
        for b in range(shard.num_blocks):
            try:
                examples += len(shard.decode_block(b)[0])
            except AtlasFormatError as exc:
                later.append(str(exc))
            if (b + 1) % EVERY == 0:
                reached = weight * (b + 1) // shard.num_blocks
                report("done", reached - sent)
                sent = reached
        return Done(s, value=(first, later, shard.num_blocks, examples, True))
    finally:
        if weight > sent:
            report("done", weight - sent)


def verify_shards(executor: Executor, opener: Opener, open_source: Callable[[], Source], *,
                  on_block: Callable[[], None] | None = None, on_total: Callable[[Any], None] | None = None,
                  report: Any = None, quiet: bool = False) -> Any:
    """:func:`~atlasfs.commands.inspection.verify` on ``executor``: the same report, the
    same lines in the same order, with a bar of its own (``on_block`` and ``on_total`` are
    not called; none with ``quiet``). A shard's blocks are known only once its task made its
    pass, so the bar counts the shards' bytes (:func:`shard_weight`), as export's does: its
    total is known before the first task starts."""
    from atlasfs.commands.inspection import VerifyReport
    report = VerifyReport() if report is None else report
    try:
        source = open_source()
    except AtlasFormatError as exc:
        report.problem(str(exc))
        return report
    results: dict[int, tuple[list[str], list[str], int, int, bool]] = {}
    with source:
        report.total = len(source.shards)
        total = sum(shard_weight(shard) for shard in source.shards)
        with progress_bar("verify", total, "B", quiet) as bar:

            def progress(what: str, n: int) -> None:
                if what == "done":
                    bar.update(n)

            for done in run(source, opener, _setup, _check_shard, range(len(source.shards)), executor, progress):
                value = done.value if done.error is None else ([done.error], [], 0, 0, False)
                results[done.shard] = value
                for line in value[0] + value[1]:  # found so far, said if interrupted
                    report.problem(line)
                report.blocks += value[2]
                report.examples += value[3]
                report.shards += value[4]
            if total > bar.n:  # shards whose task could not say (its worker lost): checked all the same
                bar.update(total - bar.n)
        ordered = [line for s in sorted(results) for line in results[s][0]]
        ordered += source.problems()
        report.warnings.extend(source.warnings())
        ordered += [line for s in sorted(results) for line in results[s][1]]
        report.problems[:] = dict.fromkeys(ordered)  # each once, as VerifyReport.problem counts them
    return report
