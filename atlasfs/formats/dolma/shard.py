"""A Dolma documents file with its attribute sets: a shard, a folder of the tree.

:meth:`DolmaFile.prepare` makes the one pass (:func:`.scan.scan_files`) and returns what
it learned as a saved state (:mod:`.saved`); :meth:`DolmaFile.restore` takes it back on a
later mount, so that mount makes no pass. A block reads its span of the documents file
and of each attribute set that lines up through the files' :class:`.seek.Reader`.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Any

from atlasfs.formats.dolma.names import folder_name
from atlasfs.formats.dolma.saved import STATE_VERSION, decode_state, encode_state
from atlasfs.formats.dolma.scan import LINES_PER_BLOCK, ODD_TEXT, Described, Scan, line_id, make_sample, scan_files
from atlasfs.formats.dolma.seek import DolmaError, OpenFiles, Reader
from atlasfs.formats.naming import MAX_NAME_BYTES, NO_KEY, example_fields, index_key_width
from atlasfs.formats.source import SourceShard
from atlasfs.storage import LOCAL, Storage, StorageUnavailableError, UnfitFileError

log = logging.getLogger("atlasfs")

#: Bad lines logged per file and mount before a summary line.
LOGGED_PROBLEMS = 10


class DolmaFile(SourceShard):
    """One documents file with its attribute sets: a shard, a folder of the tree."""

    first_index = 0

    def __init__(self, root: str, relative: str, attributes: dict[str, str],
                 files: OpenFiles | None = None, storage: Storage = LOCAL) -> None:
        self.root = root
        self.relative = relative  # path under documents/
        self.path = os.path.join(root, "documents", relative)
        self.name = folder_name(relative)
        self.attributes = attributes  # set name -> its file's path
        self.error = None
        self.storage = storage
        self._sizes: dict[str, int] = {}
        self.mtime = 0.0
        try:
            for path in self.files():
                found = storage.stat(path)
                if found is None:
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
                storage.check_file(path)  # a FIFO or device in its place: said now (a stat), never opened
                self._sizes[path] = found[0]
                if path == self.path:
                    self.mtime = found[1] / 1e9
        except StorageUnavailableError:
            raise
        except UnfitFileError as exc:
            self.error = DolmaError(str(exc))
            self._sizes = {}
        except OSError as exc:
            self.error = DolmaError(f"{exc.filename or self.path}: cannot be read ({exc.strerror})")
            self._sizes = {}
        self.data_size = sum(self._sizes.values())
        self.scan_result: Scan | None = None
        self._described: Described | None = None
        self._files = files or OpenFiles()
        self._readers: dict[str, Reader] = {}
        self._readers_lock = threading.Lock()
        self._prepare_lock = threading.Lock()

    def files(self) -> list[str]:
        """The files its samples come from."""
        return [self.path, *self.attributes.values()]

    def table_files(self) -> list[str]:
        """The documents file and its attributes files."""
        return self.files()

    def table_key(self) -> dict[str, Any]:
        """The base key plus what decides this format's blocks."""
        return {**super().table_key(), "dolma": STATE_VERSION, "lines_per_block": LINES_PER_BLOCK}

    # -- the pass

    def scan(self) -> Scan:
        """One pass over the documents file and every attributes file (:func:`.scan.scan_files`)."""
        if self.error is not None:
            raise self.error
        try:
            scan, described, gzip_file = scan_files(self.path, self.attributes, self.storage)
        except UnfitFileError as exc:  # one replaced by a FIFO or device since the dataset opened
            raise DolmaError(str(exc)) from None
        self._drop_readers()
        if gzip_file is not None:  # keep the scan's zran index rather than importing it again
            with self._readers_lock:
                self._readers[self.path] = Reader(self.path, scan.seek_states[self.path], self._files, gzip_file,
                                                  self.storage)
        self._described = described
        self.scan_result = scan
        return scan

    def _drop_readers(self) -> None:
        with self._readers_lock:
            readers = list(self._readers.values())
            self._readers.clear()
        for reader in readers:
            reader.close()

    def prepare(self) -> bytes:
        """Scan the files (see :meth:`scan`) and return all the scan learned
        (:func:`.saved.encode_state`). The tree logs :meth:`problems` after a prepare."""
        with self._prepare_lock:
            return encode_state(self.scan(), self.path, self.attributes)

    def restore(self, state: bytes) -> None:
        """Take back :meth:`prepare`'s bytes without reading the files; ``ValueError`` if they
        are malformed or do not fit the files as they are now (sizes, attribute sets)."""
        if self.error is not None:
            raise ValueError(str(self.error))
        try:
            scan = decode_state(state, self.path, self.attributes, self._sizes)
        except ValueError:
            raise
        except Exception as exc:  # untrusted bytes: anything odd in them is "does not fit"
            raise ValueError(f"{self.path}: stored state is malformed ({type(exc).__name__}: {exc})") from None
        with self._prepare_lock:
            self._drop_readers()
            self.scan_result = scan
            self._described = None
        self._log_findings()

    def _log_findings(self) -> None:
        """What a mount that restores (and so makes no pass) still tells, as the tree does
        after a prepare: a line per attribute set left out and per damage, the first
        :data:`LOGGED_PROBLEMS` bad lines and a count of the rest."""
        bad_line = f"{self.path} line "
        shown = hidden = 0
        for problem in self.problems():
            if problem.startswith(bad_line):
                if shown == LOGGED_PROBLEMS:
                    hidden += 1
                    continue
                shown += 1
            log.warning("%s", problem)
        if hidden:
            log.warning("%s: %d more lines that are not documents (atlasfs verify lists them)", self.path, hidden)

    def problems(self) -> list[str]:
        """Bad lines, attribute sets left out, and damage, one line each."""
        scan = self.scan_result
        if scan is None:
            return [str(self.error)] if self.error else []
        found = list(scan.problems)
        if scan.more_problems:
            found.append(f"{self.path}: {scan.more_problems} more lines that are not documents")
        found += [f"{why} (attribute set {name!r} left out)" for name, why in sorted(scan.left_out.items())]
        if scan.damage:
            found.append(f"{scan.damage} (block {self.num_blocks - 1} fails)")
        return found

    # -- blocks

    def _reader(self, path: str) -> Reader:
        with self._readers_lock:
            reader = self._readers.get(path)
            if reader is None:
                state = self.scan_result.seek_states.get(path, b"") if self.scan_result else b""
                reader = self._readers[path] = Reader(path, state, self._files, storage=self.storage)
            return reader

    def _scanned(self) -> Scan:
        if self.scan_result is None:
            raise DolmaError(f"{self.path}: read before it was prepared")
        return self.scan_result

    @property
    def num_blocks(self) -> int:
        """Blocks of lines (needs :meth:`prepare` or :meth:`restore`)."""
        return len(self._scanned().block_starts) - 1

    @property
    def block_size(self) -> int:
        """Lines per block."""
        return LINES_PER_BLOCK

    @property
    def key_width(self) -> int:
        """Digits of its lines' index keys."""
        scan = self._scanned()
        return index_key_width(scan.lines + (1 if scan.damage else 0))

    def block_length(self, block: int) -> int:
        """Lines in ``block`` (the failing last block of a damaged file counts one for what is lost)."""
        scan = self._scanned()
        if scan.damage is not None and block == self.num_blocks - 1:
            return scan.lines - block * LINES_PER_BLOCK + 1
        return min(LINES_PER_BLOCK, scan.lines - block * LINES_PER_BLOCK)

    def block_where(self, block: int) -> str:
        """``<file> lines <first>-<last>`` of ``block`` (1-based, as editors count)."""
        first = block * LINES_PER_BLOCK + 1
        return f"{self.path} lines {first}-{first + self.block_length(block) - 1}"

    def stored_block_size(self, block: int) -> int:
        """Compressed bytes a block's read takes, estimated from the files' compression ratios."""
        scan = self._scanned()
        total = 0
        for path, starts in [(self.path, scan.block_starts), *((self.attributes[n], s) for n, s in scan.attribute_starts.items())]:
            span = int(starts[block + 1]) - int(starts[block])
            text_end = max(int(starts[-1]), 1)
            total += min(span, span * self._sizes.get(path, text_end) // text_end)
        return total

    def decode_block(self, block: int) -> tuple[list[Any], int]:
        """The samples of ``block`` and about the bytes they hold."""
        scan = self._scanned()
        if not 0 <= block < self.num_blocks:
            raise DolmaError(f"{self.path}: no block {block}")
        if scan.damage is not None and block == self.num_blocks - 1:
            raise DolmaError(f"{scan.damage}; lines from {block * LINES_PER_BLOCK + 1} on are lost")
        lo, hi = (int(v) for v in scan.block_starts[block:block + 2])
        expected = self.block_length(block)
        # Checked before anything is read or inflated: the scan knows each block's text bytes,
        # and a 6 MB .json.gz of 7 documents of 192 MiB each (every line within MAX_LINE_BYTES)
        # had verify inflate the block whole, 3.2 GB, and say OK. A block's files may not take
        # more than max_block_bytes, in Dolma as in every format.
        size = hi - lo + sum(int(starts[block + 1]) - int(starts[block]) for starts in scan.attribute_starts.values())
        if size > self.max_block_bytes:
            raise DolmaError(f"{self.path}: block {block} (lines {block * LINES_PER_BLOCK + 1}.."
                             f"{block * LINES_PER_BLOCK + expected}) takes {size} bytes of text, more than the block "
                             f"bound of {self.max_block_bytes} bytes; not read")
        lines = self._split(self._reader(self.path).read(lo, hi), expected, self.path, block)
        cost = hi - lo
        attribute_lines: dict[str, list[bytes]] = {}
        for name, starts in scan.attribute_starts.items():
            path = self.attributes[name]
            a, b = (int(v) for v in starts[block:block + 2])
            attribute_lines[name] = self._split(self._reader(path).read(a, b), expected, path, block)
            cost += b - a
        samples = []
        for i, line in enumerate(lines):
            value, doc_id = line_id(line)
            samples.append(make_sample(line, value, doc_id, {n: al[i] for n, al in attribute_lines.items()}))
        # the lines' bytes are held twice (raw .json and parsed text), plus a dict per sample
        return samples, 2 * cost + 400 * len(samples)

    @staticmethod
    def _split(data: bytes, expected: int, path: str, block: int) -> list[bytes]:
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        if len(lines) != expected:
            raise DolmaError(f"{path}: block {block} has {len(lines)} lines where its scan found {expected} "
                             f"(the file changed?)")
        return lines

    def describe_block(self, block: int) -> list[tuple[Any, list[tuple[str, int]]]] | None:
        """Each line's key and files with their sizes, from what :meth:`prepare` measured
        (no decompression); given once per block after a pass, else None (decode instead)."""
        described, scan = self._described, self.scan_result
        if described is None or scan is None or block not in described.pending:
            return None
        if scan.damage is not None and block == self.num_blocks - 1:
            return None
        described.pending.discard(block)
        if not described.pending:
            self._described = None  # every block described: the listing has it all now
        lo = block * LINES_PER_BLOCK
        hi = lo + self.block_length(block)
        max_suffix = MAX_NAME_BYTES - 1 - self.key_width
        sets = list(scan.attribute_starts)
        ids = described.ids[lo:hi]
        columns = {"json": described.json_len[lo:hi].tolist(), "text": described.text_len[lo:hi].tolist(),
                   **{f"{n}.json": described.attribute_len[n][lo:hi].tolist() for n in sets}}
        if ODD_TEXT in columns["text"]:
            return None  # named otherwise by the naming layer: let the tree decode the block
        patterns: dict[tuple[bool, bool], list[str]] = {}
        out: list[tuple[Any, list[tuple[str, int]]]] = []
        for i, doc_id in enumerate(ids):
            shape = (doc_id is not None, columns["text"][i] >= 0)
            suffixes = patterns.get(shape)
            if suffixes is None:
                # the naming layer decides names and order, from a stand-in sample of the same shape
                stand_in = make_sample(b"", {"text": ""} if shape[1] else {}, "x" if shape[0] else None,
                                   {n: b"" for n in sets})
                fields, note = example_fields(stand_in, max_suffix)
                if note is not None:
                    return None
                suffixes = patterns[shape] = [suffix for suffix, _ in fields]
            out.append((doc_id if doc_id is not None else NO_KEY, [(s, columns[s][i]) for s in suffixes]))
        return out

    def close(self) -> None:
        """Close the files' readers."""
        with self._readers_lock:
            readers = list(self._readers.values())
        for reader in readers:
            reader.close()

