"""A file table as stored: a file that is mapped and searched in place, never copied.

Layout (all little-endian)::

    magic "ATLFSTB7" | u32 header length | u32 CRC-32 of the header | header (JSON)
    sections, each at an offset the header gives, 8-byte aligned (the names, the inline
    and the kept bytes page-aligned: each is mapped on its own, and slices of a map are bytes)

The header holds the key the table was built from, the number of entries, the
locators' prefix lengths and, per section, ``[name, offset, length, CRC-32]``.
The sections are the per-entry columns (name offsets, kind, size, block, pos, file,
the path-sorted permutation ``by_path``), the lookup index (the stable 64-bit hashes
of the paths, sorted, and the row of each), the names blob, the source's state and
the optional locator columns with their prefixes, inline bytes, and kept files (the
end of each block's frame, and the frames).

Loading checks, before any column is used: the magic, the header's checksum and
every bound it states (the sections are exactly the expected ones, in order, not
overlapping, of the lengths the entry count implies, ending where the file ends:
nothing is ever read past the end of a file), every section's checksum, then
:func:`atlasfs.tree.table.checks.problem`'s checks of the values (paths, permutation, index rows,
positions). A file found valid once is remembered by its identity (device, inode,
size, mtime, ctime) so that mapping it again after its table was unmapped costs no pass.

Why mapping is safe from SIGBUS: a table is mapped only from a local file of the
daemon's own user (the user's cache or a folder they own), checked on the descriptor it is
mapped from (opened with :data:`OPEN_FLAGS`: never through a symbolic link, whose target
another user could change between two opens); atlasfs writes those by rename, never in
place, so a mapped file is never truncated under the map (deleting or replacing it leaves
the mapped inode alone). A table stored by another user (beside a shared dataset, or in a
bucket) is first copied into the user's cache, by the size its header states
(:func:`read_stated`), and the copy is mapped (:mod:`atlasfs.tree.table.store`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import stat
import threading
import zlib
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from atlasfs.tree.table import checks
from atlasfs.tree.table.layout import ENTRY_SECTIONS, LOCATOR_SECTIONS, UNKNOWN_SIZE

if TYPE_CHECKING:
    from atlasfs.tree.table.filetable import FileTable, Limits, LimitsOf

MAGIC = b"ATLFSTB7"  # 7: kept files (6: mapped in place, with the lookup index and section checksums)
_HEADER_MAX = 1 << 20
_ALIGN = 8
_PAGE = mmap.ALLOCATIONGRANULARITY
#: Sections mapped on their own (sliced as bytes), so page-aligned.
_PAGED = ("names", "inline", "kept")
#: Files found valid (identity -> the limits they were checked against), so that mapping one again costs no pass.
_VALIDATED: dict[tuple[int, ...], "Limits"] = {}
_VALIDATED_MAX = 1 << 16
_validated_lock = threading.Lock()
#: Tables mapped with every check ("full") and without, found valid before ("known"): the
#: tests' counters of what a second mount checks again.
CHECKS = {"full": 0, "known": 0}
#: Called with (identity, limits) of each file found valid by the full checks
#: (:mod:`atlasfs.tree.table.validated` keeps them between mounts).
on_validated: Callable[[tuple[int, ...], "Limits"], None] | None = None


def path_hashes(paths: list[bytes]) -> np.ndarray:
    """The stable 64-bit hash of each path (the first 8 bytes of its BLAKE2b digest, little-endian):
    the same in every process, so that the lookup index can be stored."""
    blake = hashlib.blake2b
    return np.frombuffer(b"".join([blake(p, digest_size=8).digest() for p in paths]), dtype="<u8")


def path_hash(path: bytes) -> int:
    """:func:`path_hashes` of one path."""
    return int.from_bytes(hashlib.blake2b(path, digest_size=8).digest(), "little")


def _section_names(locators: bool) -> list[str]:
    names = [name for name, _, _ in ENTRY_SECTIONS] + ["names", "state"]
    if locators:
        names += [f"loc_{name}" for name, _ in LOCATOR_SECTIONS] + ["prefixes", "inline", "kept_ends", "kept"]
    return names


def _aligned(at: int, name: str) -> int:
    step = _PAGE if name in _PAGED else _ALIGN
    return -(-at // step) * step


def encode(table: "FileTable", key: dict[str, Any]) -> list[bytes]:
    """The parts of ``table``'s file, tagged with ``key`` (to be written one after another)."""
    hashes, rows = table.lookup_index()
    sections: list[tuple[str, bytes]] = []
    for name, dtype, _ in ENTRY_SECTIONS:
        array = {"offsets": table._offsets, "hashes": hashes, "hash_rows": rows}.get(name)
        if array is None:
            array = getattr(table, name)
        sections.append((name, np.ascontiguousarray(array, dtype=dtype).tobytes()))
    sections += [("names", bytes(table._names)), ("state", bytes(table.state))]
    locators = table.locators
    fields: dict[str, Any] = {"key": key, "entries": len(table)}
    if locators is not None:
        sections += [(f"loc_{name}", np.ascontiguousarray(getattr(locators, name), dtype=dtype).tobytes())
                     for name, dtype in LOCATOR_SECTIONS]
        sections += [("prefixes", b"".join(locators.prefixes)), ("inline", bytes(locators.inline)),
                     ("kept_ends", np.ascontiguousarray(locators.kept_ends, dtype="<u8").tobytes()),
                     ("kept", bytes(locators.kept))]
        fields["prefixes"] = [len(p) for p in locators.prefixes]
    # Offsets depend on the header's length, which depends on the offsets' digits: lay out
    # with a header room that is a fixed bound above its length.
    room = 0
    while True:
        at = _aligned(16 + room, "")
        table_of_sections = []
        for name, data in sections:
            at = _aligned(at, name)
            table_of_sections.append([name, at, len(data), zlib.crc32(data)])
            at += len(data)
        fields["sections"] = table_of_sections
        header = json.dumps(fields).encode()
        if len(header) <= room:
            break
        room = len(header) + 64
    header = header.ljust(room)  # padded with spaces: still JSON
    parts = [MAGIC, len(header).to_bytes(4, "little"), zlib.crc32(header).to_bytes(4, "little"), header]
    at = 16 + len(header)
    for (name, data), (_, offset, _, _) in zip(sections, table_of_sections):
        parts.append(bytes(offset - at))
        parts.append(data)
        at = offset + len(data)
    return parts


