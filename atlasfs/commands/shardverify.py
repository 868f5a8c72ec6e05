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
    return functools.partial(verify_shards, executor, opener)


def _setup(source: Source) -> Source:
    return source


def _check_shard(source: Source, s: int, report: Report) -> Done:
    """Shard position ``s``: ``(pass problems, block problems, blocks, examples, passed)``."""
    shard = source.shards[s]
    try:
        if shard.error is not None:
            raise shard.error
        shard.prepare()
    except AtlasFormatError as exc:
        return Done(s, value=([str(exc)], [], 0, 0, False))
    first = list(shard.problems())
    report("total", shard.num_blocks)
    later: list[str] = []
    examples = held = 0
    for b in range(shard.num_blocks):
        try:
            examples += len(shard.decode_block(b)[0])
        except AtlasFormatError as exc:
            later.append(str(exc))
        held += 1
        if held == EVERY:
            report("done", held)
            held = 0
    report("done", held)
    return Done(s, value=(first, later, shard.num_blocks, examples, True))


def verify_shards(executor: Executor, opener: Opener, open_source: Callable[[], Source], *,
                  on_block: Callable[[], None] | None = None, on_total: Callable[[Any], None] | None = None,
                  report: Any = None) -> Any:
    """:func:`~atlasfs.commands.inspection.verify` on ``executor``: the same report, the
    same lines in the same order, with a bar of its own (``on_block`` and ``on_total`` are
    not called): a shard's blocks are counted by its task, so the bar's total grows as they
    come, as export's does."""
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
        with progress_bar("verify", None, "blocks") as bar:

            def progress(what: str, n: int) -> None:
                if what == "total":  # a shard's blocks are known once a task made its pass
                    bar.total = (bar.total or 0) + n
                    bar.refresh()
                else:
                    bar.update(n)

            for done in run(source, opener, _setup, _check_shard, range(len(source.shards)), executor, progress):
                value = done.value if done.error is None else ([done.error], [], 0, 0, False)
                results[done.shard] = value
                for line in value[0] + value[1]:  # found so far, said if interrupted
                    report.problem(line)
                report.blocks += value[2]
                report.examples += value[3]
                report.shards += value[4]
        ordered = [line for s in sorted(results) for line in results[s][0]]
        ordered += source.problems()
        report.warnings.extend(source.warnings())
        ordered += [line for s in sorted(results) for line in results[s][1]]
        report.problems[:] = dict.fromkeys(ordered)  # each once, as VerifyReport.problem counts them
    return report
