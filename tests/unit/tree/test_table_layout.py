"""The native engine's table constants equal Python's (atlasfs/tree/table/layout.py).

C reads attached tables itself: a kind, a sentinel, a column width or the node-id split
written differently there than in Python makes the engine answer wrong sizes or rows. C states
them once, in ``atlasfs/fuse/native/layout.h``: every ``#define`` there must be one this test
knows Python's value of, equal to it, and defined nowhere else. The other C sources are read
too (``*.c`` and ``*.h``, with ``atlasfs/formats/atlas/native``'s): the column widths their reads and checks use, the node-id shift and
mask, and the inline buffer's size. The parser is checked on small C texts, so that it cannot
pass by finding nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

from atlasfs.formats.naming import MAX_NAME_BYTES
from atlasfs.tree.table import layout

#: The repository (found upward, so that this file may move within tests/).
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())
NATIVE = ROOT / "atlasfs" / "fuse" / "native"
#: The C sources read: the engine's, and the formats' readers (Atlas's located.c).
SOURCE_FOLDERS = (NATIVE, ROOT / "atlasfs" / "formats" / "atlas" / "native")

#: C ``#define`` -> its value in Python. Each must be defined in C, with this value (the
#: header's others: :data:`LAYOUT_H`).
REQUIRED: dict[str, int] = {
    "KIND_FILE": layout.FILE,
    "UNKNOWN_SIZE": layout.UNKNOWN_SIZE,
    "NO_LOCATOR": layout.NO_LOCATOR,
    "INLINE_PREFIX": layout.INLINE,
    "KEPT_PREFIX": layout.KEPT,
    "KEPT_BLOCK_MAX": layout.KEPT_BLOCK_MAX,
    "TABLE_NODES": layout.TABLE_NODES,
    "NAME_BYTES": MAX_NAME_BYTES,
}
#: Bytes a row of each column takes, from Python's dtypes (``offsets``: per row too).
WIDTHS = {name: np.dtype(dtype).itemsize for name, dtype, _ in layout.ENTRY_SECTIONS}
WIDTHS.update({name: np.dtype(dtype).itemsize for name, dtype in layout.LOCATOR_SECTIONS})
#: The header that states the table's layout for C, and each of its ``#define``s' value in
#: Python: it must define every one, and nothing else (a constant added to it is added here).
HEADER = "layout.h"
LAYOUT_H: dict[str, int] = {
    "KIND_FILE": layout.FILE, "KIND_DIR": layout.DIR, "KIND_UNREADABLE": layout.UNREADABLE,
    "UNKNOWN_SIZE": layout.UNKNOWN_SIZE, "NO_LOCATOR": layout.NO_LOCATOR, "INLINE_PREFIX": layout.INLINE,
    "KEPT_PREFIX": layout.KEPT, "INLINE_MAX": layout.INLINE_MAX, "KEPT_BLOCK_MAX": layout.KEPT_BLOCK_MAX,
    "ROOT_NODE": layout.ROOT, "ROW_BITS": layout.ROW_BITS, "TABLE_NODES": layout.TABLE_NODES,
    "ROW_MASK": layout.ROW_MASK, **{f"WIDTH_{column.upper()}": width for column, width in WIDTHS.items()},
}
#: Column names read at a row index (a read at a bare row index is one byte a row).
ROW_INDEXED = set(WIDTHS)

_C_MAX = {"UINT64_MAX": 2**64 - 1, "UINT32_MAX": 2**32 - 1, "UINT16_MAX": 2**16 - 1, "UINT8_MAX": 255}
_CAST = re.compile(r"\(\s*(?:size_t|u?int\d+_t|unsigned(?: long)*|long|int)\s*\)")
_NUMBER = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]*\b")


def c_value(expression: str, defines: dict[str, str], depth: int = 0) -> int:
    """The value of a C integer constant expression (numbers, shifts, arithmetic, casts,
    ``UINTn_MAX``, ``UINT64_C``, other defines); ValueError for anything else."""
    text = _CAST.sub("", re.sub(r"/\*.*?\*/|//.*", "", expression))
    text = re.sub(r"\bUINT\d+_C\(([^()]*)\)", r"(\1)", text)
    text = _NUMBER.sub(r"\1", text)

    def name(m: re.Match) -> str:
        word = m.group(0)
        if word in _C_MAX:
            return str(_C_MAX[word])
        if word in defines and depth < 8:
            return f"({c_value(defines[word], defines, depth + 1)})"
        raise ValueError(f"not a constant: {word} in {expression!r}")

    text = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: m.group(0) if re.fullmatch(r"0[xX][0-9a-fA-F]+", m.group(0))
                  else name(m), text)
    if not re.fullmatch(r"[0-9a-fA-FxX()<>+\-*|&~ ]*", text) or not text.strip():
        raise ValueError(f"not a constant expression: {expression!r}")
    return int(eval(text, {"__builtins__": {}}))  # only digits and operators are left


def defines_of(sources: Iterable[tuple[str, str]]) -> tuple[dict[str, str], list[str]]:
    """Every object-like ``#define NAME value`` of the sources, and one line for each name
    defined twice with different text."""
    found: dict[str, tuple[str, str]] = {}
    twice = []
    for where, text in sources:
        for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)[ \t]+([^\n]*?)[ \t]*$", text, re.M):
            name, value = m.group(1), re.sub(r"/\*.*?\*/|//.*", "", m.group(2)).strip()
            if name in found and found[name][1] != value:
                twice.append(f"{name}: {found[name][0]} says {found[name][1]!r}, {where} says {value!r}")
            found.setdefault(name, (where, value))
    return {name: value for name, (_, value) in found.items()}, twice


def widths_of(text: str, defines: dict[str, str]) -> list[tuple[str, int, str]]:
    """``(column, bytes a row, the C text)`` of each column read or length check in ``text``."""
    found = []
    for m in re.finditer(r"column_read\(\s*&\w+->(\w+)\s*,\s*([^,]+?)\s*,", text):
        column, at = m.groups()
        times = re.search(r"\*\s*(\w+)\s*$", at.strip().rstrip(")"))
        if times:
            found.append((column, c_value(times.group(1), defines), m.group(0)))
        elif column in ROW_INDEXED and re.fullmatch(r"(\(\w+\))?\s*(row|first|mid|i)", at.strip()):
            found.append((column, 1, m.group(0)))
    for m in re.finditer(r"u64_at\(\s*&\w+->(\w+)", text):
        found.append((m.group(1), 8, m.group(0)))
    for m in re.finditer(r"\bfresh\.(\w+)\.len\s*!=\s*\(?\s*n(?:\s*\+\s*1)?\s*\)?\s*\*\s*(\w+)", text):
        found.append((m.group(1), c_value(m.group(2), defines), m.group(0)))
    for m in re.finditer(r"column\(\s*\w+\s*,\s*\w+\s*,\s*&\w+->(\w+)\s*,\s*\(\w+\)\s*\(\s*\w+->rows\s*\*\s*(\w+)\s*\)", text):
        found.append((m.group(1), c_value(m.group(2), defines), m.group(0)))
    return [f for f in found if f[0] in WIDTHS]


def problems(sources: list[tuple[str, str]]) -> list[str]:
    """One line for each C constant that is not Python's, or required and missing."""
    defines, twice = defines_of(sources)
    # a file's own constant (IOV_PIECES...) may be another file's of another value: only the
    # table's are stated once
    lines = [line for line in twice if line.split(":")[0] in {*REQUIRED, *LAYOUT_H}]
    for name, value in REQUIRED.items():
        if name not in defines:
            lines.append(f"{name}: not defined in atlasfs/fuse/native (Python's is {value:#x})")
            continue
        got = c_value(defines[name], defines)
        if got != value:
            lines.append(f"{name}: C says {defines[name]} = {got:#x}, Python {value:#x}")
    text = "\n".join(t for _, t in sources)
    seen = set()
    for column, width, said in widths_of(text, defines):
        seen.add(column)
        if width != WIDTHS[column]:
            lines.append(f"column {column}: C reads {width} bytes a row ({said}), Python's dtype is {WIDTHS[column]}")
    for column in ("kind", "size", "block", "by_path", "offsets", "offset", "length", "check", "prefix"):
        if column not in seen:
            lines.append(f"column {column}: no read or length check of it found in C (the test's patterns need updating?)")
    shifts = re.findall(r"\bino\s*>>\s*(\w+)", text)
    masks = re.findall(r"\bino\s*&\s*(\w+)", text)
    if not shifts or not masks:
        lines.append("node ids: no `ino >> ...` or `ino & ...` found in C")
    lines += [f"node ids: C shifts by {s}, Python by {layout.ROW_BITS}" for s in shifts
              if c_value(s, defines) != layout.ROW_BITS]
    lines += [f"node ids: C masks with {m}, Python with {layout.ROW_MASK:#x}" for m in masks
              if c_value(m, defines) != layout.ROW_MASK]
    inline = re.findall(r"\binline_bytes\s*\[\s*(\w+(?:\s*\+\s*1)?)\s*\]", text)
    lines += [f"inline_bytes[{n}]: holds {c_value(n, defines) - 1} bytes and a NUL? Python's INLINE_MAX is "
              f"{layout.INLINE_MAX}" for n in inline if c_value(n, defines) != layout.INLINE_MAX + 1]
    return lines