class _Layout:
    """A stored table's header, every bound it states checked against the file's size."""

    def __init__(self, data: Any, key: dict[str, Any]) -> None:
        from atlasfs.tree.table.filetable import MAX_PREFIXES, TableError

        size = len(data)
        if size < 16 or bytes(data[:8]) != MAGIC:
            raise TableError("is not a file table of this atlasfs version")
        length = int.from_bytes(data[8:12], "little")
        if length > _HEADER_MAX or 16 + length > size:
            raise TableError(f"is corrupt (a header of {length} bytes in {size})")
        header_bytes = bytes(data[16:16 + length])
        if zlib.crc32(header_bytes) != int.from_bytes(data[12:16], "little"):
            raise TableError("is corrupt (its header's checksum does not match)")
        header = json.loads(header_bytes)
        if header.get("key") != key:
            raise TableError("was built from other files or by other naming rules (stale or foreign)")
        n = header["entries"]
        if type(n) is not int or not 0 <= n < 2**32 - 1:
            raise TableError("is corrupt (an entry count out of bounds)")
        self.n = n
        self.prefixes: list[int] | None = header.get("prefixes")
        locators = self.prefixes is not None
        if locators and (not isinstance(self.prefixes, list) or len(self.prefixes) > MAX_PREFIXES
                         or any(type(p) is not int or p <= 0 for p in self.prefixes)):
            raise TableError("is corrupt (locator prefixes out of bounds)")
        sections = header["sections"]
        expected = _section_names(locators)
        if not isinstance(sections, list) or [s[0] if isinstance(s, list) else None for s in sections] != expected:
            raise TableError("is corrupt (its sections are not the expected ones)")
        widths = {name: (np.dtype(dtype).itemsize, extra) for name, dtype, extra in ENTRY_SECTIONS}
        widths.update({f"loc_{name}": (np.dtype(dtype).itemsize, 0) for name, dtype in LOCATOR_SECTIONS})
        self.sections: dict[str, tuple[int, int, int]] = {}
        at = 16 + length
        for section in sections:
            if len(section) != 4 or not all(type(v) is int and v >= 0 for v in section[1:]):
                raise TableError(f"is corrupt (section {section[0]} out of bounds)")
            name, offset, count, crc = section
            if offset < at or offset % _ALIGN or (name in _PAGED and offset % _PAGE) or offset + count > size:
                raise TableError(f"is corrupt (section {name} out of bounds)")
            if name in widths and count != widths[name][0] * (n + widths[name][1]):
                raise TableError(f"is corrupt (section {name} of {count} bytes for {n} entries)")
            if name == "prefixes" and count != sum(self.prefixes or []):
                raise TableError("is corrupt (locator prefixes of another length than stated)")
            if name == "kept_ends" and count % 8:
                raise TableError(f"is corrupt (section {name} of {count} bytes)")
            self.sections[name] = (offset, count, crc)
            at = offset + count
        if at != size:
            raise TableError(f"is corrupt ({size} bytes where its header means {at})")

    def check_sums(self, data: Any) -> None:
        """Every section's checksum (a pass over the file)."""
        from atlasfs.tree.table.filetable import TableError

        view = memoryview(data)
        try:
            for name, (offset, count, crc) in self.sections.items():
                if zlib.crc32(view[offset:offset + count]) != crc:
                    raise TableError(f"is corrupt (section {name}: its checksum does not match)")
        finally:
            view.release()

    def array(self, data: Any, name: str, dtype: str) -> np.ndarray:
        offset, count, _ = self.sections[name]
        return np.frombuffer(data, dtype=dtype, count=count // np.dtype(dtype).itemsize, offset=offset)


def parse(data: Any, key: dict[str, Any], limits: "Limits | LimitsOf",
          blob: Callable[[int, int], Any] | None = None, validated: bool = False) -> "FileTable":
    """The table in ``data`` (bytes, or a map of its file), its arrays views of ``data``;
    ``blob(offset, length)`` gives the names, inline and kept sections (default: copies).
    With ``validated`` (the file was found valid before), only the header is checked."""
    from atlasfs.tree.table.filetable import FileTable, Limits, Locators, TableError

    layout = _Layout(data, key)
    if not validated:
        layout.check_sums(data)
    if blob is None:
        def blob(offset: int, count: int) -> bytes:
            return bytes(data[offset:offset + count])
    columns = {name: layout.array(data, name, dtype) for name, dtype, _ in ENTRY_SECTIONS}
    names_at, names_len, _ = layout.sections["names"]
    table = FileTable(blob(names_at, names_len) if names_len else b"", columns.pop("offsets"), columns)
    state_at, state_len, _ = layout.sections["state"]
    table.state = bytes(data[state_at:state_at + state_len])
    table.sections = {name: (offset, count) for name, (offset, count, _) in layout.sections.items()}
    if layout.prefixes is not None:
        at, _, _ = layout.sections["prefixes"]
        prefixes = []
        for length in layout.prefixes:
            prefixes.append(bytes(data[at:at + length]))
            at += length
        inline_at, inline_len, _ = layout.sections["inline"]
        kept_at, kept_len, _ = layout.sections["kept"]
        table.locators = Locators(*(layout.array(data, f"loc_{name}", dtype) for name, dtype in LOCATOR_SECTIONS),
                                  prefixes, blob(inline_at, inline_len) if inline_len else b"",
                                  blob(kept_at, kept_len) if kept_len else b"", layout.array(data, "kept_ends", "<u8"))
    if validated:
        return table
    if not isinstance(limits, Limits):
        try:
            limits = limits(table.state)
        except ValueError as exc:
            raise TableError(f"holds a source state that does not fit ({exc})") from None
    problem = checks.problem(table, limits)
    if problem is None:
        table.limits = limits
    if problem is None and table.locators is not None:
        problem = table.locators.problem(table.kind, table.size, table.block)
    if problem:
        raise TableError(f"is corrupt ({problem})")
    return table


#: One table's checks at a time (see :func:`open_mapped`).
_validating = threading.Lock()


def _drop_pages(maps: list[mmap.mmap]) -> None:
    """Take the pages of ``maps`` out of this process's resident memory (they stay in the page
    cache: a lookup faults the few it needs back in)."""
    if hasattr(mmap, "MADV_DONTNEED"):
        for part in maps:
            part.madvise(mmap.MADV_DONTNEED)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    # ctime too: a file changed in place with its size and mtime put back (touch -d, rsync
    # --inplace) is another file; no user can set ctime
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _same_limits(table: "FileTable", limits: "Limits | LimitsOf", known: "Limits") -> bool:
    """Whether ``table`` (parsed without its checks) is to be checked against the limits it was
    found valid against: ``limits``, or what ``limits`` gives for its stored state."""
    from atlasfs.tree.table.filetable import Limits

    if not isinstance(limits, Limits):
        try:
            limits = limits(table.state)
        except ValueError:  # a state that does not fit: the full checks say so
            return False
    if limits != known:
        return False
    table.limits = known
    return True


def remember(identity: tuple[int, ...], limits: "Limits") -> None:
    """Record that the file of ``identity`` was found valid against ``limits`` (mapping it again,
    in this process or, through the store's record, in the next mount, costs no pass)."""
    with _validated_lock:
        if len(_VALIDATED) >= _VALIDATED_MAX:
            _VALIDATED.clear()
        _VALIDATED[identity] = limits


def touched(before: os.stat_result, after: os.stat_result) -> None:
    """A file found valid had its mtime set by this process (the cache's last use), nothing else:
    it stays found valid under its new identity."""
    limits = _VALIDATED.get(_identity(before))
    if limits is None or (before.st_dev, before.st_ino, before.st_size) != (after.st_dev, after.st_ino, after.st_size):
        return
    identity = _identity(after)
    remember(identity, limits)
    if on_validated is not None:
        on_validated(identity, limits)


#: Flags every table file is opened with: never through a symlink (its last component), never
#: blocking on a FIFO or a device put in its place, never kept by a child process.
OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
              | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))


