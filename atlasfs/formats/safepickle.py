"""Unpickling that runs no code from the data unless the caller trusts it.

Atlas blocks are pickles, and a pickle can name any importable callable
(``os.system``, ``builtins.eval``...) and have it called while loading. The
default loader therefore resolves only the globals that plain data needs:
builtin containers and scalars, a few standard value types, and the numpy
reconstructors for arrays, dtypes and scalars. numpy 1 pickles name
``numpy.core.*`` and numpy 2 pickles name ``numpy._core.*``; both map to the
installed numpy, so datasets written under either version load under both.
"""

from __future__ import annotations

import _compat_pickle
import builtins
import collections
import datetime
import io
import math
import pickle
from typing import Any, Callable

import numpy as np

from atlasfs.errors import AtlasFormatError, UnsafePickleError

try:  # numpy >= 2
    from numpy._core import multiarray as _multiarray
    from numpy._core import numeric as _numeric
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core import multiarray as _multiarray  # type: ignore[no-redef]
    from numpy.core import numeric as _numeric  # type: ignore[no-redef]


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """Stand-in for ``_codecs.encode``, which protocol 0-2 pickles use for bytes.

    Only the latin-1 text-to-bytes form is allowed: other codecs
    (``zlib_codec``...) would turn a tiny pickle into unbounded memory.
    """
    if not isinstance(text, str) or encoding.replace("-", "").lower() != "latin1":
        raise pickle.UnpicklingError(f"_codecs.encode allowed only for latin-1 text, not {encoding!r}")
    return text.encode("latin-1")


_BUILTIN_NAMES = (
    "dict list tuple set frozenset bytearray bytes str int float complex bool slice range"
).split()
_CONSTANTS = {("builtins", "Ellipsis"): Ellipsis, ("builtins", "NotImplemented"): NotImplemented}
_DATETIME_TYPES = (datetime.date, datetime.time, datetime.datetime, datetime.timedelta, datetime.timezone)


class _NdarrayClass:
    """What the safe loader hands out for ``numpy.ndarray``.

    Pickles name ``numpy.ndarray`` only as the first argument of numpy's
    ``_reconstruct``; handing out a token instead of the class means the
    pickle cannot call ``ndarray(shape)`` itself to allocate any size.
    """


_NDARRAY = _NdarrayClass()


def _frombuffer(buf: Any, *args: Any) -> Any:
    """numpy's ``_frombuffer`` (protocol 5 arrays) over the pickle's own bytes only.

    Over another array it would make a view, and rebuilding that array's state
    (a second BUILD) frees the memory the view still points to.
    """
    if type(buf) not in (bytes, bytearray):
        raise pickle.UnpicklingError(f"numpy _frombuffer over a {type(buf).__name__}, not bytes")
    return _numeric._frombuffer(buf, *args)


_OBJECT_ITEMSIZE = np.dtype(object).itemsize
_BYTE = np.dtype("u1")
_MAX_FIELDS = 4096


def check_dtype(dtype: np.dtype, depth: int = 0) -> None:
    """Raise ``UnpicklingError`` unless ``dtype`` is one numpy could have made itself.

    A pickled dtype's state is applied by numpy without checks: fields may lie
    outside the item, overlap an object field (raw bytes read as pointers), or
    carry an object flag that disagrees with the fields. Each of these makes
    later reads crash or leak memory.
    """
    if depth > 32 or dtype.itemsize < 0:
        raise pickle.UnpicklingError("dtype nests too deeply or has a negative size")
    if dtype.fields:
        if len(dtype.fields) > _MAX_FIELDS:
            raise pickle.UnpicklingError("dtype has too many fields")
        spans = []
        for spec in dtype.fields.values():
            field, offset = spec[0], spec[1]
            if not (isinstance(offset, int) and 0 <= offset and offset + field.itemsize <= dtype.itemsize):
                raise pickle.UnpicklingError("dtype field lies outside its item")
            check_dtype(field, depth + 1)
            spans.append((offset, offset + field.itemsize, field.hasobject))
        if any(s[2] for s in spans) != dtype.hasobject:
            raise pickle.UnpicklingError("dtype object flag disagrees with its fields")
        spans.sort()
        for (start, end, obj), (next_start, _, next_obj) in zip(spans, spans[1:]):
            if next_start < end and (obj or next_obj):
                raise pickle.UnpicklingError("dtype field overlaps an object field")
    elif dtype.subdtype is not None:
        base, shape = dtype.subdtype
        check_dtype(base, depth + 1)
        if base.itemsize * math.prod(shape) != dtype.itemsize or base.hasobject != dtype.hasobject:
            raise pickle.UnpicklingError("dtype sub-array disagrees with its size")
    elif (dtype.kind == "O") != dtype.hasobject or (dtype.kind == "O" and dtype.itemsize != _OBJECT_ITEMSIZE):
        raise pickle.UnpicklingError("dtype object flag disagrees with its kind")


