"""A folder of WebDataset ``.tar`` shards as a source: a shard (:class:`TarShard`) per tar file."""

from __future__ import annotations

import logging
import os
import tarfile
from typing import Any

import numpy as np

from atlasfs.formats import state
from atlasfs.formats.naming import MAX_NAME_BYTES, example_fields
from atlasfs.formats.source import Source, SourceShard, shown_names, stat_shard_file
from atlasfs.formats.webdataset.samples import BLOCK_BYTES, BLOCK_SAMPLES, Samples, group, key_field
from atlasfs.formats.webdataset.walk import WebDatasetError, Walk, walk
from atlasfs.storage import LOCAL, LocalStorage, Storage, StorageChangedError, StorageUnavailableError
from atlasfs.storage.files import relative
from atlasfs.storage.files import walk as walk_folders

log = logging.getLogger("atlasfs")

SUFFIX = ".tar"
#: Version of what :meth:`TarShard.prepare` returns (:mod:`atlasfs.formats.state`).
STATE_VERSION = 1
#: A block's members are read in one ``pread`` unless the members left out between them
#: (a duplicate, a link's header) would add more than this.
MAX_GAP_BYTES = 1 << 20
#: Problem lines a restoring mount logs per shard (the tree logs as many after a pass).
LOGGED_PROBLEMS = 10
_FIELDS = {"file_size", "names", "offsets", "sizes", "problems", "cut"}


