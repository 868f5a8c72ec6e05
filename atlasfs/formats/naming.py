"""How an example becomes WebDataset-style files: names and bytes.

Pure functions, no I/O. The contract is written down in ``docs/layout.md``;
in short, a dict example ``{"__key__": "a/b", "jpg": b"...", "cls": 3}``
becomes the files ``a/b.jpg`` and ``a/b.cls``, whose bytes are what the
WebDataset writer would have written, so that ``webdataset.WebDataset(...)
.decode()`` gives the values back.

Every encoding here is deterministic (same value, same bytes, in any
process): the mount reports exact sizes before reading, re-encodes blocks
after cache eviction, and ``atlasfs export`` must match it byte for byte.
"""

from __future__ import annotations

import functools
import io
import json
import pickle
import re
import zipfile
from typing import Any

import numpy as np

#: Bumped whenever the rules below change what a dataset's files are named or
#: hold, so that file tables stored by an older atlasfs are rebuilt.
#: 2: no name may start with ``-`` or start or end with whitespace (:func:`name_problem`).
LAYOUT_VERSION = 2
#: Index keys have at least this many digits (WebDataset's habit).
INDEX_KEY_MIN_WIDTH = 6
#: Longest file name component Linux accepts (NAME_MAX).
MAX_NAME_BYTES = 255
#: Longest accepted ``__key__``, so that paths stay far below PATH_MAX.
MAX_KEY_BYTES = 1024
#: Values whose JSON text would exceed this go to ``.pickle`` instead (see :func:`json_exact`).
MAX_JSON_BYTES = 16 << 20
MAX_JSON_DEPTH = 200
#: Pickles written for ``.pickle`` files use the oldest protocol with framing
#: that every supported Python reads.
PICKLE_PROTOCOL = 4

INT_EXTS = frozenset({"cls", "cls2", "index", "inx", "id"})
TEXT_EXTS = frozenset({"txt", "text", "transcript"})
JSON_EXTS = frozenset({"json", "jsn"})
PICKLE_EXTS = frozenset({"pickle", "pyd", "pkl"})

_METADATA = re.compile(r"__.+__", re.DOTALL)


def is_metadata(name: object) -> bool:
    """Fields named ``__like_this__`` (``__key__``, ``__url__``...) are not shown as files."""
    return isinstance(name, str) and _METADATA.fullmatch(name) is not None


def index_key_width(num_examples: int) -> int:
    """Digits of the index keys of a dataset with ``num_examples`` examples."""
    return max(INDEX_KEY_MIN_WIDTH, len(str(max(num_examples - 1, 0))))


def index_key(index: int, width: int) -> str:
    """The key of the example at global ``index``, zero-padded to ``width``."""
    return str(index).zfill(width)


