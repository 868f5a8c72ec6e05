"""lavender-data's join of one shard's files by uid (:func:`join`), and what the join's result
decides besides (which uids cannot be keys, how wide index keys are, how many samples a block
holds). Pure functions of the uids the pass found; nothing here reads a file."""

from __future__ import annotations

import re

import numpy as np

from atlasfs.formats.lavender.errors import Problems
from atlasfs.formats.naming import index_key_width, key_problem

#: Uids surely safe as keys, told apart without :func:`naming.key_problem`'s full check.
_PLAIN_UID = re.compile(r"(?!__|-)[A-Za-z0-9_+=,@:~-]{1,200}")
#: Most samples in a block.
BLOCK_ROWS = 2048


def join(main: str, uids_of: dict[str, list[str | None]], paths: dict[str, str], how: str,
         problems: Problems) -> tuple[list[str], dict[str, np.ndarray], dict[str, list[str]]]:
    """lavender-data's join: the main shardset's rows in file order, each with its row in
    every other shardset found by uid (-1: none); with ``how`` ``inner`` a row some shardset
    lacks is left out. ``uids_of``: each shardset's uid a row (None: no usable uid); ``paths``:
    its file. Returns the samples' uids, the rows per shardset, and per shardset the uids not in
    every shardset here (checked across shards as they open). Every row not shown is one line
    in ``problems`` (or counted there)."""
    firsts: dict[str, dict[str, int]] = {}  # shardset -> uid -> its first row
    for name, uids in uids_of.items():
        count = len(uids)
        mine = dict(zip(reversed(uids), range(count - 1, -1, -1)))
        mine.pop(None, None)  # type: ignore[call-overload]
        if len(mine) != count - uids.count(None):
            repeated(paths[name], uids, problems)
        firsts[name] = mine
    mains = firsts[main]
    order = sorted(mains, key=mains.__getitem__)
    main_path = paths[main]
    for name, mine in firsts.items():
        if name != main:
            for uid, row in mine.items():
                if uid not in mains:
                    problems.add(paths[name], f"{paths[name]} row {row + 1}: uid {uid!r} is not in {main_path} (the "
                                              "main shardset's shard): not shown")
    features = [name for name in firsts if name != main]
    if how == "inner" and features:
        kept = []
        for uid in order:
            lacking = [paths[n] for n in features if uid not in firsts[n]]
            if lacking:
                problems.add(main_path, f"{main_path} row {mains[uid] + 1}: uid {uid!r} is not in {', '.join(lacking)}: "
                                        "left out (join=inner; join=left shows it without those columns)")
            else:
                kept.append(uid)
        order = kept
    arrays = {name: np.fromiter((mine.get(uid, -1) for uid in order), dtype=np.int64, count=len(order))
              for name, mine in firsts.items()}
    partial: dict[str, list[str]] = {}
    if len(firsts) > 1:
        common = set.intersection(*(set(m) for m in firsts.values()))
        for name, mine in firsts.items():
            odd = [uid for uid in mine if uid not in common]
            if odd:
                partial[name] = odd
    return order, arrays, partial


def repeated(path: str, uids: list[str | None], problems: Problems) -> None:
    """One line in ``problems`` per row repeating a uid found in an earlier row of the file."""
    first: dict[str, int] = {}
    for row, uid in enumerate(uids):
        if uid is not None and first.setdefault(uid, row) != row:
            problems.add(path, f"{path} row {row + 1}: uid {uid!r} again (first at row {first[uid] + 1})")


def unsafe_uids(order: list[str]) -> list[int]:
    """The samples (numbers) whose uid cannot be a key (a ``.`` or a ``/`` in it...)."""
    return [number for number, uid in enumerate(order)
            if not _PLAIN_UID.fullmatch(uid) and key_problem(uid, 0) is not None]


def key_width(order: list[str]) -> int:
    """Index-key digits for the samples of uids ``order``: wider than any all-digit uid of exactly
    that width, as the naming layer refuses a ``__key__`` shaped like an index key, so numeric uids
    would lose their names."""
    digit_lengths = {len(uid) for uid in order if uid.isdigit() and uid.isascii()}
    width = index_key_width(len(order))
    while width in digit_lengths:
        width += 1
    return width


def block_rows(groups: list[int]) -> int:
    """Samples per block: a parquet row group of the first shardset, or an even part of one,
    when its groups (but the last) are of one size; else :data:`BLOCK_ROWS`."""
    if not groups:
        return BLOCK_ROWS
    size = groups[0]
    if size <= 0 or any(g != size for g in groups[:-1]) or groups[-1] > size:
        return BLOCK_ROWS
    if size <= BLOCK_ROWS:
        return size
    part = next(d for d in range(BLOCK_ROWS, 0, -1) if size % d == 0)
    return part if part >= BLOCK_ROWS // 4 else BLOCK_ROWS
