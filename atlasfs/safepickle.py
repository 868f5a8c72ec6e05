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

from .errors import AtlasFormatError, UnsafePickleError

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
        return _multiarray._reconstruct(np.ndarray, shape, dtype)

    def _resolve(self, module: str, name: str) -> Any:
        if (module, name) in _CONSTANTS:
            return _CONSTANTS[(module, name)]
        if module == "builtins":
            return self._charged(getattr(builtins, name), counts_ints=name in ("bytes", "bytearray"))
        if (module, name) == ("numpy", "ndarray"):
            return _NDARRAY
        if (module, name) == ("numpy", "dtype"):
            return np.dtype
        if name == "_reconstruct":
            return self._reconstruct
        if name == "scalar":
            return self._charged(_multiarray.scalar)
        if name == "_frombuffer":
            return self._charged(_frombuffer)
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
