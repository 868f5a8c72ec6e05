"""``atlasfs index``: every shard's file table built and stored ahead of time, shards in
parallel processes (:mod:`atlasfs.commands.jobs`).

Each worker opens the dataset and the table store itself and keeps one shard's table at
a time (its tree's cache holds no blocks), so memory does not grow with the dataset. A
shard whose table is already stored, valid and knowing every size is not built again:
it counts as done at once, so an interrupted run picks up where it stopped.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from atlasfs.commands.jobs import Done, Opener, Report, run
from atlasfs.formats.source import Source
from atlasfs.progress import progress_bar, say
from atlasfs.tree.base import Unreadable
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.layout import UNKNOWN_SIZE
from atlasfs.tree.table.store import TableStore

#: What one shard's indexing found: it was stored before (nothing done), or built now.
STORED_BEFORE, BUILT = "stored before", "built"


@dataclass
class IndexReport:
    """What an index run did: shards stored before, built now, failed (each said in one
    line as it came), and tables that could not be written (logged by the store)."""

    stored_before: int = 0
    built: int = 0
    failed: int = 0
    unstored: int = 0


def make_store(source: Source, index_dir: str | None) -> TableStore:
    """The store ``index`` writes to: beside the dataset, or in ``index_dir``."""
    return TableStore(source.root, index_dir=index_dir, beside=True, storage=source.storage)


def _setup(source: Source, index_dir: str | None) -> tuple[BlockTree, TableStore]:
    store = make_store(source, index_dir)
    # A bad shard or block leaves its shard's table unstored (a mount builds it again and
    # says why) and is named by the parent once, in index's words: the tree does not log it.
    return BlockTree(source, cache_bytes=0, store=store, log_failures=False), store


def _index_shard(state: tuple[BlockTree, TableStore], s: int, report: Report) -> Done:
    """Shard position ``s``'s table, stored unless it already is; one line if it fails."""
    tree, store = state
    shard = tree.shards[s]
    if shard.error is None:
        stored = tree.tables.stored(s)
        if stored is not None and not bool(np.any(stored.size == UNKNOWN_SIZE)):
            return Done(s, value=(STORED_BEFORE, 0))
    unstored = store.failures
    causes: list[str] = []
    try:
        tree.table(s, sizes=True)
    except Unreadable as exc:
        causes = [exc.cause]
    finally:
        tree.forget(s)
    causes = tree.failures(s) or causes  # every failed block, also those sizing skipped
    if causes:
        more = f" (and {len(causes) - 1} more; atlasfs verify lists them)" if len(causes) > 1 else ""
        return Done(s, f"{causes[0]}{more}")
    return Done(s, value=(BUILT, store.failures - unstored))


def index_all(source: Source, opener: Opener, index_dir: str | None, jobs: int,
              on_failure: Callable[[str, str], None] | None = None, result: IndexReport | None = None,
              quiet: bool = False) -> IndexReport:
    """Build and store the table of every shard of ``source`` in ``jobs`` processes, with a
    progress bar on a terminal (none if ``quiet``); each failure is said in one line as it comes. Fills and
    returns ``result`` (as shards are done: an interrupted run's counts are in it)."""
    result = IndexReport() if result is None else result
    names = [shard.name for shard in source.shards]
    setup = functools.partial(_setup, index_dir=index_dir)
    with progress_bar("index", len(names), "shards", quiet) as bar, \
            contextlib.closing(run(source, opener, setup, _index_shard, range(len(names)), jobs,
                                   lambda what, n: None)) as dones:
        for done in dones:
            if done.error is not None:
                result.failed += 1
                say(f"atlasfs: index of shard {names[done.shard]} failed: {done.error}")
            else:
                what, unstored = done.value
                result.unstored += unstored
                if what == STORED_BEFORE:
                    result.stored_before += 1
                else:
                    result.built += 1
            bar.update(1)
    return result


def store_energon_index(source: Source, index_dir: str | None) -> str | None:
    """Store energon's ``index.sqlite`` of the tar view beside the dataset (or in
    ``index_dir``), from the tables just stored; returns None, or why it was not, in one line.
    The tar view's own log lines are held back: a bad shard was said once by the tables' pass."""
    from atlasfs.tree.indexes.served import LoaderFiles
    from atlasfs.tree.tarview import TarView

    store = make_store(source, index_dir)
    tree = BlockTree(source, cache_bytes=0, store=store, log_failures=False)
    position = {shard.name: s for s, shard in enumerate(source.shards)}
    # Each shard's files closed once its tar is laid out: as the tables' pass, one shard's
    # descriptors at a time (80 shards under a limit of 48 failed in sqlite's open).
    view = TarView(tree, store=store, made=lambda shard: tree.forget(position[shard]))
    loaders: LoaderFiles = view.loaders
    quiet = logging.getLogger("atlasfs")
    level, quiet.level = quiet.level, logging.CRITICAL
    try:
        where = loaders.store_sqlite()
    except Unreadable as exc:
        return f"energon's index.sqlite not stored: {exc.cause}"
    except (OSError, sqlite3.Error) as exc:
        return f"energon's index.sqlite not stored: {exc}"
    finally:
        quiet.setLevel(level)
        loaders.close()
    if where is None:
        return "energon's index.sqlite not stored (the folder cannot take it); mounts build it in the user's cache"
    return None