def open_table(path: str) -> int | None:
    """A descriptor of the local table file ``path`` (:data:`OPEN_FLAGS`), or None if there is
    no such file; :class:`TableError` if it is a symbolic link (never followed: a link's target
    can be changed by whoever owns the link, whatever its owner's) or cannot be opened."""
    from atlasfs.tree.table.filetable import TableError

    try:
        return os.open(path, OPEN_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TableError("is a symbolic link (never followed)") from None
        raise TableError(f"cannot be read ({exc.strerror or exc})") from None


def stated_size(head: bytes) -> tuple[int, int]:
    """(bytes of the header's prefix, bytes of the file) a table's first bytes state: call with
    16 bytes to learn how many to pass (``head`` holding the header whole), then with those.
    Raises :class:`TableError` if they are no table's. Lets a table be read by what it says
    it is, never whole before anything is checked (another user's file may be 2 GiB of zeros)."""
    from atlasfs.tree.table.filetable import TableError

    if len(head) < 16 or head[:8] != MAGIC:
        raise TableError("is not a file table of this atlasfs version")
    length = int.from_bytes(head[8:12], "little")
    if length > _HEADER_MAX:
        raise TableError(f"is corrupt (a header of {length} bytes)")
    if len(head) < 16 + length:
        return 16 + length, -1
    header_bytes = head[16:16 + length]
    if zlib.crc32(header_bytes) != int.from_bytes(head[12:16], "little"):
        raise TableError("is corrupt (its header's checksum does not match)")
    try:
        sections = json.loads(header_bytes)["sections"]
        end = max([16 + length] + [section[1] + section[2] for section in sections])
    except (ValueError, KeyError, TypeError, IndexError):
        raise TableError("is corrupt (its header is not a table's)") from None
    if type(end) is not int:
        raise TableError("is corrupt (its header is not a table's)")
    return 16 + length, end


class _Head:
    """A table file's first bytes (its header whole) standing for the file, ``size`` bytes."""

    def __init__(self, head: bytes, size: int) -> None:
        self.head, self.size = head, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: slice) -> bytes:
        return self.head[index]