def _encodable(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogates); ASCII is known at once."""
    return text.isascii() or _utf8(text) is not None


def _utf8(text: str) -> bytes | None:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return None


#: Unicode category Cc: C0 controls, DEL and C1 controls.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _has_control(text: str) -> bool:
    return _CONTROL.search(text) is not None


# ---------------------------------------------------------------- values -> bytes


class _CanonicalPickler(pickle._Pickler):  # type: ignore[name-defined]
    """The pure-Python pickler, with sets in a stable order.

    Set iteration order depends on string hashing, which differs between
    processes; sorting makes ``.pickle`` files identical everywhere.
    """

    dispatch = pickle._Pickler.dispatch.copy()  # type: ignore[attr-defined]

    def _save_sorted(self, obj: set[Any] | frozenset[Any]) -> None:
        try:
            items = sorted(obj)
        except TypeError:
            items = sorted(obj, key=lambda item: (type(item).__qualname__, canonical_pickle(item)))
        self.save_reduce(type(obj), (items,), obj=obj)

    dispatch[set] = _save_sorted
    dispatch[frozenset] = _save_sorted


def canonical_pickle(value: Any) -> bytes:
    """``pickle.dumps`` with a deterministic byte output."""
    buffer = io.BytesIO()
    _CanonicalPickler(buffer, protocol=PICKLE_PROTOCOL).dump(value)
    return buffer.getvalue()


def _plain_array(value: Any) -> bool:
    return type(value) is np.ndarray and not value.dtype.hasobject


def _npy_bytes(array: np.ndarray) -> bytes:
    if array.dtype.metadata is not None and array.dtype.names is None:
        # numpy 1 pickles give datetime dtypes an empty metadata dict, which
        # .npy cannot store (numpy warns); the values are unaffected.
        array = array.view(np.dtype(array.dtype.str))
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    # np.savez stamps the current time into the zip; fixed timestamps keep it deterministic.
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            with archive.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
    return buffer.getvalue()


def _is_npz_dict(value: Any) -> bool:
    return (type(value) is dict and all(
        isinstance(k, str) and k and "/" not in k and _plain_array(v) for k, v in value.items()))


_JSON_SCALARS = frozenset((str, int, float, bool, type(None)))
_STR = frozenset((str,))


def json_exact(value: Any, budget: int = MAX_JSON_BYTES) -> bool:
    """True if ``json.loads(json.dumps(value))`` gives back ``value`` with the same types,
    and its JSON text would stay within about ``budget`` bytes.

    The budget matters because unpickled data can share objects: a list holding
    the same list twice, 60 levels deep, is tiny as a pickle and astronomically
    large as JSON. The walk stops as soon as the budget is spent. Containers of
    scalars only (the usual metadata dict, a list of numbers) are checked in
    one step, without visiting their items one by one.
    """
    remaining = budget
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        kind = type(item)
        remaining -= 8
        if kind is str:
            remaining -= len(item)
        elif kind is int:
            if not _int_ok(item):
                return False
        elif kind is list or kind is dict:
            if depth >= MAX_JSON_DEPTH:  # json.dumps would hit the recursion limit
                return False
            if kind is dict:
                if not set(map(type, item)) <= _STR:
                    return False
                remaining -= sum(map(len, item))
                values = item.values()
            else:
                values = item
            kinds = set(map(type, values))
            if kinds <= _JSON_SCALARS:
                remaining -= 8 * len(item)
                if str in kinds:
                    remaining -= sum(len(x) for x in values if type(x) is str)
                if int in kinds and not all(_int_ok(x) for x in values if type(x) is int):
                    return False
            else:
                stack.extend((sub, depth + 1) for sub in values)
        elif not (item is None or kind is bool or kind is float):
            return False
        if remaining < 0:
            return False
    return True


def _int_ok(value: int) -> bool:
    """Whether ``str(value)`` works (Python limits the digits of int -> str to at least 640)."""
    return value.bit_length() < 2000 or _int_text(value) is not None


def _int_text(value: int) -> str | None:
    try:
        return str(value)
    except ValueError:  # more digits than int -> str allows
        return None


def _fits(ext: str, value: Any) -> bool:
    """Whether ``value`` can be written under the known extension ``ext`` (without writing it)."""
    if ext in INT_EXTS:
        return type(value) is int and _int_ok(value)
    if ext in TEXT_EXTS:
        return type(value) is str and _encodable(value)
    if ext in JSON_EXTS:
        return json_exact(value)
    if ext in PICKLE_EXTS:
        return True
    if ext == "npy":
        return _plain_array(value)
    return ext == "npz" and _is_npz_dict(value)


def _encode_as(ext: str, value: Any) -> bytes:
    """The bytes of ``value`` under extension ``ext``, which :func:`_fits` it."""
    if ext in INT_EXTS:
        return str(value).encode("ascii")
    if ext in TEXT_EXTS:
        return value.encode("utf-8")
    if ext in JSON_EXTS:
        return json.dumps(value).encode("ascii")
    if ext in PICKLE_EXTS:
        return canonical_pickle(value)
    if ext == "npy":
        return _npy_bytes(value)
    return _npz_bytes(value)


def type_extension(value: Any) -> str:
    """The extension appended to a field whose name has no fitting one."""
    kind = type(value)
    if kind is str and _encodable(value):
        return "txt"
    if kind is int and _int_ok(value):
        return "cls"
    if kind in (bool, float) or (kind in (dict, list) and json_exact(value)):
        return "json"
    if _plain_array(value):
        return "npy"
    return "pickle"


@functools.lru_cache(maxsize=4096)  # field names repeat from example to example
def _extension(name: str) -> str:
    return name.rsplit(".", 1)[-1].lower()  # WebDataset lower-cases suffixes


def field_suffix(name: str, value: Any) -> str:
    """The file suffix of a field: its name, plus ``.<type extension>`` when needed.

    bytes keep any name; other values keep the name if its extension fits the
    value. Decided without encoding the value (see :func:`encode_as`).
    """
    kind = type(value)
    if kind is bytes:
        return name
    if kind is str and value.isascii():  # the usual text field: decided by its name alone
        suffix = _ascii_text_suffix(name)
        if suffix is not None:
            return suffix
    return _suffix_rules(name, value)


def _suffix_rules(name: str, value: Any) -> str:
    """:func:`field_suffix`, rule by rule."""
    if type(value) is bytes or _fits(_extension(name), value):
        return name
    return f"{name}.{type_extension(value)}"


@functools.lru_cache(maxsize=4096)  # field names repeat from example to example
def _ascii_text_suffix(name: str) -> str | None:
    """:func:`field_suffix` of an ASCII ``str`` value, when the name alone decides it (not
    for a JSON extension: whether a string fits there depends on its length)."""
    ext = _extension(name)
    if ext in JSON_EXTS:
        return None
    return name if ext in TEXT_EXTS or ext in PICKLE_EXTS else f"{name}.txt"


def value_suffix(value: Any) -> str:
    """The extension of a non-dict example: its type extension, ``bin`` for bytes."""
    return "bin" if type(value) is bytes else type_extension(value)


def encode_as(suffix: str, value: Any) -> bytes:
    """The bytes of the file ``<key>.<suffix>`` holding ``value``: bytes unchanged, any
    other value encoded for the extension that ends ``suffix``.

    ``suffix`` must be what :func:`field_suffix`, :func:`value_suffix` or
    :func:`example_fields` chose for ``value``.
    """
    return value if type(value) is bytes else _encode_as(_extension(suffix), value)


def encode_field(name: str, value: Any) -> tuple[str, bytes]:
    """``(file suffix, bytes)`` of one field."""
    suffix = field_suffix(name, value)
    return suffix, encode_as(suffix, value)


def encode_value(value: Any) -> tuple[str, bytes]:
    """``(extension, bytes)`` of a non-dict example."""
    suffix = value_suffix(value)
    return suffix, encode_as(suffix, value)


# ---------------------------------------------------------------- names


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be the name of a file or folder atlasfs shows, or None if it can.

    The one rule every shown name passes, stated once: each component of a key, each field
    name, and each component of every path of a stored file table (:func:`paths_problem`,
    what loading one checks). A name is not empty, ``.`` or ``..``; has no ``/``, NUL or
    other control character; is valid UTF-8 of at most :data:`MAX_NAME_BYTES` bytes; and
    holds nothing shell tools take for an option or trim away: it does not start with
    ``-`` (``tar -T``, ``xargs``, ``rm *`` read ``-rf`` or ``-C..`` as options) and does
    not start or end with whitespace (``read``, ``tar -T`` and the like strip it).
    """
    if _PLAIN_NAME.fullmatch(name):
        return None  # the usual name (letters, digits, _ first; then also . and -): every rule holds
    return _name_rules(name)


