"""Megatron-Energon's files of a prepared dataset, as ``energon prepare`` (7.4.1) writes them.

``energon prepare D`` lists ``D/**/*.tar`` (sorted as paths: by their parts), reads each
tar with :mod:`tarfile` and writes, relative to ``D``:

- ``<shard>.tar.idx``: little-endian uint64s, one per sample, where the sample's first
  member begins (its pax header if it has one), then where the end-of-archive blocks begin;
- ``.nv-meta/.info.json``: ``{"energon_version": ..., "shard_counts": {tar: samples}}``
  (``json.dump(indent=2)``, no final newline), keys in the sorted order, which numbers the
  tars (``tar_file_id``);
- ``.nv-meta/split.yaml``: ``split_parts`` (each part's tars, runs brace-collapsed as
  energon's ``bracecollapse`` does in order) and ``exclude: []``;
- ``.nv-meta/dataset.yaml``: the sample type (``--sample-type CrudeWebdataset``: two lines);
- ``.nv-meta/index.sqlite``: tables ``samples`` (a row a sample: tar id, key, index in its
  tar, offset and bytes up to the next sample) and ``sample_parts`` (a row a member: tar
  id, sample index, part name, data offset, size), with three indexes;
- ``.nv-meta/index.uuid``: a random UUID, new at each prepare that changed the index.

A member counts when it is a regular file whose name splits as energon splits it (a key:
up to the first dot of the last path part; a part name: the rest) and is not a
``__meta__`` name; consecutive members of one key are one sample. Everything here is
computed from a :class:`~atlasfs.tree.tarview.TarLayout` (names, sizes, offsets), never
from the tar's bytes. ``index.uuid`` is not random here but a hash of what the indexes
say (stable for a dataset, new when its offsets change, as energon's joins need).
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import struct
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

#: The energon release whose files these are (written as ``energon_version``).
ENERGON_VERSION = "7.4.1"
META_FOLDER = ".nv-meta"
INFO_NAME = ".info.json"
SPLIT_NAME = "split.yaml"
DATASET_NAME = "dataset.yaml"
SQLITE_NAME = "index.sqlite"
UUID_NAME = "index.uuid"
TAR_INDEX_SUFFIX = ".idx"  # after ".tar"
#: ``dataset.yaml`` of ``energon prepare --sample-type CrudeWebdataset``.
CRUDE_DATASET = b"__module__: megatron.energon\n__class__: CrudeWebdataset\n"

# megatron/energon/flavors/webdataset/config.py
_SPLIT_NAME_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META_RE = re.compile(r"__[^/]*__($|/)")


class Layout(Protocol):
    """What is read of a tar layout: member names, sizes, header and data offsets."""

    starts: np.ndarray
    sizes: np.ndarray

    def __len__(self) -> int: ...
    def name(self, i: int) -> str: ...
    def data_starts(self) -> np.ndarray: ...


def split_member(name: str) -> tuple[str, str] | None:
    """(key, part name) of a member as energon splits it, or None if energon skips it."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot > slash + 1 and not name.startswith("__") and "\n" not in name:
        # the regex's answer when the last part has a key before its first dot (its greedy
        # ``.*/`` takes the last slash), no ``__meta__`` name begins the path and no newline
        # (which the regexes' ``.`` does not match) is in it: the regexes for the rest (a last
        # part beginning with a dot may take a key across a slash)
        return name[:dot], name[dot + 1:]
    if _SKIP_META_RE.match(name):
        return None
    match = _SPLIT_NAME_RE.match(name)
    return None if match is None else (match.group(1), match.group(2))


@dataclass(frozen=True)
class Members:
    """The members energon counts in one tar (:func:`counted`): ``member`` their indexes in
    the tar, ``sample`` each one's sample index, ``parts`` each one's part name; ``keys`` each
    sample's key and ``firsts`` its first member's index."""

    member: np.ndarray
    sample: np.ndarray
    parts: list[str]
    keys: list[str]
    firsts: np.ndarray