class TarShard(SourceShard):
    """One tar file: a folder of its samples' files, each a member's bytes as they are."""

    def __init__(self, path: str, name: str, storage: Storage = LOCAL) -> None:
        self.path = path
        self.name = name
        self.storage = storage
        self.first_index = 0  # each tar numbers its samples from 0 (index keys are rare: bad keys only)
        # a store's reads go through it; a local file has a descriptor of its own, closed by close()
        self._file = storage if storage.remote else LocalStorage()
        self._walk: Walk | None = None
        self._samples: Samples | None = None
        self._pair: tuple[Walk, Samples] | None = None  # both, set at once: what blocks are read from
        self.mtime, self.data_size, why = stat_shard_file(path, storage)
        if why is not None:
            self.error = WebDatasetError(f"{path}: {why}")

    # -- the pass over the headers

    def prepare(self) -> bytes:
        """Walk the tar's headers (:func:`.walk.walk`), group its members; returns the
        members' names and places, which :meth:`restore` takes back without the walk."""
        if self.error is not None:
            raise self.error
        found = walk(self.path, self.data_size, self.storage)
        self._set(found)
        fields: dict[str, state.Value] = {
            "file_size": self.data_size, "names": found.names, "offsets": found.offsets.astype("<i8"),
            "sizes": found.sizes.astype("<i8"), "problems": found.problems}
        if found.cut is not None:
            fields["cut"] = found.cut
        return state.encode("webdataset", STATE_VERSION, fields)

    def restore(self, saved: bytes) -> None:
        """Take back :meth:`prepare`'s bytes; ``ValueError`` if they are malformed or place a
        member where the file as it is now cannot hold one (the state is untrusted input)."""
        if self.error is not None:
            raise ValueError(str(self.error))
        fields = state.decode(saved, "webdataset", STATE_VERSION)
        fields.only(_FIELDS)
        if fields.integer("file_size") != self.data_size:
            raise state.StateError(f"{self.path}: stored state is of a file of another size")
        offsets = fields.array("offsets", "<i8")
        sizes = fields.array("sizes", "<i8", (len(offsets),))
        names = fields.texts("names", max_count=len(offsets), max_len=1 << 16, one_line=False)
        problems = fields.texts("problems", max_count=1 << 20, max_len=1 << 17)
        if len(names) != len(offsets) or not all(names):
            raise state.StateError(f"{self.path}: stored member names do not match its members")
        if len(offsets):
            ends = offsets + np.minimum(sizes, 1 << 56)
            # a header (512 bytes) before each member's data, after the data before it; sizes
            # bounded first, so that no sum below can overflow
            if (sizes.min() < 0 or sizes.max() > 1 << 56 or offsets.min() < 512 or np.any(offsets % 512)
                    or offsets.max() > self.data_size or np.any(offsets[1:] < ends[:-1] + 512)):
                raise state.StateError(f"{self.path}: stored members overlap or lie outside the file")
        self._set(Walk(list(names), offsets, sizes, problems, fields.optional_text("cut", 1 << 17)))
        shown = self.problems()
        for problem in shown[:LOGGED_PROBLEMS]:  # what the tree logs after a pass, said by a mount that made none
            log.warning("%s", problem)
        if len(shown) > LOGGED_PROBLEMS:
            log.warning("%s: %d more problems (atlasfs verify lists them all)", self.path,
                        len(shown) - LOGGED_PROBLEMS)

    def _set(self, found: Walk) -> None:
        samples = group(self.path, found.names, found.offsets, found.sizes, self.data_size, found.cut)
        self._pair = (found, samples)  # one assignment: a reader never sees a walk with another's samples
        self._walk, self._samples = found, samples

    def _grouped(self) -> tuple[Walk, Samples]:
        pair = self._pair
        if pair is None:
            raise WebDatasetError(f"{self.path}: its headers have not been read")
        return pair

    # -- blocks

    @property
    def num_samples(self) -> int:
        """Samples in the shard (once prepared or restored)."""
        return self._samples.count if self._samples is not None else 0

    @property
    def num_blocks(self) -> int:
        return len(self._samples.blocks) - 1 if self._samples is not None and self._samples.count else 0

    @property
    def block_size(self) -> int:
        return BLOCK_SAMPLES

    def block_length(self, block: int) -> int:
        blocks = self._grouped()[1].blocks
        return int(blocks[block + 1] - blocks[block]) if 0 <= block < len(blocks) - 1 else 0

    @property
    def key_width(self) -> int:
        return self._samples.key_width if self._samples is not None else 6

    def _range(self, block: int) -> tuple[Walk, Samples, range]:
        walked, samples = self._grouped()
        if not 0 <= block < len(samples.blocks) - 1:
            raise WebDatasetError(f"{self.path}: no block {block}")
        return walked, samples, range(int(samples.blocks[block]), int(samples.blocks[block + 1]))

    def block_where(self, block: int) -> str:
        try:
            _, samples, numbers = self._range(block)
        except WebDatasetError:
            return f"{self.path} block {block}"
        first, last = samples.keys[numbers[0]], samples.keys[numbers[-1]]
        return f"{self.path} sample {first!r}" if first == last else f"{self.path} samples {first!r}..{last!r}"

    def stored_block_size(self, block: int) -> int:
        walked, samples, numbers = self._range(block)
        members = samples.members[samples.starts[numbers[0]]:samples.starts[numbers[-1] + 1]]
        return int(walked.sizes[members].sum())

    def decode_block(self, block: int) -> tuple[list[Any], int]:
        """The block's samples, ``{"__key__": key, "<field>": member bytes...}`` in archive
        order; :class:`WebDatasetError` naming the shard and member if one is truncated."""
        walked, samples, numbers = self._range(block)
        for i in numbers:
            if i in samples.damaged:
                raise WebDatasetError(samples.damaged[i])
        members = samples.members[samples.starts[numbers[0]]:samples.starts[numbers[-1] + 1]].tolist()
        # Checked before anything is read: a member's header states its size, and a sparse tar
        # of 3 GiB (one member) had verify and the daemon read it whole (2 GiB, then a
        # misleading 'shorter than when its headers were read' from pread's 2 GiB cap). A
        # block's files may not take more than max_block_bytes (as in every format).
        size = int(walked.sizes[members].sum()) if members else 0
        if size > self.max_block_bytes:
            raise WebDatasetError(f"{self.block_where(block)}: its members take {size} bytes, more than the block "
                                  f"bound of {self.max_block_bytes} bytes; not read")
        data = self._read(walked, members)
        out: list[Any] = []
        for i in numbers:
            sample: dict[str, Any] = {"__key__": samples.keys[i]}
            for m in samples.members[samples.starts[i]:samples.starts[i + 1]].tolist():
                sample[key_field(walked.names[m])[1]] = data[m]  # type: ignore[index]
            out.append(sample)
        return out, sum(len(v) for v in data.values()) + 200 * len(members)

    def _read(self, walked: Walk, members: list[int]) -> dict[int, bytes]:
        """The bytes of ``members``: one read spanning them, or a read each if members left
        out between them would make that read much larger. Each member's header (the 512
        bytes before its data) is read along and checked: a tar rewritten since its headers
        were read (same size and mtime, so its stored table was taken) fails, never serves
        another member's bytes."""
        offsets, sizes = walked.offsets, walked.sizes
        places = {m: (int(offsets[m]) - tarfile.BLOCKSIZE, int(sizes[m]) + tarfile.BLOCKSIZE) for m in members}
        lo = min(offset for offset, _ in places.values())
        hi = max(offset + size for offset, size in places.values())
        if hi - lo - sum(size for _, size in places.values()) > MAX_GAP_BYTES:
            spans = {m: memoryview(self._pread(offset, size)) for m, (offset, size) in places.items()}
        else:
            view = memoryview(self._pread(lo, hi - lo))
            spans = {m: view[offset - lo:offset - lo + size] for m, (offset, size) in places.items()}
        out = {}
        for m, span in spans.items():
            _check_header(self.path, walked.names[m], bytes(span[:tarfile.BLOCKSIZE]), int(sizes[m]))
            out[m] = bytes(span[tarfile.BLOCKSIZE:])
        return out

    def _pread(self, offset: int, size: int) -> bytes:
        try:
            raw = self._file.pread(self.path, offset, size)
        except (StorageUnavailableError, StorageChangedError):
            raise  # the store, not the file: transient
        except OSError as exc:
            raise WebDatasetError(f"{self.path}: read of bytes {offset}..{offset + size} failed "
                                  f"({exc.strerror})") from None
        if len(raw) != size:
            raise WebDatasetError(f"{self.path}: shorter than when its headers were read (bytes "
                                  f"{offset}..{offset + size} are not all there)")
        return raw

    def describe_block(self, block: int) -> list[tuple[Any, list[tuple[str, int]]]] | None:
        """Every sample's key and files from its members' sizes, no member read; None for a
        block the naming layer would not show as the members are (the tree decodes it)."""
        walked, samples, numbers = self._range(block)
        if any(i in samples.damaged for i in numbers):
            return None
        described: list[tuple[Any, list[tuple[str, int]]]] = []
        room = MAX_NAME_BYTES - 1 - self.key_width
        for i in numbers:
            sizes = {key_field(walked.names[m])[1]: int(walked.sizes[m])  # type: ignore[index]
                     for m in samples.members[samples.starts[i]:samples.starts[i + 1]].tolist()}
            fields, note = example_fields(dict.fromkeys(sizes, b""), room)  # the naming layer orders them
            if note is not None:
                return None
            described.append((samples.keys[i], [(suffix, sizes[suffix]) for suffix, _ in fields]))
        return described

    # -- what a stored table depends on

    def table_files(self) -> list[str]:
        return [self.path]

    def table_key(self) -> dict[str, Any]:
        """The base key plus this format's state version and block bounds."""
        return {**super().table_key(), "webdataset": STATE_VERSION, "block": [BLOCK_SAMPLES, BLOCK_BYTES]}

    def summary(self) -> dict[str, object]:
        return {"bytes": self.data_size, "members": len(self._walk.names) if self._walk else "-"}

    def problems(self) -> list[str]:
        """What the walk and the grouping found, one line each naming the shard (and member)."""
        if self._walk is None or self._samples is None:
            return [str(self.error)] if self.error else []
        return [*self._walk.problems, *self._samples.problems]

    def close(self) -> None:
        self._file.close_file(self.path)