class _Pending:
    """Stands in for an array or dtype until its pickled state has been checked.

    numpy's ``__setstate__`` trusts what it is given (an object array's item
    list may be shorter than its shape, a dtype's field offsets anything), so
    the loader hands the pickle one of these instead; its ``__setstate__``
    checks the state and only then lets numpy apply it. After loading, every
    reference to it is replaced by the real object.
    """

    __slots__ = ("value", "ready", "checked")
    __hash__ = None  # type: ignore[assignment]  # never a dict key or set member: it could not be replaced there

    def __init__(self, value: Any) -> None:
        self.value = value
        self.ready = False
        self.checked = False

    def __setstate__(self, state: Any) -> None:
        if self.ready:
            raise pickle.UnpicklingError("numpy state applied twice")
        if isinstance(self.value, np.dtype):
            # a structured or sub-array dtype's state holds other dtypes, pending themselves
            nested = not (type(state) is tuple and len(state) > 4 and state[2] is None and state[4] is None)
            self.value.__setstate__(_replace_pending(state, set()) if nested else state)
        else:
            self.value.__setstate__(_checked_array_state(state))
        self.ready = True

    def result(self) -> Any:
        if isinstance(self.value, np.dtype):
            if not self.checked:  # also when no state was ever applied
                check_dtype(self.value)
                self.checked = True
        elif not self.ready:
            raise pickle.UnpicklingError("numpy array without its state")
        return self.value


def _real(value: Any) -> Any:
    return value.result() if type(value) is _Pending else value


def _checked_array_state(state: Any) -> tuple[Any, ...]:
    """numpy's ndarray state, validated: the dtype sound, the data exactly as long as the shape says."""
    if not isinstance(state, tuple) or len(state) not in (4, 5):
        raise pickle.UnpicklingError("bad numpy array state")
    if len(state) == 5:
        if state[0] != 1:
            raise pickle.UnpicklingError(f"numpy array state version {state[0]!r}")
        state = state[1:]
    shape, dtype, fortran, data = state
    dtype = _real(dtype)  # checked on the way out of its stand-in
    if not isinstance(dtype, np.dtype):
        raise pickle.UnpicklingError("numpy array state without a dtype")
    count = _nbytes(shape, _BYTE)
    if dtype.hasobject:
        if type(data) is not list or len(data) != count:
            raise pickle.UnpicklingError("numpy object array state does not hold one item per element")
        data = [_replace_pending(item, set()) for item in data]
    elif not isinstance(data, (bytes, bytearray)) or len(data) != count * dtype.itemsize:
        raise pickle.UnpicklingError("numpy array state data does not match its shape and dtype")
    return (1, shape, dtype, bool(fortran), data)


def _replace_pending(value: Any, seen: set[int]) -> Any:
    """``value`` with every :class:`_Pending` in it replaced by its real object."""
    kind = type(value)
    if kind is _Pending:
        return value.result()
    if kind is tuple:
        items = [_replace_pending(v, seen) for v in value]
        return tuple(items) if any(a is not b for a, b in zip(items, value)) else value
    if kind in (list, dict, collections.OrderedDict) and id(value) not in seen:
        seen.add(id(value))
        pairs = enumerate(value) if kind is list else list(value.items())
        for key, item in pairs:
            real = _replace_pending(item, seen)
            if real is not item:
                value[key] = real
    return value


def _nbytes(shape: Any, dtype: Any) -> int:
    dims = shape if isinstance(shape, tuple) else (shape,)
    if not all(isinstance(d, int) and d >= 0 for d in dims):
        raise pickle.UnpicklingError(f"bad array shape {shape!r}")
    return math.prod(dims) * np.dtype(dtype).itemsize