def _name_rules(name: str) -> str | None:
    """:func:`name_problem`, rule by rule."""
    if not name:
        return "a name is empty"
    if name in (".", ".."):
        return f"name {name!r} is a folder's own or parent's"
    if "/" in name or _has_control(name):
        return f"name {name!r} contains '/', NUL or a control character"
    encoded = _utf8(name)
    if encoded is None:
        return f"name {name!r} is not valid UTF-8"
    if len(encoded) > MAX_NAME_BYTES:
        return f"name {name[:40]!r}... is too long (more than {MAX_NAME_BYTES} bytes)"
    if name.startswith("-"):
        return f"name {name!r} starts with '-', which tools take for an option"
    if name[0].isspace() or name[-1].isspace():
        return f"name {name!r} starts or ends with whitespace, which tools trim"
    return None


def path_problem(path: str) -> str | None:
    """Why the relative ``path`` cannot be shown, or None: :func:`name_problem` of each of
    its ``/``-separated components (so no absolute path, no empty component)."""
    for part in path.split("/"):
        problem = name_problem(part)
        if problem:
            return problem
    return None


def paths_problem(paths: list[bytes]) -> str | None:
    """Why one of ``paths`` (relative, UTF-8 encoded: a stored table's) cannot be shown, or
    None: :func:`path_problem` of each. Paths of the usual kind (every component a word
    character first, then word characters, ``.`` and ``-``), which the rules accept, are
    told at once by a few passes over all of them; any other path is checked by the rules."""
    if not paths:
        return None
    if not _plain_paths(paths):
        for path in paths:
            try:
                decoded = path.decode("utf-8")
            except UnicodeDecodeError:
                return f"name {path[:40]!r} is not valid UTF-8"
            problem = path_problem(decoded)
            if problem:
                return problem
    return None