def header_problems(sources: list[tuple[str, str]]) -> list[str]:
    """One line for each difference between the header (:data:`HEADER`) and :data:`LAYOUT_H`:
    a constant missing from it, one it defines that Python has no value for, one of another
    value than Python's, or one also defined in another source."""
    texts = dict(sources)
    if HEADER not in texts:
        return [f"{HEADER}: not among the C sources"]
    defines, _ = defines_of([(HEADER, texts[HEADER])])
    lines = [f"{name}: not defined in {HEADER} (Python's is {value:#x})"
             for name, value in LAYOUT_H.items() if name not in defines]
    for name, text in defines.items():
        if name not in LAYOUT_H:
            lines.append(f"{name}: defined in {HEADER}, but this test knows no Python value for it")
        elif (got := c_value(text, defines)) != LAYOUT_H[name]:
            lines.append(f"{name}: {HEADER} says {text} = {got:#x}, Python {LAYOUT_H[name]:#x}")
    for where, text in sources:
        if where != HEADER:
            again = set(defines_of([(where, text)])[0]) & set(LAYOUT_H)
            lines += [f"{name}: defined in {where} too (layout.h states it once)" for name in sorted(again)]
    return lines


def _native_sources() -> list[tuple[str, str]]:
    paths = sorted(p for folder in SOURCE_FOLDERS for p in [*folder.glob("*.h"), *folder.glob("*.c")])
    return [(p.name, p.read_text(errors="replace")) for p in paths]