def counted(layout: Layout) -> Members:
    """The :class:`Members` of ``layout`` (made each time: the ``.tar.idx`` made from them is
    kept by the view, and ``index.sqlite``'s rows are made once a dataset)."""
    names = layout_names(layout)
    plain = _counted_plain(names)
    if plain is not None:
        return plain
    member: list[int] = []
    sample: list[int] = []
    parts: list[str] = []
    keys: list[str] = []
    firsts: list[int] = []
    last = None
    for i, name in enumerate(names):
        split = split_member(name)
        if split is None:
            continue
        key, part = split
        if key != last:
            last = key
            keys.append(key)
            firsts.append(i)
        member.append(i)
        sample.append(len(keys) - 1)
        parts.append(part)
    return Members(np.array(member, dtype=np.int64), np.array(sample, dtype=np.int64), parts, keys,
                   np.array(firsts, dtype=np.int64))


def _counted_plain(names: list[str]) -> Members | None:
    """:func:`counted`'s answer when every name is one :func:`split_member` splits at its first
    dot (no slash, no newline, a key before the dot, no ``__`` first: a shard's usual tar), made
    for all at once; None if some name is not."""
    joined = "".join(names)
    if "/" in joined or "\n" in joined or "\0" in joined:  # (numpy drops trailing NULs of its strings)
        return None
    split = [name.partition(".") for name in names]
    keys = [key for key, _, _ in split]
    if not all(keys) or not all(dot for _, dot, _ in split) or "\n__" in "\n" + "\n".join(keys):
        return None
    n = len(keys)
    if not n:
        return Members(np.zeros(0, np.int64), np.zeros(0, np.int64), [], [], np.zeros(0, np.int64))
    text = np.array(keys)
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.not_equal(text[1:], text[:-1], out=new[1:])
    firsts = np.flatnonzero(new)
    return Members(np.arange(n, dtype=np.int64), np.cumsum(new, dtype=np.int64) - 1,
                   [part for _, _, part in split], [keys[i] for i in firsts.tolist()], firsts.astype(np.int64))


def layout_names(layout: Layout) -> list[str]:
    """Every member's name, in tar order (at once, from a layout that makes them so)."""
    names = getattr(layout, "names", None)
    if names is not None:
        return names()
    return [layout.name(i) for i in range(len(layout))]


def members(layout: Layout) -> Iterator[tuple[int, int, str, str]]:
    """(member, sample index, key, part name) of every member energon counts, in tar order."""
    found = counted(layout)
    for i, index, part in zip(found.member.tolist(), found.sample.tolist(), found.parts):
        yield i, index, found.keys[index], part


def sample_starts(layout: Layout, found: Members | None = None) -> np.ndarray:
    """Offsets of each sample's first member, then where the end blocks begin: the ``.tar.idx``
    (of ``found``, the layout's :func:`counted` members, if given)."""
    firsts = (found if found is not None else counted(layout)).firsts
    out = np.empty(len(firsts) + 1, dtype="<u8")
    out[:-1] = layout.starts[firsts]
    out[-1] = layout.starts[-1]
    return out


def tar_index(layout: Layout) -> bytes:
    """``<shard>.tar.idx``: :func:`sample_starts` as little-endian uint64s."""
    return sample_starts(layout).tobytes()


def samples_of(tar_index_bytes: bytes) -> int:
    """The samples a ``.tar.idx`` counts."""
    return len(tar_index_bytes) // 8 - 1


def tar_order(names: Sequence[str]) -> list[str]:
    """Tar paths in the order ``energon prepare`` numbers them (sorted as paths, by parts)."""
    return sorted(names, key=lambda name: name.split("/"))


def info_json(counts: Sequence[tuple[str, int]], version: str = ENERGON_VERSION) -> bytes:
    """``.nv-meta/.info.json`` of ``(tar, samples)`` in :func:`tar_order`."""
    info = {"energon_version": version, "shard_counts": dict(counts)}
    return json.dumps(info, indent=2).encode()


# ------------------------------------------------------------------ split.yaml


