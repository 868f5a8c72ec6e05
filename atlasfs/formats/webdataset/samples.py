"""A shard's members grouped into samples by webdataset's own rule, and the samples into blocks.

Pure: no I/O, so a later mount regroups the stored members (:mod:`.walk`'s result) the
same way without reading the shard. The rule is ``webdataset.tariterators``'
``base_plus_ext`` and ``group_by_keys`` (webdataset 1.0.2): a member's key is its path up
to the first ``.`` of its last component and its field the rest, lower-cased; a sample is
a run of adjacent members with the same key. What webdataset would refuse or could not
show as a file is left out with one problem line naming the shard and member: a name it
cannot split (no ``.`` in its last component), a field that is no file name (empty, or
metadata-like ``__x__``), a second member of one field in one sample (webdataset raises
``duplicate file name in tar file``; with a continuing handler it drops that member, as
here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from atlasfs.formats.naming import field_name_problem, index_key_width, is_metadata

#: webdataset's ``base_plus_ext``: (key, field) of a member name.
_KEY_FIELD = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
#: Most samples a block holds.
BLOCK_SAMPLES = 256
#: A block takes no more samples once its members' bytes reach this (a big sample is a block alone).
BLOCK_BYTES = 8 << 20


def key_field(name: str) -> tuple[str, str] | None:
    """``(key, field)`` of a member name as webdataset splits it (field lower-cased), or None."""
    match = _KEY_FIELD.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


@dataclass
class Samples:
    """A shard's samples and blocks.

    ``starts[i]:starts[i + 1]`` are sample ``i``'s entries of ``members`` (indices into
    the walk's members, in archive order); ``blocks[b]:blocks[b + 1]`` are block ``b``'s
    samples; ``damaged`` maps a sample whose member runs past the file's end to why."""

    keys: list[str]
    starts: np.ndarray
    members: np.ndarray
    blocks: np.ndarray
    damaged: dict[int, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    key_width: int = 6

    @property
    def count(self) -> int:
        """Samples in the shard."""
        return len(self.keys)


def group(path: str, names: list[str], offsets: np.ndarray, sizes: np.ndarray, file_size: int,
          cut: str | None = None) -> Samples:
    """The samples of the members ``names`` (data at ``offsets``, ``sizes`` bytes) of the
    shard ``path``, which is ``file_size`` bytes long now; ``cut``: why its headers stop
    before the archive's end (:attr:`.walk.Walk.cut`), which fails its last sample."""
    keys: list[str] = []
    starts: list[int] = []
    members: list[int] = []
    problems: list[str] = []
    damaged: dict[int, str] = {}
    seen: set[str] = set()  # the current sample's fields
    for m, name in enumerate(names):
        split = key_field(name)
        if split is None:
            problems.append(f"{path} member {name!r}: no '.' in its file name, so webdataset cannot group it "
                            "into a sample; left out")
            continue
        key, suffix = split
        problem = field_name_problem(suffix) or (f"field name {suffix!r} is reserved for metadata"
                                                 if is_metadata(suffix) else None)
        if problem:
            problems.append(f"{path} member {name!r}: {problem}; left out")
            continue
        if not keys or key != keys[-1]:
            keys.append(key)
            starts.append(len(members))
            seen = set()
        elif suffix in seen:
            problems.append(f"{path} member {name!r}: a second {suffix!r} file in sample {key!r} (webdataset "
                            "refuses it: duplicate file name); left out")
            continue
        seen.add(suffix)
        members.append(m)
        end = int(offsets[m]) + int(sizes[m])
        if end > file_size:
            damaged[len(keys) - 1] = (f"{path} member {name!r}: truncated (its {int(sizes[m])} bytes end at "
                                      f"offset {end}, the file has {file_size})")
    if cut is not None:
        if not keys:
            problems.append(f"{path}: {cut}; no sample before it")
        elif len(keys) - 1 not in damaged:  # it may lack the files after the cut
            damaged[len(keys) - 1] = f"{path} sample {keys[-1]!r}: may lack files, as the tar after it is {cut}"
    starts.append(len(members))
    member_array = np.array(members, dtype=np.int64)
    start_array = np.array(starts, dtype=np.int64)
    problems.extend(damaged[i] for i in sorted(damaged))
    return Samples(keys, start_array, member_array, _blocks(start_array, member_array, sizes, damaged),
                   damaged, problems, _key_width(keys))


def _blocks(starts: np.ndarray, members: np.ndarray, sizes: np.ndarray, damaged: dict[int, str]) -> np.ndarray:
    """Block boundaries (sample indices): runs of at most :data:`BLOCK_SAMPLES` samples and
    about :data:`BLOCK_BYTES`; a damaged sample is a block alone, so it fails alone."""
    count = len(starts) - 1
    sample_bytes = np.add.reduceat(sizes[members], starts[:-1]) if len(members) else np.zeros(0, np.int64)
    bounds = [0]
    taken = 0
    for i in range(count):
        here = i - bounds[-1]
        if here and (here >= BLOCK_SAMPLES or taken >= BLOCK_BYTES or i in damaged or i - 1 in damaged):
            bounds.append(i)
            taken = 0
        taken += int(sample_bytes[i])
    if count:
        bounds.append(count)
    return np.array(bounds, dtype=np.int64)


def _key_width(keys: list[str]) -> int:
    """Digits of index keys (given to samples whose key cannot be a file name, or repeats):
    the usual width, made longer than it would be while it equals the length of a key of
    digits only, so that a key such as ``000123`` (webdataset's common kind) is kept as it
    is rather than taken for another sample's index key."""
    width = index_key_width(len(keys))
    digit_lengths = {len(k) for k in keys if k.isascii() and k.isdigit()}
    while width in digit_lengths:
        width += 1
    return width
