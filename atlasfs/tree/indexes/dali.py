"""NVIDIA DALI's webdataset index (v1.2), as its ``wds2idx`` (DALI 2.4.0) writes it.

``fn.readers.webdataset(paths=[...], index_paths=[...])`` reads, per tar, a text index:
``v1.2 <samples>``, then one line a sample, ``ext data_offset size name`` for each of its
members, space-separated. Without one it reads every tar whole when the pipeline is built.

``wds2idx`` takes each member's block and name from GNU tar's listing (``tar --list
--block-num``: the block of the ustar header, after any pax header; the name as tar
prints it) and its size from ``tar --verbose --list``; the data offset is that block's end.
A key is the name up to the first dot of its last part (``wds2idx``'s ``split_name``, kept
as it is, quirks and all: a name without a dot there loses its last character), members
whose key is empty or ends with a slash (hidden files) are skipped, and consecutive members
of one key are one sample. Names here are printed as GNU tar prints them in a UTF-8 locale
(``wds2idx`` run under ``LANG=C`` escapes every non-ASCII byte instead).

``wds2idx X/0.tar`` names its index after the tar up to its first dot: ``X/0.idx``. The tar
view serves it as ``<shard>.idx``, the same name for every shard name without a dot.
"""

from __future__ import annotations

from atlasfs.tree.indexes.energon import Layout, layout_names

VERSION = "v1.2"
SUFFIX = ".idx"  # replacing ".tar"

_ESCAPES = {"\\": "\\\\", "\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t",
            "\v": "\\v"}


def tar_printed(name: str) -> str:
    """``name`` as GNU tar 1.34 lists it in a UTF-8 locale (its default ``escape`` quoting:
    backslash escapes for a backslash and control characters, octal for other unprintable
    bytes and for bytes that are not UTF-8)."""
    if name.isascii() and name.isprintable() and "\\" not in name:
        return name
    out = []
    for char in name:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif char.isprintable() and not 0xD800 <= ord(char) <= 0xDFFF:
            out.append(char)
        else:
            out.extend(f"\\{byte:03o}" for byte in char.encode("utf-8", "surrogateescape"))
    return "".join(out)


def split_name(path: str) -> tuple[str, str]:
    """``wds2idx``'s ``IndexCreator.split_name``."""
    dot = path.find(".", path.rfind("/") + 1)
    return path[:dot], path[dot + 1:]


def dali_index(layout: Layout) -> bytes:
    """The v1.2 index ``wds2idx`` writes for the tar laid out by ``layout``; an empty
    tar (no sample) gets ``v1.2 0`` (``wds2idx`` fails on one, leaving an empty file)."""
    samples: list[list[str]] = []
    last = None
    for name, data, size in zip(layout_names(layout), layout.data_starts().tolist(), layout.sizes.tolist()):
        name = tar_printed(name)
        key, ext = split_name(name)
        if not key or key.endswith("/"):
            continue
        entry = f"{ext} {data} {size} {name}"
        if key != last:
            samples.append([entry])
            last = key
        else:
            samples[-1].append(entry)
    lines = [f"{VERSION} {len(samples)}", *(" ".join(sample) for sample in samples)]
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")