def collapse(names: Sequence[str]) -> list[str]:
    """Runs of names differing in one number, counting up by one at the same width, as one
    brace range (``0.tar 1.tar 2.tar`` -> ``{0..2}.tar``), order kept: energon's
    ``bracecollapse.collapse(keep_order=True)``."""
    out: list[str] = []
    tokens = [_tokenize(name) for name in names]
    i = 0
    while i < len(names):
        lits0, nums0 = tokens[i]
        if not nums0:
            out.append(names[i])
            i += 1
            continue
        slot, prev, end = -1, nums0, i
        j = i + 1
        while j < len(names):
            lits1, nums1 = tokens[j]
            if lits1 != lits0 or len(nums1) != len(nums0):
                break
            diff = [k for k, (a, b) in enumerate(zip(prev, nums1)) if a[1] != b[1]]
            if len(diff) != 1:
                break
            k = diff[0]
            if nums1[k][2] != prev[k][2] or (slot != -1 and slot != k) or nums1[k][1] != prev[k][1] + 1:
                break
            slot, prev, end = k, nums1, j
            j += 1
        if end > i:
            parts = []
            for k, (raw, _, _) in enumerate(nums0):
                parts += [lits0[k], f"{{{raw}..{prev[k][0]}}}" if k == slot else raw]
            out.append("".join(parts) + lits0[-1])
            i = end + 1
        else:
            out.append(names[i])
            i += 1
    return out


_NUMBER = re.compile(r"\d+")


def _tokenize(name: str) -> tuple[list[str], list[tuple[str, int, int]]]:
    lits, nums, pos = [], [], 0
    for match in _NUMBER.finditer(name):
        lits.append(name[pos:match.start()])
        nums.append((match.group(0), int(match.group(0)), len(match.group(0))))
        pos = match.end()
    lits.append(name[pos:])
    return lits, nums


def split_by_ratio(names: Sequence[str], ratio: Sequence[float]) -> dict[str, list[str]]:
    """train/val/test parts of ``names`` (in :func:`tar_order`) by ``ratio``, as ``energon
    prepare --split-ratio`` without ``--shuffle-tars`` cuts them."""
    total = sum(ratio)
    parts, at, offset = {}, 0.0, 0
    for part, share in zip(("train", "val", "test"), ratio):
        at += share / total
        end = int(len(names) * at)
        parts[part] = list(names[offset:end])
        offset = end
    return parts


def split_yaml(parts: dict[str, list[str]]) -> bytes:
    """``.nv-meta/split.yaml`` of each part's tars (collapsed), ``exclude: []``: as PyYAML
    dumps it for names of ASCII letters, digits, ``_./-+'``, spaces, commas and braces; equal in
    content for others (quoted where PyYAML may not quote them)."""
    lines = ["split_parts:"]
    for part, names in parts.items():
        collapsed = collapse(names)
        lines.append(f"  {_yaml_scalar(part)}:" + ("" if collapsed else " []"))
        lines += [f"  - {_yaml_scalar(name)}" for name in collapsed]
    lines.append("exclude: []")
    return ("\n".join(lines) + "\n").encode()


# Plain in PyYAML's block style: no indicator first, braces and commas allowed after it
_PLAIN = re.compile(r"(?:[A-Za-z0-9_./]|-(?=[^ ]))[A-Za-z0-9_./{},+' -]*(?<! )")
# PyYAML's implicit resolvers (a plain scalar matching one is not read back as a string)
_RESOLVED = re.compile(r"""(?:yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF
    |null|Null|NULL
    |[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+
    |[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)
    |[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9])""", re.X)


def _yaml_scalar(text: str) -> str:
    if _PLAIN.fullmatch(text) and not _RESOLVED.fullmatch(text):
        return text
    if text.isascii() and text.isprintable():
        return "'" + text.replace("'", "''") + "'"
    return '"' + "".join(_yaml_escaped(char) for char in text) + '"'


_YAML_ESCAPES = {"\0": "0", "\x07": "a", "\x08": "b", "\t": "t", "\n": "n", "\x0b": "v", "\x0c": "f", "\r": "r",
                 "\x1b": "e", '"': '"', "\\": "\\", "\x85": "N", "\xa0": "_", "\u2028": "L", "\u2029": "P"}


def _yaml_escaped(char: str) -> str:
    """A character of a double-quoted scalar as PyYAML writes it (``allow_unicode`` off)."""
    if char in _YAML_ESCAPES:
        return "\\" + _YAML_ESCAPES[char]
    if " " <= char <= "~":
        return char
    code = ord(char)
    return f"\\x{code:02X}" if code <= 0xFF else f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}"


# ------------------------------------------------------------------ index.sqlite

# The statements of energon's SqliteIndexWriter, text and all (sqlite_master keeps it).
_CREATE_SAMPLES = """
                CREATE TABLE IF NOT EXISTS samples (
                    tar_file_id INTEGER NOT NULL,
                    sample_key TEXT NOT NULL UNIQUE,
                    sample_index INTEGER NOT NULL,
                    byte_offset INTEGER,
                    byte_size INTEGER
                )
                """