def test_the_c_engine_states_the_table_layout_as_python_does() -> None:
    sources = _native_sources()
    assert sources, f"no C sources in {NATIVE}"
    found = problems(sources) + header_problems(sources)
    assert not found, "\n".join(found)


def test_node_ids_split_into_the_shard_and_row_they_were_made_of() -> None:
    s, row = 5, 7
    assert layout.split_ino(layout.row_ino(s, row)) == (s, row)
    assert layout.split_ino(layout.shard_ino(s)) == (s, -1)
    assert layout.shard_ino(0) == layout.TABLE_NODES


# The parser, on small C texts: each difference is seen.

_GOOD = """
#define KIND_FILE 0
#define UNKNOWN_SIZE UINT64_MAX
#define NAME_BYTES 255
#define NO_LOCATOR UINT32_MAX
#define INLINE_PREFIX 0xFFFF
#define KEPT_PREFIX 0xFFFE
#define KEPT_BLOCK_MAX (16u << 20)
#define TABLE_NODES (UINT64_C(1) << 32)
char inline_bytes[256];
shard = (ino >> 32) - 1; row = (int64_t)(ino & 0xFFFFFFFFu) - 1;
column_read(&t->kind, row, &kind, 1); column_read(&t->size, (uint64_t)row * 8, &s, 8);
column_read(&t->block, (uint64_t)row * 4, &b, 4); column_read(&t->by_path, mid * 4, &at, 4);
column_read(&t->offsets, row * 8, bounds, 16); column_read(&l->offset, row * 4, &o, 4);
column_read(&l->length, row * 4, &n, 4); column_read(&l->check, row * 4, &c, 4);
column_read(&l->prefix, row * 2, &p, 2);
"""


def test_the_parser_passes_what_agrees() -> None:
    assert problems([("good.c", _GOOD)]) == []


