"""A Dolma :class:`~.scan.Scan` as a saved state (:mod:`atlasfs.formats.state`), and back.

Fields: ``lines_per_block``, ``lines``, ``text_bytes``, ``more_problems`` (integers),
``damage`` (a text, absent when the text is whole), ``problems`` (texts), ``blocks`` (the
block offsets, uint64), and per attribute set ``starts:<set>`` (its block offsets) or
``left_out:<set>`` (why it does not line up); per file with a seek state
``seek:documents`` or ``seek:attributes/<set>`` (zstd frame offsets, or the gzip index
zstd-compressed, ~1% of the text). :func:`decode_state` checks what they mean against the
files as they are now (every count, offsets in order and within the text, the attribute
sets present now, each seek state's whole structure and its file's size): a stored
table may have been written by another user.
"""

from __future__ import annotations

import numpy as np
import zstandard

from atlasfs.formats import state
from atlasfs.formats.dolma.scan import LINES_PER_BLOCK, MAX_PROBLEMS, Scan
from atlasfs.formats.dolma.seek import check_gzip_index, file_kind

#: Version of the saved state; another version is rebuilt.
STATE_VERSION = 2
#: Most bytes a stored state may ask to be inflated to (its seek states; ~3% of a file's text).
MAX_STATE_BYTES = 1 << 32
_FIELDS = {"lines_per_block", "lines", "text_bytes", "damage", "problems", "more_problems", "blocks"}


def _roles(path: str, attributes: dict[str, str]) -> dict[str, str]:
    """The name of each file's seek state in the saved state: documents, attributes/<set>."""
    return {"documents": path, **{f"attributes/{n}": p for n, p in sorted(attributes.items())}}


def encode_state(scan: Scan, path: str, attributes: dict[str, str]) -> bytes:
    """``scan`` of the documents file ``path`` as bytes; ``attributes`` maps set names to
    files, for their seek states."""
    fields: dict[str, state.Value] = {
        "lines_per_block": LINES_PER_BLOCK, "lines": scan.lines, "text_bytes": scan.text_bytes,
        "more_problems": scan.more_problems, "problems": scan.problems,
        "blocks": scan.block_starts.astype("<u8")}
    if scan.damage is not None:
        fields["damage"] = scan.damage
    for name in sorted(attributes):
        if name in scan.left_out:
            fields[f"left_out:{name}"] = scan.left_out[name]
        else:
            fields[f"starts:{name}"] = scan.attribute_starts[name].astype("<u8")
    for role, file in _roles(path, attributes).items():
        if scan.seek_states.get(file):
            fields[f"seek:{role}"] = scan.seek_states[file]
    return state.encode("dolma", STATE_VERSION, fields)


def _offsets(fields: state.State, name: str, count: int, limit: int, what: str) -> np.ndarray:
    """Offsets into a file's text: ``count`` of them, in order, within ``0..limit``."""
    values = fields.array(name, "<u8", (count,)).astype(np.uint64)
    if count and (int(values[-1]) > limit or bool(np.any(np.diff(values.astype(np.int64)) < 0))):
        raise ValueError(f"{what}: offsets out of order or past the text's end")
    return values


def _unpack(data: bytes, what: str) -> bytes:
    """A stored gzip index inflated; a bomb cannot pass: the frame must say its length, within bounds."""
    raw_length = zstandard.frame_content_size(data)
    if not 0 <= raw_length <= MAX_STATE_BYTES:
        raise ValueError(f"{what} has a bad length")
    raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_length)
    if len(raw) != raw_length:
        raise ValueError(f"{what} has the wrong length")
    return raw