#: The globals a pickle of plain data names, as (module, name). numpy 1 pickles
#: say ``numpy.core``, numpy 2 pickles ``numpy._core``; both are accepted.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("builtins", n) for n in _BUILTIN_NAMES} | set(_CONSTANTS)
    | {("collections", "OrderedDict"), ("_codecs", "encode"), ("numpy", "ndarray"), ("numpy", "dtype")}
    | {("datetime", t.__name__) for t in _DATETIME_TYPES}
    | {(f"{p}.multiarray", n) for p in ("numpy.core", "numpy._core") for n in ("_reconstruct", "scalar")}
    | {(f"{p}.numeric", "_frombuffer") for p in ("numpy.core", "numpy._core")}
)


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only :data:`ALLOWED_GLOBALS`, and charges every call the pickle
    makes against a budget proportional to the pickle's size.

    Without the budget a tiny pickle could still exhaust memory through the
    allowed constructors: ``bytes(10**12)``, ``list(range(10**12))``, or
    ``list(x)`` over one memoised large object repeated a thousand times.
    """

    def __init__(self, data: bytes | memoryview, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where
        self._budget = 16 * len(data) + (1 << 20)
        self._resolved: dict[tuple[str, str], Any] = {}

    def _charge(self, cost: int) -> None:
        self._budget -= cost
        if self._budget < 0:
            raise AtlasFormatError(
                f"{self._where}: pickle builds far more data than it holds (corrupt, or hostile)")

    def _charged(self, func: Callable[..., Any], counts_ints: bool = False) -> Callable[..., Any]:
        """``func`` behind a toll: each argument costs 8 bytes per item it holds
        (ints cost their value where ``func`` allocates that many bytes)."""
        def call(*args: Any) -> Any:
            for arg in args:
                if isinstance(arg, int) and not isinstance(arg, bool):
                    self._charge(max(arg, 0) if counts_ints else 8)
                else:
                    try:
                        self._charge(8 * len(arg) + 8)
                    except (TypeError, OverflowError):
                        self._charge(8)
            return func(*args)
        return call

    def _reconstruct(self, cls: Any, shape: Any, dtype: Any) -> Any:
        if cls is not _NDARRAY:
            raise pickle.UnpicklingError("numpy _reconstruct of a class other than numpy.ndarray")
        self._charge(_nbytes(shape, dtype))
        self._pending = True
        return _Pending(_multiarray._reconstruct(np.ndarray, shape, dtype))

    def _dtype(self, *args: Any) -> Any:
        self._pending = True
        return _Pending(np.dtype(*args))

    def _with_real_dtype(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """``func(x, dtype, ...)`` with a checked dtype as its second argument."""
        def call(first: Any, dtype: Any, *rest: Any) -> Any:
            dtype = _real(dtype)  # checked on the way out of its stand-in
            if not isinstance(dtype, np.dtype):
                raise pickle.UnpicklingError("numpy call without a dtype")
            return func(first, dtype, *rest)
        return call

    def load(self) -> Any:
        self._pending = False
        try:
            value = super().load()
        finally:
            # The resolved globals are bound methods and closures of this unpickler,
            # a reference cycle through its memo (every object of the block) and its
            # input (the whole pickle). Left to the cycle collector, which the daemon
            # runs seldom, a listing kept every block it decoded (docs/performance.md).
            self._resolved.clear()
            self.memo.clear()
        return _replace_pending(value, set()) if self._pending else value

    def _resolve(self, module: str, name: str) -> Any:
        if (module, name) in _CONSTANTS:
            return _CONSTANTS[(module, name)]
        if module == "builtins":
            return self._charged(getattr(builtins, name), counts_ints=name in ("bytes", "bytearray"))
        if (module, name) == ("numpy", "ndarray"):
            return _NDARRAY
        if (module, name) == ("numpy", "dtype"):
            return self._charged(self._dtype)
        if name == "_reconstruct":
            return self._reconstruct
        if name == "scalar":  # scalar(dtype, data)
            return self._charged(lambda dtype, *rest: self._with_real_dtype(
                lambda _, d, *r: _multiarray.scalar(d, *r))(None, dtype, *rest))
        if name == "_frombuffer":  # _frombuffer(buffer, dtype, shape, order)
            return self._charged(self._with_real_dtype(_frombuffer))
        if (module, name) == ("_codecs", "encode"):
            return self._charged(_latin1_encode)
        if module == "collections":
            return self._charged(collections.OrderedDict)
        return self._charged(getattr(datetime, name))

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 0-2 pickles name Python 2 modules (__builtin__, copy_reg...);
        # map them as pickle's own find_class does.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        else:
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) not in ALLOWED_GLOBALS:
            qualified = f"{module}.{name}"
            raise UnsafePickleError(
                f"{self._where}: pickle refers to global '{qualified}', which untrusted data may not use"
                " (use --trust-pickle / trust_pickle=True only if you trust this dataset)",
                qualified,
            )
        if (module, name) not in self._resolved:
            self._resolved[(module, name)] = self._resolve(module, name)
        return self._resolved[(module, name)]


def loads(data: bytes | memoryview, *, trust: bool, where: str) -> Any:
    """Unpickle ``data``; with ``trust=False`` only :data:`ALLOWED_GLOBALS` may load,
    and only as much as the pickle's size justifies.

    ``where`` names the data (file and block) in error messages. Any failure
    is an :class:`AtlasFormatError` (an :class:`UnsafePickleError` for a
    refused global); nothing else escapes.
    """
    load: Callable[[], Any]
    if trust:
        load = lambda: pickle.loads(data)  # noqa: E731
    else:
        load = _RestrictedUnpickler(data, where).load
    try:
        return load()
    except AtlasFormatError:
        raise
    except RecursionError:
        raise AtlasFormatError(f"{where}: pickle nests too deeply to load") from None
    except Exception as exc:  # a corrupt pickle can raise almost any type
        raise AtlasFormatError(f"{where}: not a valid pickle ({type(exc).__name__}: {exc})") from None