_CREATE_PARTS = """
                CREATE TABLE IF NOT EXISTS sample_parts (
                    tar_file_id INTEGER,
                    sample_index INTEGER,
                    part_name TEXT,
                    content_byte_offset INTEGER,
                    content_byte_size INTEGER
                )
                """
_INDEXES = (
    "CREATE INDEX IF NOT EXISTS idx_samples_by_tar_and_idx ON samples(tar_file_id, sample_index)",
    "CREATE INDEX IF NOT EXISTS idx_sample_parts_seq ON sample_parts(tar_file_id, sample_index, content_byte_offset)",
    "CREATE INDEX IF NOT EXISTS idx_sample_parts_full ON sample_parts(tar_file_id, sample_index, part_name, "
    "content_byte_offset, content_byte_size)",
)
#: What ``sqlite_master`` of an ``index.sqlite`` holds: (type, name) of its tables and indexes.
SCHEMA = (("table", "samples"), ("index", "sqlite_autoindex_samples_1"), ("table", "sample_parts"),
          ("index", "idx_samples_by_tar_and_idx"), ("index", "idx_sample_parts_seq"),
          ("index", "idx_sample_parts_full"))


class DuplicateKey(ValueError):
    """Two samples of the dataset share a key: energon's index cannot hold them."""


def sample_rows(tar_id: int, layout: Layout) -> tuple[list[tuple], list[tuple]]:
    """The ``samples`` and ``sample_parts`` rows of the tar numbered ``tar_id``."""
    found = counted(layout)
    starts = sample_starts(layout, found)
    offsets = starts[:-1].tolist()
    samples = list(zip([tar_id] * len(found.keys), found.keys, range(len(found.keys)), offsets,
                       np.diff(starts).tolist()))
    data = layout.data_starts()[found.member].tolist()
    sizes = layout.sizes[found.member].tolist()
    parts = list(zip([tar_id] * len(found.parts), found.sample.tolist(), found.parts, data, sizes))
    return samples, parts


def write_sqlite(path: str, tars: Iterator[tuple[list[tuple], list[tuple]]]) -> None:
    """Write energon's ``index.sqlite`` to the new file ``path`` from each tar's
    :func:`sample_rows`, in tar id order; :class:`DuplicateKey` if a key repeats."""
    db = sqlite3.connect(path)
    try:
        # A new file, renamed into place once whole or removed (sqlitefile.build), as file tables
        # are stored: no journal on disk and no fsync (four of them cost ~45 ms on a disk; the
        # database's bytes are the same either way)
        db.execute("PRAGMA journal_mode = MEMORY")
        db.execute("PRAGMA synchronous = OFF")
        db.execute(_CREATE_SAMPLES)
        db.execute(_CREATE_PARTS)
        for samples, parts in tars:
            try:
                db.executemany("INSERT INTO samples (tar_file_id, sample_key, sample_index, byte_offset, byte_size) "
                               "VALUES (?, ?, ?, ?, ?)", samples)
            except sqlite3.IntegrityError:
                raise DuplicateKey(_duplicate(db, samples)) from None
            db.executemany("INSERT INTO sample_parts (tar_file_id, sample_index, part_name, content_byte_offset, "
                           "content_byte_size) VALUES (?, ?, ?, ?, ?)", parts)
        for statement in _INDEXES:
            db.execute(statement)
        db.commit()
    finally:
        db.close()


def _duplicate(db: sqlite3.Connection, samples: list[tuple]) -> str:
    seen: set[str] = set()
    for row in samples:
        if row[1] in seen or db.execute("SELECT 1 FROM samples WHERE sample_key = ?", (row[1],)).fetchone():
            return str(row[1])
        seen.add(row[1])
    return str(samples[0][1])


def dataset_uuid(info: bytes, tar_indexes: Iterator[bytes]) -> bytes:
    """``index.uuid``: a UUID made from ``.info.json`` and every ``.tar.idx`` (the offsets a
    join's cached index holds), so the same while the dataset is, new when an offset moves."""
    digest = hashlib.sha256(info)
    for data in tar_indexes:
        digest.update(struct.pack("<Q", len(data)))
        digest.update(data)
    return str(uuid.UUID(bytes=digest.digest()[:16], version=4)).encode()
