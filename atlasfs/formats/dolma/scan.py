"""The one pass over a Dolma documents file and its attributes files.

:func:`scan_files` reads each file's text once (:class:`.seek.TextPass`, which builds its
seek state on the way) and learns where every block of :data:`LINES_PER_BLOCK` lines
starts, each line's id and its files' sizes (:class:`Described`, so a first listing needs
no second decompression), which attribute sets line up, the lines that are not documents
and where a compressed file ends early: a :class:`Scan`. The functions that turn a line
into a sample live here too, so that decoding a block and describing it agree.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from atlasfs.formats.dolma.seek import DolmaError, TextPass, file_kind, pack_gzip_index
from atlasfs.storage import LOCAL, Storage

#: Lines decoded together (a block of the tree).
LINES_PER_BLOCK = 512
#: A line longer than this is refused (a bomb or a broken file, not a document).
MAX_LINE_BYTES = 256 << 20
#: Bad lines kept per file for ``verify`` (the rest are counted); a file of garbage stays small.
MAX_PROBLEMS = 1000


def lines_of(chunks: Iterator[bytes], path: str) -> Iterator[tuple[int, bytes]]:
    """``(text offset, line without its newline)`` of every line in ``chunks``; the last
    line may lack a newline."""
    offset = 0  # of the first byte not yet yielded
    pending: list[bytes] = []
    pending_bytes = 0
    for chunk in chunks:
        if b"\n" not in chunk:  # a long line: gather its pieces, join once
            pending.append(chunk)
            pending_bytes += len(chunk)
            if pending_bytes > MAX_LINE_BYTES:
                raise DolmaError(f"{path}: a line at byte {offset} of its text is longer than {MAX_LINE_BYTES} bytes")
            continue
        if pending:
            chunk = b"".join([*pending, chunk])
            pending.clear()
            pending_bytes = 0
        parts = chunk.split(b"\n")
        rest = parts.pop()
        for line in parts:
            yield offset, line
            offset += len(line) + 1
        if rest:
            pending.append(rest)
            pending_bytes = len(rest)
    if pending:
        yield offset, b"".join(pending)


def line_id(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """The parsed line and its id, or None for what is missing."""
    try:
        # decoded here: json.loads would first guess the bytes' encoding, a third of its time
        value = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8 or not JSON
        return None, None
    if type(value) is not dict:
        return None, None
    doc_id = value.get("id")
    return value, doc_id if type(doc_id) is str else None


def make_sample(line: bytes, value: dict[str, Any] | None, doc_id: str | None,
                attributes: dict[str, bytes]) -> dict[str, Any]:
    """The sample of one documents line (one place, so that decoding and describing agree)."""
    sample: dict[str, Any] = {"json": line}
    if value is not None and doc_id is not None:
        sample["__key__"] = doc_id
        if type(value.get("text")) is str:
            sample["text"] = value["text"]
        for name, attribute in attributes.items():
            sample[f"{name}.json"] = attribute
    return sample


#: ``text_len`` codes: no ``text`` field, and a text the naming layer would not show as ``.text``.
NO_TEXT = -1
ODD_TEXT = -2


def text_len_of(value: dict[str, Any] | None, doc_id: str | None) -> int:
    """Bytes of a line's ``text`` field in UTF-8, or a code: :data:`NO_TEXT`, :data:`ODD_TEXT`."""
    if value is None or doc_id is None:
        return NO_TEXT
    text = value.get("text")
    if type(text) is not str:
        return NO_TEXT
    if text.isascii():
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:  # lone surrogates from \\ud800 escapes: named otherwise
        return ODD_TEXT


@dataclass
class Scan:
    """What one pass over a documents file and its attributes files learned."""

    block_starts: np.ndarray  # text offset of each block's first line, and the end (uint64)
    lines: int  # complete lines read
    problems: list[str] = field(default_factory=list)  # lines that are not documents
    more_problems: int = 0  # bad lines beyond MAX_PROBLEMS
    attribute_starts: dict[str, np.ndarray] = field(default_factory=dict)  # sets that line up
    left_out: dict[str, str] = field(default_factory=dict)  # set name -> why it does not line up
    seek_states: dict[str, bytes] = field(default_factory=dict)  # file path -> its seek state
    damage: str | None = None  # why the documents text ends early: its last block fails
    text_bytes: int = 0  # documents text read


@dataclass
class Described:
    """What the pass measured of every line, for :meth:`.shard.DolmaFile.describe_block` (kept until
    every block has been described once: a listing needs it once)."""

    ids: list[str | None]
    json_len: np.ndarray
    text_len: np.ndarray
    attribute_len: dict[str, np.ndarray]
    pending: set[int]