def check_header(head: bytes, size: int, key: dict[str, Any]) -> None:
    """:class:`TableError` unless ``head``, the first bytes of a table file of ``size`` bytes
    holding its header whole, states a table of ``key`` whose every section lies within
    ``size``: all that can be told before a byte past the header is read."""
    _Layout(_Head(head, size), key)


def read_stated(pread: Callable[[int, int], bytes], size: int, bound: int) -> bytes:
    """The bytes of a table whose file is ``size`` bytes, read with ``pread(offset, count)``:
    its header first, then (if the header states exactly ``size`` bytes, at most ``bound``)
    the rest. :class:`TableError` otherwise, before anything past the header is read."""
    from atlasfs.tree.table.filetable import TableError

    head = pread(0, 16)
    wanted, end = stated_size(head)
    if end < 0:
        head += pread(16, wanted - 16)
        wanted, end = stated_size(head)
        if end < 0:
            raise TableError("is corrupt (cut short in its header)")
    if end != size:
        raise TableError(f"is corrupt ({size} bytes where its header means {end})")
    if size > bound:
        raise TableError(f"is {size} bytes, more than the table cache's bound of {bound} (ATLASFS_TABLE_CACHE_SIZE)")
    data = head + pread(len(head), size - len(head)) if size > len(head) else head[:size]
    if len(data) != size:
        raise TableError(f"is corrupt (cut short while read: {len(data)} bytes of {size})")
    return data