def _check_header(path: str, name: str, header: bytes, size: int) -> None:
    """:class:`WebDatasetError` unless ``header`` is a regular member's header (checksum right)
    of ``name`` and ``size`` bytes, as it was when the shard's headers were walked. A name or
    size that a pax or GNU header before it may give instead (long, not ASCII, huge) is not
    compared: the header itself may hold a shortened or zeroed one."""
    try:
        info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        info = None
    long_name = not name.isascii() or len(name) > 99
    same = info is not None and info.isreg() and (info.name == name or long_name) \
        and (info.size == size or info.size == 0 or size >= 8 ** 11)
    if not same:
        raise WebDatasetError(f"{path} member {name!r}: its header is not what it was when the shard's headers "
                              "were read (the tar changed); the block is not served")


class WebDatasetSource(Source):
    """A folder of ``.tar`` shards (any depth, sorted by path), a folder of the tree per tar
    named by its path without ``.tar``; or one ``.tar`` file."""

    kind = "webdataset"
    checked = "tar headers"

    def __init__(self, root: str, storage: Storage = LOCAL) -> None:
        self.root = root
        self.storage = storage
        files = find_tar_files(root, storage)
        if not files:
            raise WebDatasetError(f"{root}: no .tar file in it (compressed shards, .tar.gz, are not read)")
        base = root if storage.isdir(root) else os.path.dirname(root)
        named = [(path, relative(path, base)[:-len(SUFFIX)] or "_") for path in files]
        #: Tars left out, one line each: their folder could not be named as they are (shown_names).
        self.layout_problems = shown_names(named)
        self._shards = [TarShard(path, name, storage) for path, name in named]
        if not self._shards:
            raise WebDatasetError(f"{root}: no .tar file whose name can be shown ({self.layout_problems[0]})")

    @property
    def shards(self) -> list[TarShard]:  # type: ignore[override]
        """A shard per tar file, in path order."""
        return self._shards

    def problems(self) -> list[str]:
        return list(self.layout_problems)

    def info(self) -> list[str]:
        return [f"format       webdataset: {len(self._shards)} tar file(s); up to {BLOCK_SAMPLES} samples "
                f"or {BLOCK_BYTES >> 20} MiB per block"]


def find_tar_files(path: str, storage: Storage = LOCAL) -> list[str]:
    """The ``.tar`` files a source path stands for: the file itself, or those under the folder
    (hidden ones left out), sorted by path. A ``.tar`` that is no regular file (a FIFO) is one
    too: its shard fails, naming it, rather than being left out without a word."""
    if storage.isfile(path):
        return [path]
    found = []
    for folder, dirs, names in walk_folders(storage, path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(os.path.join(folder, n) for n in sorted(names)
                     if n.endswith(SUFFIX) and not n.startswith(".") and storage.stat(os.path.join(folder, n)))
    return sorted(found, key=lambda p: relative(p, path).split("/"))
