"""``atlasfs info``, ``verify`` and ``show``: looking at a dataset of any format without
mounting it, each through the one source interface (a format says what is its own through
:meth:`~atlasfs.formats.source.SourceShard.summary`, :meth:`~atlasfs.formats.source.Source.info`
and :meth:`~atlasfs.formats.source.Source.warnings`)."""

from __future__ import annotations

import itertools
import reprlib
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from atlasfs.errors import AtlasFormatError
from atlasfs.formats.source import Source, SourceShard


def _prepared(shard: SourceShard) -> SourceShard:
    """The shard after its pass over its files (raises :class:`AtlasFormatError`)."""
    if shard.error is not None:
        raise shard.error
    shard.prepare()
    return shard


def info_lines(source: Source) -> tuple[list[str], int]:
    """A readable summary of ``source``: totals, the format's own lines, then one row per
    shard; and how many shards have problems (each one row saying what is wrong; the totals
    are the others'). Shards that need a pass over their files (Dolma) make it."""
    rows: list[tuple[SourceShard, dict[str, object] | str]] = []
    for shard in source.shards:
        try:
            _prepared(shard)
            summary: dict[str, object] | str = {
                "examples": sum(shard.block_length(b) for b in range(shard.num_blocks)),
                "blocks": shard.num_blocks, **shard.summary()}
        except AtlasFormatError as exc:
            summary = str(exc)
        rows.append((shard, summary))
    good = [summary for _, summary in rows if isinstance(summary, dict)]
    problems = len(rows) - len(good)
    lines = [f"dataset      {source.root}",
             f"examples     {sum(int(row['examples']) for row in good)}",  # type: ignore[call-overload]
             f"shards       {len(rows)}" + (f" ({problems} with problems, below)" if problems else ""),
             f"blocks       {sum(int(row['blocks']) for row in good)}",  # type: ignore[call-overload]
             *source.info(),
             f"checked      {source.checked} (atlasfs verify decodes every block)",
             ""]
    columns = list(good[0]) if good else ["examples", "blocks"]
    width = max([len(shard.name) for shard, _ in rows] + [8])
    widths = [max([len(c)] + [len(str(row.get(c, ""))) for row in good]) for c in columns]
    lines.append(" ".join([f"{'shard':>{width}}"] + [f"{c:>{w}}" for c, w in zip(columns, widths)]))
    for shard, summary in rows:
        if isinstance(summary, str):
            lines.append(f"{shard.name:>{width}} problem: {summary}")
        else:
            lines.append(" ".join([f"{shard.name:>{width}}"] +
                                  [f"{str(summary.get(c, '-')):>{w}}" for c, w in zip(columns, widths)]))
    return lines, problems


@dataclass
class VerifyReport:
    """What ``verify`` found: problems (each one line naming a file) and what was checked
    (``shards`` of the dataset's ``total``: an interrupted verify's are those done so far)."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    shards: int = 0
    total: int = 0
    blocks: int = 0
    examples: int = 0
    _said: set[str] = field(default_factory=set, repr=False)

    def problem(self, line: str) -> None:
        """Count ``line`` once: a shard's pass and its block's decode can find the same
        thing (a WebDataset tar cut short: its last sample may lack files, said by both)."""
        if line not in self._said:
            self._said.add(line)
            self.problems.append(line)


def verify(opener: Callable[[], Source], *, on_block: Callable[[], None] | None = None,
           on_total: Callable[[int], None] | None = None, report: VerifyReport | None = None) -> VerifyReport:
    """Check a source of any format: open it, make every shard's pass, decode every block.
    Every problem is reported (one line each) and the check goes on. Fills and returns
    ``report`` (as it goes: what an interrupted check found is in it)."""
    report = VerifyReport() if report is None else report
    try:
        source = opener()
    except AtlasFormatError as exc:
        report.problem(str(exc))
        return report
    with source:
        report.total = len(source.shards)
        ready = []
        for shard in source.shards:
            try:
                ready.append(_prepared(shard))
            except AtlasFormatError as exc:
                report.problem(str(exc))
                continue
            for line in shard.problems():
                report.problem(line)
        for line in source.problems():
            report.problem(line)
        report.warnings.extend(source.warnings())
        if on_total is not None:
            on_total(sum(shard.num_blocks for shard in ready))
        for shard in ready:
            for b in range(shard.num_blocks):
                try:
                    report.examples += len(shard.decode_block(b)[0])
                except AtlasFormatError as exc:
                    report.problem(str(exc))
                report.blocks += 1
                if on_block is not None:
                    on_block()
            report.shards += 1
    return report


def locate(source: Source, index: int) -> tuple[SourceShard, int, int, int]:
    """``(shard, block, position, global index)`` of the sample at ``index`` over all shards
    (negative: from the end). A shard that cannot be read still counts its samples if it
    knows how many (an Atlas shard from its root ``meta.json``); the sample asked for being
    in it, or past one that does not know, raises its error. IndexError says how many samples
    there are."""
    places: list[tuple[SourceShard, int, int, AtlasFormatError | None]] = []
    for shard in source.shards:
        try:
            _prepared(shard)
        except AtlasFormatError as exc:
            places.append((shard, -1, len(shard) if isinstance(shard, Sized) else -1, exc))
            continue
        places.extend((shard, b, shard.block_length(b), None) for b in range(shard.num_blocks))
    unknown = next((error for _, _, length, error in places if length < 0), None)
    total = sum(length for _, _, length, _ in places if length >= 0)
    if unknown is not None and index < 0:
        raise unknown  # counting from the end needs every shard's length
    i = index + total if index < 0 else index
    if i < 0:
        raise IndexError(f"index {index} out of range: the dataset has {total} samples")
    for shard, block, length, error in places:
        if error is not None and (length < 0 or i < length):
            raise error
        if i < length:
            return shard, block, i, index + total if index < 0 else index
        i -= length
    raise IndexError(f"index {index} out of range: the dataset has {total} samples")


def describe(value: Any, indent: str = "") -> list[str]:
    """Readable lines for one example: fields with types, sizes and a short preview."""
    if isinstance(value, dict):
        lines = [f"{indent}{type(value).__name__} with {len(value)} fields"]
        for name, field_value in value.items():
            lines.append(f"{indent}  {name!r}: {_summary(field_value)}")
        return lines
    return [f"{indent}{_summary(value)}"]


class _InOrder(reprlib.Repr):
    """reprlib's short repr, but a dict keeps the example's own key order (reprlib sorts keys)."""

    def repr_dict(self, x: dict, level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                  for k, v in itertools.islice(x.items(), self.maxdict)]
        if len(x) > self.maxdict:
            pieces.append("...")
        return "{" + ", ".join(pieces) + "}"


_short = _InOrder()
_short.maxstring = 80
_short.maxother = 80
_short.maxlist = _short.maxtuple = _short.maxdict = _short.maxset = 8


def _summary(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return f"{type(value).__name__}, {len(value)} bytes: {_short.repr(bytes(value[:48]))}"
    if isinstance(value, np.ndarray):
        preview = np.array2string(value, threshold=8, edgeitems=2, max_line_width=60).replace("\n", " ")
        return f"ndarray {value.dtype} {value.shape}: {preview}"
    if isinstance(value, str):
        return f"str, {len(value)} chars: {_short.repr(value)}"
    return f"{type(value).__name__}: {_short.repr(value)}"