def decode_state(saved: bytes, path: str, attributes: dict[str, str], sizes: dict[str, int]) -> Scan:
    """What :func:`encode_state` made, checked against the documents file ``path``, its
    attribute sets and every file's size now (``sizes``); ``ValueError`` if it does not fit."""
    fields = state.decode(saved, "dolma", STATE_VERSION)
    fields.only(_FIELDS, ("starts:", "left_out:", "seek:"))
    if fields.integer("lines_per_block") != LINES_PER_BLOCK:
        raise ValueError(f"{path}: stored state has another version")
    lines, text_bytes = fields.integer("lines"), fields.integer("text_bytes")
    damage = fields.optional_text("damage")
    size = sizes[path]
    if file_kind(path) == "plain" and (text_bytes != size or damage is not None):
        raise ValueError(f"{path}: stored state is for another file ({text_bytes} bytes, not {size})")
    if lines > text_bytes + 1:
        raise ValueError(f"{path}: stored line count exceeds the text")
    blocks = -(-lines // LINES_PER_BLOCK) + (1 if damage is not None and lines % LINES_PER_BLOCK == 0 else 0)
    block_starts = _offsets(fields, "blocks", blocks + 1, text_bytes, f"{path}: stored block offsets")
    if blocks and (int(block_starts[0]) != 0 or (damage is None and int(block_starts[-1]) + 1 < text_bytes)):
        raise ValueError(f"{path}: stored block offsets do not span the text")
    scan = Scan(block_starts, lines, fields.texts("problems", max_count=MAX_PROBLEMS),
                fields.integer("more_problems"), damage=damage, text_bytes=text_bytes)
    sets = {n.split(":", 1)[1] for n in fields.names("starts:") + fields.names("left_out:")}
    if sets != set(attributes) or len(sets) != len(fields.names("starts:") + fields.names("left_out:")):
        raise ValueError(f"{path}: stored attribute sets {sorted(sets)} are not once each the ones there are now "
                         f"{sorted(attributes)}")
    text_of: dict[str, int] = {path: text_bytes}
    for name, file in attributes.items():
        if f"left_out:{name}" in fields:
            scan.left_out[name] = fields.text(f"left_out:{name}")
            continue
        starts = _offsets(fields, f"starts:{name}", blocks + 1, 1 << 62, f"{path}: stored offsets of {file}")
        if file_kind(file) == "plain" and int(starts[-1]) > sizes[file]:
            raise ValueError(f"{path}: stored offsets of {file} pass its end")
        scan.attribute_starts[name] = starts
        text_of[file] = int(starts[-1])
    roles = _roles(path, attributes)
    for name in fields.names("seek:"):
        file = roles.get(name[len("seek:"):])
        if file is None:
            raise ValueError(f"{path}: stored seek states for unknown files")
        if file not in text_of:
            raise ValueError(f"{path}: stored seek state for the left-out {file}")
        data = fields.blob(name)
        what = f"{path}: stored seek state of {file}"
        _check_seek_state(path, file, _unpack(data, what) if file_kind(file) == "gz" else data,
                          text_of[file], sizes[file])
        scan.seek_states[file] = data
    for file, text_end in text_of.items():
        if file_kind(file) != "plain" and file not in scan.seek_states and text_end:
            raise ValueError(f"{path}: stored state has no seek state for {file}")
    return scan


def _check_seek_state(path: str, file: str, data: bytes, text_end: int, size: int) -> None:
    """``ValueError`` if ``data`` is not a seek state of ``file`` (``size`` bytes, ``text_end``
    bytes of text) of the documents file ``path``."""
    kind = file_kind(file)
    if kind == "gz":
        points = check_gzip_index(data, size, max(text_end, 0))
        if file == path and points and max(p[1] for p in points) > text_end:
            raise ValueError(f"{path}: stored gzip index passes the text's end")
    elif kind == "zst":
        if len(data) % 16:
            raise ValueError(f"{path}: stored zstd frames of {file} are not offset pairs")
        frames = np.frombuffer(data, dtype="<u8").reshape(-1, 2).astype(np.int64)
        if len(frames) and (tuple(frames[0]) != (0, 0) or bool(np.any(np.diff(frames[:, 0]) <= 0))
                            or bool(np.any(np.diff(frames[:, 1]) < 0)) or int(frames[-1, 0]) >= size):
            raise ValueError(f"{path}: stored zstd frames of {file} are out of order")
    elif data:
        raise ValueError(f"{path}: stored seek state for the plain file {file}")