def scan_files(path: str, attributes: dict[str, str],
               storage: Storage = LOCAL) -> tuple[Scan, Described, tuple[Any, Any] | None]:
    """One pass over the documents file at ``path`` and every attributes file (set name ->
    path): block offsets, ids, alignment, sizes and seek points (one decompression of each
    file). Also the documents pass's open ``indexed_gzip`` file (its seek points built) with
    the storage file it reads, or None, for the caller to read through rather than import
    the index again. Every file is read through ``storage``."""
    text = TextPass(path, storage)
    try:
        scan, ids, json_len, text_len = _scan_documents(text, path)
        if text.kind == "gz":
            scan.seek_states[path] = pack_gzip_index(text.seek_state)
        elif text.seek_state:
            scan.seek_states[path] = text.seek_state
        attribute_len: dict[str, np.ndarray] = {}
        for name, attributes_path in sorted(attributes.items()):
            why, attribute_starts, lengths, state = _line_up(attributes_path, path, ids, scan, storage)
            if why is None:
                if state:
                    scan.seek_states[attributes_path] = (pack_gzip_index(state) if file_kind(attributes_path) == "gz"
                                                         else state)
                scan.attribute_starts[name] = attribute_starts
                attribute_len[name] = lengths
            else:
                scan.left_out[name] = why
    except BaseException:
        text.close()
        raise
    described = Described(ids, np.array(json_len, dtype=np.int64), np.array(text_len, dtype=np.int64),
                          attribute_len, set(range(len(scan.block_starts) - 1)))
    return scan, described, (text.gzip, text.file) if text.gzip is not None else None


def _scan_documents(text: TextPass, path: str) -> tuple[Scan, list[str | None], list[int], list[int]]:
    """The documents file's pass: its :class:`Scan` (no attribute sets yet) and, per line,
    its id (None: not a document), its length and its text's length (:func:`text_len_of`)."""
    starts: list[int] = []
    ids: list[str | None] = []
    json_len: list[int] = []
    text_len: list[int] = []
    problems: list[str] = []
    more = 0
    end = 0  # text offset after the last line's newline
    last_offset = 0
    loads, add_id, add_json, add_text = json.loads, ids.append, json_len.append, text_len.append
    for number, (offset, line) in enumerate(lines_of(text.chunks(), path)):
        if not number % LINES_PER_BLOCK:
            starts.append(offset)
        # line_id and text_len_of inlined: this loop runs once per document of the dataset
        try:
            value = loads(line.decode("utf-8"))
        except (ValueError, RecursionError):
            value = None
        doc_id = value.get("id") if type(value) is dict else None
        if type(doc_id) is str:
            body = value.get("text")  # type: ignore[union-attr]
            add_text(NO_TEXT if type(body) is not str else len(body) if body.isascii()
                     else text_len_of(value, doc_id))
        else:
            add_text(NO_TEXT)
            if len(problems) < MAX_PROBLEMS:
                what = "no string id" if type(value) is dict else "not a JSON object"
                problems.append(f"{path} line {number + 1}: {what}; shown only as its index key's .json")
            else:
                more += 1
            doc_id = None
        add_id(doc_id)
        add_json(len(line))
        last_offset, end = offset, offset + len(line) + 1
    if text.damage is not None and text.text_bytes == 0:
        raise DolmaError(text.damage)
    if text.damage is not None and ids and end > text.text_bytes:
        # the damage cut the last line: it is lost with the rest, not a document
        if ids.pop() is None:
            if more:
                more -= 1
            else:
                problems.pop()
        json_len.pop()
        text_len.pop()
        if len(ids) % LINES_PER_BLOCK == 0:
            starts.pop()
        end = last_offset
    lines = len(ids)
    end = min(end, text.text_bytes)
    if text.damage is not None:
        # the lines after the damage are lost: the block they fall in fails alone
        if lines % LINES_PER_BLOCK == 0:
            starts.append(end)
        end = text.text_bytes
    scan = Scan(np.array([*starts, end], dtype=np.uint64), lines, problems, more,
                damage=text.damage, text_bytes=text.text_bytes)
    return scan, ids, json_len, text_len


def _line_up(path: str, documents: str, ids: list[str | None], scan: Scan,
             storage: Storage) -> tuple[str | None, np.ndarray, np.ndarray, bytes]:
    """Why the attributes file at ``path`` does not line up with the documents (None if it
    does), its block starts, its lines' lengths and its seek state."""
    starts: list[int] = []
    lengths: list[int] = []
    end = 0
    number = -1
    text = TextPass(path, storage)
    why = None
    try:
        for number, (offset, line) in enumerate(lines_of(text.chunks(), path)):
            if number >= len(ids):
                if scan.damage is None:
                    _, attribute_id = line_id(line)
                    why = (f"{path} line {number + 1}: id {attribute_id!r} where {documents} has no line "
                           f"(it has {len(ids)})")
                break
            if number % LINES_PER_BLOCK == 0:
                starts.append(offset)
            _, attribute_id = line_id(line)
            if attribute_id != ids[number]:
                why = f"{path} line {number + 1}: id {attribute_id!r} where {documents} has {ids[number]!r}"
                break
            lengths.append(len(line))
            end = offset + len(line) + 1
    except DolmaError as exc:
        why = str(exc)
    finally:
        text.close()
    if why is None and text.damage is not None:
        why = text.damage
    if why is None and number + 1 < len(ids):
        why = (f"{path} line {number + 2}: no line (it has {number + 1}) where {documents} has "
               f"{ids[number + 1]!r}")
    if why is not None:
        return why, np.zeros(0, np.uint64), np.zeros(0, np.int64), b""
    end = min(end, text.text_bytes)
    blocks = len(scan.block_starts) - 1
    while len(starts) < blocks:  # the documents' failing block: no attribute lines read for it
        starts.append(end)
    return None, np.array([*starts, end], dtype=np.uint64), np.array(lengths, dtype=np.int64), text.seek_state