def _plain_paths(paths: list[bytes]) -> bool:
    """True if every one of ``paths`` is of the usual kind (see :func:`paths_problem`), and
    so passes :func:`path_problem`; False if some may not."""
    joined = b"\n".join(paths)
    rest = joined.translate(None, _PLAIN_ASCII)  # what is not a letter, digit, _ . - / or newline
    if rest and rest.translate(None, _NON_ASCII):
        return False  # another ASCII character (space, control...)
    if joined.count(b"\n") != len(paths) - 1:
        return False  # a newline inside a path
    if any(mark in joined for mark in _BAD_STARTS) or joined[:1] in _BAD_FIRST or joined.endswith((b"/", b"\n")):
        return False  # a component empty or starting with - or .
    if max(map(len, paths)) > MAX_NAME_BYTES and _LONG_COMPONENT.search(joined):
        return False
    if rest:  # non-ASCII: valid UTF-8, and word characters only (no whitespace, no control)
        try:
            text = joined.decode("utf-8")
        except UnicodeDecodeError:
            return False
        if _NOT_WORD.search(text):
            return False
    return True


#: Names that pass every rule of :func:`name_problem` at a glance.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")
_PLAIN_ASCII = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-/\n"
_NON_ASCII = bytes(range(128, 256))
#: In newline-separated paths: an empty component, or one starting with ``-`` or ``.``.
_BAD_STARTS = (b"\n\n", b"\n/", b"/\n", b"//", b"\n-", b"/-", b"\n.", b"/.")
_BAD_FIRST = (b"/", b"-", b".", b"\n", b"")
#: A component longer than :data:`MAX_NAME_BYTES` bytes, in newline-separated encoded paths.
_LONG_COMPONENT = re.compile(rb"[^/\n]{%d}" % (MAX_NAME_BYTES + 1))
#: A character other than a word character (letters, digits and _ of any script), . - / or newline.
_NOT_WORD = re.compile(r"[^\w.\-/\n]")