@pytest.mark.parametrize(("old", "new", "expected"), [
    ("#define KIND_FILE 0", "#define KIND_FILE 1", "KIND_FILE: C says 1"),
    ("#define KEPT_BLOCK_MAX (16u << 20)", "#define KEPT_BLOCK_MAX (8u << 20)", "KEPT_BLOCK_MAX"),
    ("#define KEPT_PREFIX 0xFFFE", "", "KEPT_PREFIX: not defined"),
    ("#define TABLE_NODES (UINT64_C(1) << 32)", "#define TABLE_NODES (UINT64_C(1) << 31)", "TABLE_NODES"),
    ("(uint64_t)row * 8, &s, 8", "(uint64_t)row * 4, &s, 4", "column size: C reads 4 bytes"),
    ("row * 2, &p, 2", "row * 4, &p, 4", "column prefix: C reads 4 bytes"),
    ("column_read(&t->by_path, mid * 4, &at, 4);", "", "column by_path: no read"),
    ("(ino >> 32)", "(ino >> 31)", "node ids: C shifts by 31"),
    ("0xFFFFFFFFu", "0x7FFFFFFFu", "node ids: C masks with 0x7FFFFFFFu"),
    ("inline_bytes[256]", "inline_bytes[255]", "inline_bytes[255]"),
    ("#define NAME_BYTES 255", "#define NAME_BYTES 254", "NAME_BYTES: C says 254"),
])
def test_the_parser_finds_each_difference(old: str, new: str, expected: str) -> None:
    assert old in _GOOD
    found = problems([("bad.c", _GOOD.replace(old, new))])
    assert any(expected in line for line in found), found


_HEADER = "\n".join(f"#define {name} {value:#x}" for name, value in LAYOUT_H.items())


def test_the_header_check_passes_what_agrees() -> None:
    assert header_problems([(HEADER, _HEADER), ("a.c", "#define OTHER 3\n")]) == []


@pytest.mark.parametrize("name", sorted(LAYOUT_H))
def test_the_header_check_finds_each_constant_changed(name: str) -> None:
    changed = _HEADER.replace(f"#define {name} {LAYOUT_H[name]:#x}", f"#define {name} {LAYOUT_H[name] ^ 1:#x}")
    assert changed != _HEADER
    found = header_problems([(HEADER, changed)])
    assert any(line.startswith(f"{name}: {HEADER} says") for line in found), found


@pytest.mark.parametrize(("header", "other", "expected"), [
    (_HEADER.replace("#define KIND_DIR 0x1", ""), "", "KIND_DIR: not defined in layout.h"),
    (_HEADER + "\n#define KIND_SYMLINK 3", "", "KIND_SYMLINK: defined in layout.h, but"),
    (_HEADER, "#define ROW_BITS 32\n", "ROW_BITS: defined in other.c too"),
])
def test_the_header_check_finds_what_is_missing_extra_or_twice(header: str, other: str, expected: str) -> None:
    found = header_problems([(HEADER, header), ("other.c", other)])
    assert any(expected in line for line in found), found


def test_a_files_own_constant_may_differ_elsewhere() -> None:
    assert problems([("good.c", _GOOD + "#define IOV_PIECES 64\n"), ("other.c", "#define IOV_PIECES 256\n")]) == []
    found = problems([("good.c", _GOOD), ("other.c", "#define KEPT_PREFIX 0xFFFD\n")])
    assert any(line.startswith("KEPT_PREFIX: good.c says") for line in found), found


def test_a_name_defined_twice_differently_is_a_problem() -> None:
    _, twice = defines_of([("a.h", "#define KEPT_PREFIX 0xFFFE\n"), ("b.c", "#define KEPT_PREFIX 0xFFFD\n")])
    assert twice and "a.h" in twice[0] and "b.c" in twice[0]


def test_c_values() -> None:
    defines = {"A": "(UINT64_C(1) << 32)", "B": "(A - 1)"}
    assert c_value("(16u << 20)", defines) == 16 << 20
    assert c_value("B", defines) == (1 << 32) - 1
    assert c_value("(size_t)32 << 20", defines) == 32 << 20
    with pytest.raises(ValueError):
        c_value("sizeof(int)", defines)
