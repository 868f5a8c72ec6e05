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

import collections
import datetime
import io
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


def _numpy_globals() -> dict[tuple[str, str], Any]:
    found: dict[tuple[str, str], Any] = {}
    for package in ("numpy.core", "numpy._core"):
        found[(f"{package}.multiarray", "_reconstruct")] = _multiarray._reconstruct
        found[(f"{package}.multiarray", "scalar")] = _multiarray.scalar
        found[(f"{package}.numeric", "_frombuffer")] = _numeric._frombuffer
    found[("numpy", "ndarray")] = np.ndarray
    found[("numpy", "dtype")] = np.dtype
    return found


_BUILTIN_NAMES = (
    "dict list tuple set frozenset bytearray bytes str int float complex bool "
    "slice range Ellipsis NotImplemented"
).split()

#: (module, name) -> the object the safe loader hands out for it.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{("builtins", name): getattr(__import__("builtins"), name) for name in _BUILTIN_NAMES},
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{("datetime", cls.__name__): cls for cls in (
        datetime.date, datetime.time, datetime.datetime, datetime.timedelta, datetime.timezone)},
    ("_codecs", "encode"): _latin1_encode,
    **_numpy_globals(),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes | memoryview, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            qualified = f"{module}.{name}"
            raise UnsafePickleError(
                f"{self._where}: pickle refers to global '{qualified}', which untrusted data may not use"
                " (use --trust-pickle / trust_pickle=True only if you trust this dataset)",
                qualified,
            ) from None


def loads(data: bytes | memoryview, *, trust: bool, where: str) -> Any:
    """Unpickle ``data``; with ``trust=False`` only :data:`ALLOWED_GLOBALS` may load.

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
