"""``atlasfs pack``'s samples: what a mount shows of a source, as Atlas examples that show the same.

A sample is taken as the mount serves it: its files' names from the shard's file table
and their bytes from the tree (:meth:`~atlasfs.tree.blocks.Blocks.encoded_example`, what a
read returns). It becomes ``{"__key__": key, "<suffix>": bytes, ...}``: the naming layer
keeps a bytes field's name as it is, so the packed dataset's mount shows ``<key>.<suffix>``
with the same bytes. With ``decode`` a field whose extension has one of webdataset's
default decoders (``.cls`` to int, ``.txt`` to str, ``.json``, ``.npy``, ``.npz``) holds the
decoded value instead, only where encoding it again gives the same bytes back; pickles
are kept as bytes (unpickling runs code). Every example is checked against the naming
rules it will be shown by (its files and its key), so a pack whose mount would differ
stops, naming the sample.
"""

from __future__ import annotations

import io
import json
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any, Callable

import numpy as np

from atlasfs.formats.naming import (INT_EXTS, JSON_EXTS, MAX_NAME_BYTES, TEXT_EXTS, KeyAssigner, encode_as,
                                    example_files, field_suffix)
from atlasfs.tree.base import Unreadable
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.layout import UNREADABLE

Files = list[tuple[str, bytes]]


class PackError(Exception):
    """Why a pack stops, one line naming the shard or sample."""


def split_name(path: str) -> tuple[str, str]:
    """``(key, suffix)`` of a mounted file's path ``<key>.<suffix>``: a suffix has no ``/``
    and a key's last component no ``.``, so the key ends at the first ``.`` after the last ``/``."""
    start = path.rfind("/") + 1
    dot = path.index(".", start)
    return path[:dot], path[dot + 1:]


def shard_samples(tree: BlockTree, s: int, start: int, stop: int) -> Iterator[tuple[str, Files]]:
    """``(key, [(suffix, bytes)...])`` of samples ``start:stop`` of shard position ``s``, in
    order, as its mount shows them. Raises :class:`~atlasfs.tree.base.Unreadable` for a shard
    or block that cannot be read."""
    table = tree.table(s)
    shard = tree.shards[s]
    starts = np.zeros(shard.num_blocks + 1, dtype=np.int64)
    np.cumsum([shard.block_length(b) for b in range(shard.num_blocks)], out=starts[1:])
    rows = np.asarray(table.example_order(), dtype=np.int64)
    if not len(rows):
        return
    local = starts[table.block[rows].astype(np.int64)] + table.pos[rows].astype(np.int64)
    keep = (local >= start) & (local < stop)
    rows, local = rows[keep], local[keep]
    cuts = np.flatnonzero(np.diff(local)) + 1
    for group in np.split(rows, cuts):
        first = int(group[0])
        block, pos = int(table.block[first]), int(table.pos[first])
        if bool(np.any(table.kind[group] == UNREADABLE)):
            raise Unreadable(tree.blocks.failure(s, block))
        data = tree.blocks.encoded_example(s, block, pos)
        names = [table.row(int(i)).path for i in group[np.argsort(table.file[group], kind="stable")]]
        if len(names) != len(data):
            raise tree.blocks.mismatch(s, block)
        key = split_name(names[0])[0]
        yield key, [(split_name(name)[1], payload) for name, payload in zip(names, data)]


def _npz(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


#: webdataset's default decoders (``WebDataset(...).decode()``) for the extensions the naming
#: layer encodes; pickles are left out: unpickling runs code.
DECODERS: dict[str, Callable[[bytes], Any]] = {
    **{ext: lambda data: int(data) for ext in INT_EXTS},
    **{ext: lambda data: data.decode("utf-8") for ext in TEXT_EXTS},
    **{ext: lambda data: json.loads(data) for ext in JSON_EXTS},
    "npy": lambda data: np.load(io.BytesIO(data), allow_pickle=False),
    "npz": _npz,
}


class ExampleMaker:
    """Makes the Atlas examples of one packed shard whose first example has global index
    ``first_index`` in a dataset of ``total`` examples, checking each against the rules its
    mount will name it by. ``kept`` counts, per extension, the fields ``decode`` left as
    bytes because their decoded value would not give the same bytes back."""

    def __init__(self, width: int, decode: bool) -> None:
        self.assigner = KeyAssigner(width)
        self.max_suffix = MAX_NAME_BYTES - 1 - width
        self.decode = decode
        self.kept: Counter[str] = Counter()

    def _value(self, suffix: str, data: bytes) -> Any:
        ext = suffix.rsplit(".", 1)[-1].lower()
        decoder = DECODERS.get(ext)
        if decoder is None:
            return data
        try:
            value = decoder(data)
            if field_suffix(suffix, value) == suffix and encode_as(suffix, value) == data:
                return value
        except Exception:  # noqa: BLE001 (bytes no decoder takes are kept as they are)
            pass
        self.kept[ext] += 1
        return data

    def make(self, key: str, files: Files, index: int, where: str) -> dict[str, Any]:
        """The example of the sample ``key`` (global ``index``, ``where`` names it for errors)."""
        example: dict[str, Any] = {"__key__": key}
        # Field names interned: a block's pickle then names each once and refers back to it, as
        # the pickle of examples made with literal keys does (the reference's sizes, byte for byte).
        example.update((sys.intern(suffix), self._value(suffix, data)) for suffix, data in files)
        shown, note = example_files(example, self.max_suffix)
        if self.decode and shown != files:
            example = {"__key__": key, **{sys.intern(suffix): data for suffix, data in files}}  # whatever did not round trip: all bytes
            shown, note = example_files(example, self.max_suffix)
        if shown != files or note:
            why = note or "its files would be named or ordered otherwise"
            raise PackError(f"{where}: sample {key!r} cannot be packed as it is shown ({why})")
        longest = max(len(suffix.encode("utf-8")) for suffix, _ in files)
        got, note = self.assigner.assign(key, index, longest)
        if got != key:
            raise PackError(f"{where}: sample {key!r} would be shown as {got!r} in the packed dataset ({note})")
        return example