def field_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a file name suffix as it is, or None if it can."""
    if not isinstance(name, str):
        return f"field name {name!r} is not a string"
    return _str_field_name_problem(name)


@functools.lru_cache(maxsize=4096)  # field names repeat from example to example
def _str_field_name_problem(name: str) -> str | None:
    if not name:
        return "a field name is empty"
    if name.startswith("."):
        return f"field name {name!r} starts with '.'"
    if "/" in name or "\x00" in name or _has_control(name):
        return f"field name {name!r} contains '/', NUL or a control character"
    if _utf8(name) is None:
        return f"field name {name!r} is not valid UTF-8"
    problem = name_problem(name)  # a file name ends with its field's name
    return f"field {problem}" if problem else None


def example_fields(example: Any, max_suffix_bytes: int) -> tuple[list[tuple[str, Any]], str | None]:
    """The files of one example, named but not encoded: ``([(suffix, value)...] sorted
    by suffix bytes, note)``; :func:`encode_as` gives each file's bytes.

    A file is named ``<key>.<suffix>``. When the fields cannot all be shown
    faithfully (a non-string, unsafe, too long or clashing name, or no visible
    field at all), the whole example becomes one ``pickle`` file and ``note``
    says why; otherwise ``note`` is None. Naming costs no encoding, so a folder
    can be listed before any of its files is encoded.
    """
    if not isinstance(example, dict):
        return [(value_suffix(example), example)], None
    problem = None
    fields: list[tuple[str, Any]] = []
    for name, value in example.items():
        if type(name) is str:
            if _metadata_field(name):
                continue
            problem = _str_field_name_problem(name)
        else:
            problem = field_name_problem(name)
        if problem:
            break
        fields.append((field_suffix(name, value), value))
    if not problem:
        problem, order = _plan(tuple([suffix for suffix, _ in fields]), max_suffix_bytes)
    if problem:
        return [("pickle", example)], f"{problem}; the example is shown whole as .pickle"
    return [fields[i] for i in order], None


@functools.lru_cache(maxsize=4096)  # field names repeat from example to example
def _metadata_field(name: str) -> bool:
    return is_metadata(name)


@functools.lru_cache(maxsize=4096)  # examples of a dataset mostly have the same fields
def _plan(suffixes: tuple[str, ...], max_suffix_bytes: int) -> tuple[str | None, tuple[int, ...]]:
    """Why an example's suffixes cannot all be files (or None), and the order of its files:
    by suffix bytes."""
    problem = _suffix_problem(list(suffixes), max_suffix_bytes)
    order = sorted(range(len(suffixes)), key=lambda i: suffixes[i].encode("utf-8", "surrogatepass"))
    return problem, tuple(order)


def example_files(example: Any, max_suffix_bytes: int) -> tuple[list[tuple[str, bytes]], str | None]:
    """The files of one example with their bytes: ``([(suffix, bytes)...], note)``
    (see :func:`example_fields`)."""
    fields, note = example_fields(example, max_suffix_bytes)
    return [(suffix, encode_as(suffix, value)) for suffix, value in fields], note


def _suffix_problem(suffixes: list[str], max_suffix_bytes: int) -> str | None:
    if not suffixes:
        return "no field to show"
    seen: set[str] = set()
    for suffix in suffixes:
        if len(suffix.encode("utf-8")) > max_suffix_bytes:
            return f"field file name {suffix[:40]!r}... is too long"
        folded = suffix.lower()  # WebDataset lower-cases suffixes, so case clashes collide there
        if folded in seen:
            return f"two fields would both be named {suffix!r}"
        seen.add(folded)
    return None


def key_problem(key: object, longest_suffix_bytes: int) -> str | None:
    """Why ``key`` is not a safe sample key, or None if it is.

    Safe: a string, valid UTF-8, no control characters, relative, no empty,
    ``.`` or ``..`` component, no ``.`` inside a component (WebDataset splits
    names at the first dot), not starting with a ``__name__`` component, each
    component within NAME_MAX together with the longest file suffix, and each
    component a name :func:`name_problem` accepts (no leading ``-``, no leading
    or trailing whitespace).
    """
    if type(key) is str and _PLAIN_KEY.fullmatch(key) and len(key) + 1 + longest_suffix_bytes <= MAX_NAME_BYTES \
            and not (key.startswith("__") and key.endswith("__") and len(key) > 4):
        return None  # the usual key (letters, digits, - and _, not - first; short): every rule below holds
    return _key_rules(key, longest_suffix_bytes)


def _key_rules(key: object, longest_suffix_bytes: int) -> str | None:
    """:func:`key_problem`, rule by rule."""
    if not isinstance(key, str):
        return f"__key__ {key!r} is not a string"
    encoded = _utf8(key)
    if encoded is None:
        return f"__key__ {key!r} is not valid UTF-8"
    if _has_control(key):
        return f"__key__ {key!r} contains a control character"
    if len(encoded) > MAX_KEY_BYTES:
        return f"__key__ is longer than {MAX_KEY_BYTES} bytes"
    if key.startswith("/"):
        return f"__key__ {key!r} is absolute"
    parts = key.split("/")
    if any(not part for part in parts):
        return f"__key__ {key!r} has an empty component"
    if any("." in part for part in parts):
        return f"__key__ {key!r} contains a '.'"
    if is_metadata(parts[0]):
        return f"__key__ {key!r} starts with a reserved __name__ component"
    if any(len(part.encode("utf-8")) > MAX_NAME_BYTES for part in parts):
        return f"__key__ {key[:40]!r}... has a component longer than {MAX_NAME_BYTES} bytes"
    if len(parts[-1].encode("utf-8")) + 1 + longest_suffix_bytes > MAX_NAME_BYTES:
        return f"__key__ {key[:40]!r}... is too long for its file names"
    problem = path_problem(key)  # every component a shown name (a file name starts with the last)
    return f"__key__ {key!r}: {problem}" if problem else None


#: Keys that pass every rule of :func:`key_problem` but the length and ``__name__`` ones at a glance.
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]{0,254}")

#: Stands for the ``__key__`` of an example that has none.
NO_KEY = object()


def declared_key(example: Any) -> object:
    """The example's ``__key__`` value, or :data:`NO_KEY`."""
    if isinstance(example, dict) and "__key__" in example:
        return example["__key__"]
    return NO_KEY


class KeyAssigner:
    """Gives each example of one shard its key, in order.

    A dict example with a safe, unused string ``__key__`` keeps it; any other
    example gets its index key. A ``__key__`` shaped like an index key (all
    digits, index-key width) is used only if it is the example's own index key,
    so explicit keys and index keys can never collide.
    """

    def __init__(self, width: int) -> None:
        self.width = width
        self._used: set[str] = set()
        self._index_shape = re.compile(r"[0-9]{%d}" % width)

    def assign(self, declared: object, index: int, longest_suffix_bytes: int) -> tuple[str, str | None]:
        """``(key, note)`` for the example at global ``index`` whose ``__key__`` is
        ``declared`` (:data:`NO_KEY` if it has none); ``note`` says why
        ``__key__`` was not used, when it was not."""
        fallback = index_key(index, self.width)
        note = None
        if declared is not NO_KEY:
            note = key_problem(declared, longest_suffix_bytes)
            if note is None and declared in self._used:
                note = f"__key__ {declared!r} is already used in this shard"
            if note is None and self._index_shape.fullmatch(declared) and declared != fallback:
                note = f"__key__ {declared!r} looks like another example's index key"
            if note is None:
                assert isinstance(declared, str)
                self._used.add(declared)
                return declared, None
            note += f"; using index key {fallback}"
        self._used.add(fallback)
        return fallback, note