def open_mapped(path: str, key: dict[str, Any], limits: "Limits | LimitsOf") -> "FileTable | None":
    """The table stored in the local file ``path`` (opened with :data:`OPEN_FLAGS`: a symbolic
    link is refused), mapped (:func:`map_descriptor`), or None if there is no such file."""
    fd = open_table(path)
    if fd is None:
        return None
    try:
        return map_descriptor(fd, path, key, limits)
    finally:
        os.close(fd)  # the maps keep the file


def map_descriptor(fd: int, path: str, key: dict[str, Any], limits: "Limits | LimitsOf") -> "FileTable":
    """The table stored in the file open as ``fd`` (a regular file; ``path``: where it was opened,
    for the native engine and messages), mapped (its arrays and names are views of the map:
    nothing is copied). The size column is a copy in memory if some sizes are unknown (they are
    filled in at lookup). The caller closes ``fd`` (the maps keep the file)."""
    from atlasfs.tree.table.filetable import TableError

    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise TableError("is not a regular file")
    if st.st_size < 16:
        raise TableError(f"is corrupt (only {st.st_size} bytes)")
    data = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)

    maps = [data]

    def blob(offset: int, count: int) -> mmap.mmap:
        maps.append(mmap.mmap(fd, count, access=mmap.ACCESS_READ, offset=offset))
        return maps[-1]

    identity = _identity(st)
    known = _VALIDATED.get(identity)
    checked = False
    try:
        if known is not None:
            table = parse(data, key, limits, blob, validated=True)
            checked = _same_limits(table, limits, known)
        if not checked:
            # The checks read every page of the file: one table at a time, and its pages
            # out of this process's memory after (a lookup touches a few; they come back
            # from the page cache). Sixteen readers of sixteen shards each validating one
            # held 16 tables of 13 MiB at once.
            with _validating:
                table = parse(data, key, limits, blob, validated=False)
                _drop_pages(maps)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, IndexError) as exc:
        if isinstance(exc, TableError):
            raise
        raise TableError(f"is corrupt ({exc})") from None
    except OSError as exc:
        raise TableError(f"cannot be read ({exc.strerror or exc})") from None
    if checked:
        CHECKS["known"] += 1
    else:
        CHECKS["full"] += 1
        if table.limits is not None:
            remember(identity, table.limits)
            if on_validated is not None:
                on_validated(identity, table.limits)
    table.mapped_bytes = st.st_size
    table.path = path
    table.file_identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if bool(np.any(table.size == UNKNOWN_SIZE)):
        table.size = table.size.copy()  # writable, in memory: 8 bytes a file while sizes are learnt
    return table
