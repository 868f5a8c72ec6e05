"""The safe unpickler: hostile pickles never run, plain data always loads.

Every hostile payload here would create a marker file if it ran (the
``*_when_trusted`` tests prove that they do). Under the default loader each
must raise UnsafePickleError naming the global as pickled and pointing at
--trust-pickle, directly and through a real dataset, and leave no marker.
"""

from __future__ import annotations

import _compat_pickle
import builtins
import collections
import datetime
import functools
import importlib
import operator
import os
import pickle
import pickletools
import posix
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from atlasfs import AtlasDataset, AtlasFormatError, AtlasWriter, UnsafePickleError
from atlasfs.formats import safepickle
from helpers import REFERENCE, deep_equal, expected_examples

WHERE = "/data/set/0/data.bin block 3"
PROTOCOLS = list(range(pickle.HIGHEST_PROTOCOL + 1))


class Call:
    """Pickles as ``func(*args)``. Callable, so that it can itself be the ``func``
    of another Call (pickle insists on a callable there)."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)

    def __call__(self, *args: Any) -> Any:
        raise AssertionError("a Call is only ever pickled")


@functools.total_ordering
class Point:
    """A harmless custom class: the default loader refuses it, trust_pickle loads it."""

    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)

    def __lt__(self, other: "Point") -> bool:
        return (self.x, self.y) < (other.x, other.y)


def qualified(func: Any) -> str:
    """The global's name as pickle writes it (``posix.system`` for ``os.system``...)."""
    line = pickle.dumps(func, protocol=0, fix_imports=False).split(b"\n")
    assert line[0].startswith(b"c")
    return f"{line[0][1:].decode()}.{line[1].decode()}"


def first_global(data: bytes) -> str:
    """The first global a pickle names, read with pickletools, with Python 2 names
    mapped as unpickling maps them (protocols 0-2 write ``__builtin__``...)."""
    strings: list[str] = []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name in ("GLOBAL", "INST"):
            module, name = arg.split(" ", 1)
            break
        if opcode.name == "STACK_GLOBAL":
            module, name = strings[-2:]
            break
        if isinstance(arg, str):
            strings.append(arg)
    else:
        raise AssertionError("no global in the pickle")
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


def touch(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


#: name -> (marker -> (payload, the first global the pickle names))
PAYLOADS: dict[str, Callable[[Path], tuple[Any, Any]]] = {
    "os.system": lambda m: (Call(os.system, touch(m)), os.system),
    "posix.system": lambda m: (Call(posix.system, touch(m)), posix.system),
    "os.popen": lambda m: (Call(os.popen, touch(m)), os.popen),
    "eval": lambda m: (Call(builtins.eval, f"open({str(m)!r}, 'w').close()"), builtins.eval),
    "exec": lambda m: (Call(builtins.exec, f"open({str(m)!r}, 'w').close()"), builtins.exec),
    "open": lambda m: (Call(builtins.open, str(m), "w"), builtins.open),
    "subprocess.Popen": lambda m: (Call(subprocess.Popen, ["touch", str(m)]), subprocess.Popen),
    "subprocess.check_call": lambda m: (Call(subprocess.check_call, ["touch", str(m)]), subprocess.check_call),
    "getattr(__import__('os'), 'system')": lambda m: (
        Call(Call(builtins.getattr, Call(builtins.__import__, "os"), "system"), touch(m)), builtins.getattr),
    "__import__": lambda m: (Call(builtins.__import__, "os"), builtins.__import__),
    "importlib.import_module": lambda m: (Call(importlib.import_module, "os"), importlib.import_module),
    "nested pickle.loads": lambda m: (Call(pickle.loads, pickle.dumps(Call(os.system, touch(m)))), pickle.loads),
    "functools.partial": lambda m: (Call(functools.partial(os.system, touch(m))), functools.partial),
    "operator.methodcaller": lambda m: (
        Call(operator.methodcaller("system", touch(m)), Call(builtins.__import__, "os")), operator.methodcaller),
    "numpy.load": lambda m: (Call(np.load, str(m) + ".npy", None, True), np.load),
    "deep inside plain data": lambda m: (
        {"ok": [1, 2.5, ("t", {"deeper": [Call(os.system, touch(m))]})]}, os.system),
    "custom class": lambda m: (Point(1, 2), Point),
}
#: payloads that do something when loaded with trust (the proof that they are real)
RUN_WHEN_TRUSTED = ["os.system", "posix.system", "os.popen", "eval", "exec", "open", "subprocess.Popen",
                    "subprocess.check_call", "getattr(__import__('os'), 'system')", "nested pickle.loads",
                    "functools.partial", "operator.methodcaller", "deep inside plain data"]


def assert_refused(data: bytes, global_name: str, where: str = WHERE) -> UnsafePickleError:
    with pytest.raises(UnsafePickleError) as info:
        safepickle.loads(data, trust=False, where=where)
    error = info.value
    assert isinstance(error, AtlasFormatError)
    assert error.global_name == global_name
    message = str(error)
    assert message.startswith(where), message
    assert f"'{global_name}'" in message and "--trust-pickle" in message, message
    assert "\n" not in message
    return error


# ---------------------------------------------------------------- hostile pickles, directly


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", list(PAYLOADS))
def test_hostile_pickle_is_refused(tmp_path: Path, name: str, protocol: int) -> None:
    marker = tmp_path / "MARKER"
    payload, func = PAYLOADS[name](marker)
    data = pickle.dumps(payload, protocol=protocol)
    assert_refused(data, first_global(data))
    if protocol >= 3:  # protocols 0-2 may name another module (pickle for _pickle) or copyreg first
        assert first_global(data) == qualified(func)
    assert not marker.exists()


@pytest.mark.parametrize("name", RUN_WHEN_TRUSTED)
def test_payloads_run_when_trusted(tmp_path: Path, name: str) -> None:
    # the control: with trust the same bytes really do create the marker
    marker = tmp_path / "MARKER"
    payload, _ = PAYLOADS[name](marker)
    result = safepickle.loads(pickle.dumps(payload, protocol=4), trust=True, where=WHERE)
    if isinstance(result, subprocess.Popen):
        result.wait()
    elif hasattr(result, "close"):
        result.close()  # os.popen's pipe
    assert marker.exists()


def p4_global(module: str, name: str) -> bytes:
    """Protocol 4 opcodes pushing the global ``module.name`` (STACK_GLOBAL)."""
    out = b""
    for text in (module, name):
        raw = text.encode()
        out += pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw
    return out + pickle.STACK_GLOBAL


HANDWRITTEN = [
    # (pickle bytes, the global as reported: Python 2 names are mapped as pickle maps them)
    pytest.param(b"(S'touch MARKER'\nios\nsystem\n.", "os.system", id="INST-opcode"),
    pytest.param(b"(cos\nsystem\nS'touch MARKER'\no.", "os.system", id="OBJ-opcode"),
    pytest.param(b"cposix\nsystem\n(S'touch MARKER'\ntR.", "posix.system", id="GLOBAL-posix"),
    pytest.param(b"cnt\nsystem\n(S'touch MARKER'\ntR.", "nt.system", id="GLOBAL-nt"),
    pytest.param(b"c__builtin__\neval\n(S'1'\ntR.", "builtins.eval", id="python2-builtin"),
    pytest.param(b"cbuiltins\ngetattr\n(cbuiltins\ndict\nS'fromkeys'\ntR.", "builtins.getattr", id="getattr"),
    pytest.param(b"ccopy_reg\n_reconstructor\n.", "copyreg._reconstructor", id="copy_reg"),
    pytest.param(b"csubprocess\ncall\n(S'true'\ntR.", "subprocess.call", id="subprocess-call"),
    *[pytest.param(b"\x80\x04" + p4_global(m, n) + b".", f"{m}.{n}", id=f"dotted-{m}.{n}") for m, n in [
        ("builtins", "dict.fromkeys"), ("builtins", "object.__subclasses__"), ("builtins", "str.format"),
        ("collections", "OrderedDict.__init__"), ("numpy", "ndarray.__setstate__"), ("numpy", "dtype.__new__"),
        ("datetime", "datetime.now"), ("builtins", "__import__"), ("builtins", "breakpoint"),
        ("builtins", "type"), ("builtins", "object"), ("builtins", "memoryview"), ("numpy", "frombuffer"),
        ("numpy._core.multiarray", "fromstring"), ("numpy.core.multiarray", "_reconstruct.__globals__"),
    ]],
]


@pytest.mark.parametrize(("data", "global_name"), HANDWRITTEN)
def test_handwritten_hostile_pickle_is_refused(data: bytes, global_name: str) -> None:
    assert_refused(data, global_name)


@pytest.mark.parametrize("data", [
    pytest.param(b"\x80\x02\x82\x01.", id="EXT1"),
    pytest.param(b"\x80\x02\x83\x01\x00.", id="EXT2"),
    pytest.param(b"Pfoo\n.", id="PERSID"),
    pytest.param(b"\x80\x02X\x03\x00\x00\x00fooQ.", id="BINPERSID"),
    pytest.param(b"\x80\x05\x97.", id="NEXT_BUFFER"),
])
def test_opcodes_that_reach_outside_the_pickle_fail(data: bytes) -> None:
    with pytest.raises(AtlasFormatError, match="not a valid pickle") as info:
        safepickle.loads(data, trust=False, where=WHERE)
    assert not isinstance(info.value, UnsafePickleError)


# ---------------------------------------------------------------- hostile pickles, through a dataset


def write_dataset(root: Path, examples: list[Any], strategy: int) -> Path:
    with AtlasWriter(root, shard_size=100, block_size=3, compression_strategy=strategy) as w:
        w.add_examples(examples)
    return root


@pytest.mark.parametrize("strategy", [0, 1])
@pytest.mark.parametrize("name", ["os.system", "eval", "subprocess.Popen", "getattr(__import__('os'), 'system')",
                                  "functools.partial", "deep inside plain data"])
def test_hostile_example_in_a_dataset_is_refused(tmp_path: Path, strategy: int, name: str) -> None:
    marker = tmp_path / "MARKER"
    payload, func = PAYLOADS[name](marker)
    root = write_dataset(tmp_path / "ds", ["before", 1, 2, 3, payload, 5, "after"], strategy)
    ds = AtlasDataset(root)
    data_bin = str(root / "0" / "data.bin")
    assert ds[0] == "before" and ds[6] == "after"  # other blocks are fine
    for read in (lambda: ds[3], lambda: ds[4], lambda: list(ds)):
        with pytest.raises(UnsafePickleError) as info:
            read()
        message = str(info.value)
        assert message.startswith(f"{data_bin} block 1"), message
        assert f"'{qualified(func)}'" in message and "--trust-pickle" in message, message
    assert not marker.exists()


@pytest.mark.parametrize("strategy", [0, 1])
def test_trust_pickle_loads_a_custom_object_the_default_refuses(tmp_path: Path, strategy: int) -> None:
    examples = [Point(1, 2), {"p": Point(3, 4)}, "plain"]
    root = write_dataset(tmp_path / "ds", examples, strategy)
    with pytest.raises(UnsafePickleError) as info:
        AtlasDataset(root)[0]
    assert info.value.global_name == qualified(Point)
    assert "--trust-pickle" in str(info.value) and str(root / "0" / "data.bin") in str(info.value)
    assert list(AtlasDataset(root, trust_pickle=True)) == examples


def test_trust_loads_directly() -> None:
    data = pickle.dumps([Point(5, 6)], protocol=5)
    assert safepickle.loads(data, trust=True, where=WHERE) == [Point(5, 6)]
    assert_refused(data, qualified(Point))


# ---------------------------------------------------------------- _codecs.encode: latin-1 only


@pytest.mark.parametrize("codec", ["zlib_codec", "zlib", "bz2_codec", "base64_codec", "hex_codec", "rot13",
                                   "utf-8", "utf-16", "idna", "unicode_escape"])
def test_codecs_encode_with_another_codec_is_refused(codec: str) -> None:
    text_pickle = b"c_codecs\nencode\n(Vabc\nV" + codec.encode() + b"\ntR."
    binary_pickle = pickle.dumps(Call(__import__("codecs").encode, "abc", codec), protocol=2)
    assert b"_codecs" in binary_pickle
    for data in (text_pickle, binary_pickle):
        with pytest.raises(AtlasFormatError) as info:
            safepickle.loads(data, trust=False, where=WHERE)
        assert not isinstance(info.value, UnsafePickleError)
        assert codec in str(info.value) and "latin-1" in str(info.value) and str(info.value).startswith(WHERE)


@pytest.mark.parametrize("data", [
    pytest.param(b"c_codecs\nencode\n(I12\nVlatin1\ntR.", id="int-argument"),
    pytest.param(b"c_codecs\nencode\n(Vabc\nI1\ntR.", id="int-encoding"),
    pytest.param(b"c_codecs\nencode\n(V\\u0100\nVlatin1\ntR.", id="not-latin1-text"),
])
def test_codecs_encode_with_bad_arguments_fails_cleanly(data: bytes) -> None:
    with pytest.raises(AtlasFormatError, match="not a valid pickle"):
        safepickle.loads(data, trust=False, where=WHERE)


@pytest.mark.parametrize("protocol", [0, 1, 2])
def test_bytes_in_old_protocols_load(protocol: int) -> None:
    # protocols 0-2 write bytes as _codecs.encode(text, 'latin1')
    value = [b"\x00\xff\x80 bytes", b"", bytearray(b"\xfe")]
    data = pickle.dumps(value, protocol=protocol)
    assert b"_codecs" in data and b"latin1" in data
    assert safepickle.loads(data, trust=False, where=WHERE) == value


# ---------------------------------------------------------------- not a pickle at all


@pytest.mark.parametrize("data", [
    pytest.param(b"", id="empty"),
    pytest.param(b"garbage", id="garbage"),
    pytest.param(b"\x00\x01\x02\x03", id="binary"),
    pytest.param(bytes(range(256)) * 4, id="all-bytes"),
    pytest.param(b"\x80\x05\x95\xff\xff\xff\xff\xff\xff\xff\x7f", id="frame-claiming-huge"),
    pytest.param(b"\x80\x04B\xff\xff\xff\x7fabc", id="binbytes-claiming-2GB"),
    pytest.param(pickle.dumps({"a": [1, 2, 3]}, protocol=4)[:-1], id="no-stop"),
    pytest.param(pickle.dumps(list(range(100)), protocol=2)[:40], id="cut"),
    pytest.param(b"\x80\x09.", id="unknown-protocol"),
    pytest.param(b"\x80\x02h\x05.", id="memo-miss"),
    pytest.param(b"\x80\x02t.", id="no-mark"),
    pytest.param(b"\x80\x02R.", id="reduce-on-empty-stack"),
    pytest.param(b"\x80\x02)K\x01b.", id="build-on-a-tuple"),
    pytest.param(b"\x80\x02]K\x01K\x02s.", id="setitem-on-a-list"),
    pytest.param(b"\x80\x04" + p4_global("builtins", "int") + b"(X\x03\x00\x00\x00abctR.", id="int-of-text"),
])
def test_garbage_is_not_a_valid_pickle(data: bytes) -> None:
    with pytest.raises(AtlasFormatError) as info:
        safepickle.loads(data, trust=False, where=WHERE)
    assert str(info.value).startswith(f"{WHERE}: not a valid pickle"), str(info.value)
    assert "\n" not in str(info.value)


def test_garbage_is_not_a_valid_pickle_when_trusted_either() -> None:
    with pytest.raises(AtlasFormatError, match="not a valid pickle"):
        safepickle.loads(b"garbage", trust=True, where=WHERE)


# ---------------------------------------------------------------- plain data loads by default


def same(loaded: Any, original: Any) -> bool:
    """deep_equal, plus what pickle itself changes: big-endian arrays come back native
    before protocol 5, and structured arrays with object fields compare by value."""
    if isinstance(original, np.ndarray) and isinstance(loaded, np.ndarray):
        if original.dtype.byteorder == ">" and loaded.dtype.byteorder != ">":
            return loaded.dtype == original.dtype.newbyteorder("=") and bool(np.array_equal(loaded, original))
        if original.dtype.kind == "V":
            return (loaded.dtype == original.dtype and loaded.shape == original.shape
                    and (loaded.tolist() == original.tolist() if original.dtype.hasobject
                         else loaded.tobytes() == original.tobytes()))
    return deep_equal(loaded, original)


PLAIN: dict[str, Any] = {
    "none-bools": [None, True, False],
    "ints": [0, -1, 2**63, -2**100, 10**50],
    "floats": [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 5e-324, 1.7976931348623157e308],
    "complex": [complex(1, -2), complex(float("nan"), 0.0)],
    "str": ["", "ascii", "ünïcødé €", "\x00\n", "x" * 100_000],
    "bytes": [b"", b"\x00\xff" * 1000],
    "bytearray": bytearray(b"\x00\xff mutable"),
    "tuple-list": ((), (1,), [[], [()]], (1, [2, (3, [4])])),
    "dict-non-str-keys": {1: "a", 2.5: "b", (1, 2): "c", None: "d", b"k": "e", frozenset({1}): "f"},
    "set-frozenset": [{1, "a", (2, 3)}, frozenset({b"x", 2.5}), set(), frozenset()],
    "ordereddict": collections.OrderedDict([("b", 1), ("a", [2, 3])]),
    "datetime": [datetime.date(2024, 2, 29), datetime.time(23, 59, 59, 999999, fold=1),
                 datetime.datetime(2024, 2, 29, 12, 30, 1, 5),
                 datetime.datetime(1, 1, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=-3), "X")),
                 datetime.timedelta(days=-1, microseconds=3), datetime.timezone.utc],
    "slice-range-ellipsis": [slice(1, None, -2), range(0, 10**12, 7), ...],
    "keyed-dict": {"__key__": "images/000", "jpg": b"\xff\xd8\xff", "cls": 3, "json": {"a": [1, None]}},
    # numpy arrays
    "uint8-hwc": np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3),
    "floats16-32-64": [np.array([1.5, np.nan, -np.inf], dtype=t) for t in (np.float16, np.float32, np.float64)],
    "ints-all": [np.array([0, 1, np.iinfo(t).max, np.iinfo(t).min], dtype=t)
                 for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)],
    "bool-array": np.array([True, False, True]),
    "complex-arrays": [np.array([1 - 2j], np.complex64), np.array([np.nan + 1j], np.complex128)],
    "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    "big-endian": np.arange(5, dtype=">i4"),
    "zero-d": np.array(3.5),
    "empty-0x3": np.zeros((0, 3), np.uint16),
    "unicode-bytes-arrays": [np.array(["a", "bcdé"]), np.array([b"a", b"bc"])],
    "structured": np.array([(1, (2.0, 3.0), b"ab")], dtype=[("a", "<i4"), ("b", "<f8", (2,)), ("c", "S2")]),
    "datetime64": [np.array(["2020-01-01", "NaT"], dtype="M8[D]"), np.array([1, -2], dtype="m8[ns]")],
    "object-array": np.array([1, "x", None, (1, 2), b"y", [3]], dtype=object),
    "object-2d": np.array([[1, "a"], [None, 2.5]], dtype=object),
    "structured-with-object": np.array([(1, "x"), (2, None)], dtype=[("a", "i8"), ("b", "O")]),
    "non-contiguous": np.arange(20)[::3],
    "transposed": np.arange(24).reshape(2, 3, 4).transpose(2, 0, 1),
    "big": np.arange(300_000, dtype=np.int32),  # above numpy's 1000-byte copy threshold
    # numpy scalars and dtypes
    "scalars": [np.float64(1.5), np.float32(-0.0), np.float16(2), np.int8(-3), np.uint64(2**64 - 1), np.bool_(True),
                np.complex64(1 - 2j), np.str_("xé"), np.bytes_(b"xy"), np.datetime64("2020-01-01T00:00:00.123"),
                np.timedelta64(-5, "D"), np.datetime64("NaT"), np.longdouble(1.25)],
    "void-scalar": np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")])[0],
    "dtypes": [np.dtype("<f4"), np.dtype(">u2"), np.dtype([("a", "<i4"), ("b", "<f8", (2,))]), np.dtype("M8[ms]"),
               np.dtype("U7"), np.dtype(object)],
}


def check_plain(loaded: Any, value: Any) -> None:
    """``loaded`` is ``value`` (a PLAIN entry; lists of numpy objects compared item by item)."""
    if isinstance(value, list) and value and isinstance(value[0], (np.ndarray, np.generic, np.dtype)):
        assert type(loaded) is list and len(loaded) == len(value)
        for got, want in zip(loaded, value):
            assert same(got, want), (got, want)
    else:
        assert same(loaded, value), (loaded, value)


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("name", list(PLAIN))
def test_plain_data_loads(name: str, protocol: int) -> None:
    value = PLAIN[name]
    check_plain(safepickle.loads(pickle.dumps(value, protocol=protocol), trust=False, where=WHERE), value)


@pytest.mark.parametrize("protocol", [0, 1, 3])
def test_plain_data_loads_in_the_other_protocols(protocol: int) -> None:
    loaded = safepickle.loads(pickle.dumps(PLAIN, protocol=protocol), trust=False, where=WHERE)
    assert list(loaded) == list(PLAIN)
    for name, value in PLAIN.items():
        check_plain(loaded[name], value)


@pytest.mark.parametrize("strategy", [0, 1])
def test_plain_data_through_a_dataset(tmp_path: Path, strategy: int) -> None:
    root = write_dataset(tmp_path / "ds", list(PLAIN.values()), strategy)
    for got, want in zip(AtlasDataset(root), PLAIN.values()):  # the default, untrusted loader
        check_plain(got, want)


def test_fortran_order_survives() -> None:
    for protocol in (2, 4, 5):
        loaded = safepickle.loads(pickle.dumps(PLAIN["fortran"], protocol=protocol), trust=False, where=WHERE)
        assert loaded.flags.f_contiguous and not loaded.flags.c_contiguous


def test_protocol_5_arrays_take_the_frombuffer_path() -> None:
    for array in (np.arange(10.0), np.asfortranarray(np.ones((3, 4))), PLAIN["transposed"]):
        data = pickle.dumps(array, protocol=5)
        assert b"_frombuffer" in data
        loaded = safepickle.loads(data, trust=False, where=WHERE)
        assert loaded.dtype == array.dtype and np.array_equal(loaded, array)


def test_shared_and_cyclic_references_are_kept() -> None:
    shared = [1, 2]
    cyclic: list[Any] = ["self"]
    cyclic.append(cyclic)
    loaded = safepickle.loads(pickle.dumps([shared, shared, cyclic], protocol=4), trust=False, where=WHERE)
    assert loaded[0] is loaded[1] and loaded[0] == [1, 2]
    assert loaded[2][1] is loaded[2]


def test_legacy_numpy1_fixture_loads_under_the_default() -> None:
    root = REFERENCE / "legacy_numpy1_shared_dict" / "dataset"
    ds = AtlasDataset(root)
    shard = ds.shards[0]
    raw = shard.codec.decompress(shard.read_raw(0), "block 0")
    assert b"numpy.core.multiarray" in raw and b"numpy._core" not in raw  # written by numpy 1
    expected = expected_examples("legacy_numpy1_shared_dict")
    assert len(ds) == len(expected)
    for got, want in zip(ds, expected):
        assert deep_equal(got, want)


# ---------------------------------------------------------------- numpy reconstructors fed hostile state

_P = pickle


def _array_state(nbytes: int, fill: int, dtype_opcodes: bytes) -> bytes:
    """Opcodes for ndarray state ``(1, (nbytes,), <dtype>, False, bytes)``."""
    return (_P.MARK + _P.BININT1 + b"\x01" + _P.BININT + nbytes.to_bytes(4, "little") + _P.TUPLE1 + dtype_opcodes
            + _P.NEWFALSE + _P.BINBYTES + nbytes.to_bytes(4, "little") + bytes([fill]) * nbytes + _P.TUPLE)


def test_frombuffer_over_another_array_is_refused() -> None:
    # arr = _reconstruct(...); arr.__setstate__(64 bytes); view = _frombuffer(arr, ...);
    # arr.__setstate__(other bytes) would free the memory the view points to
    u1 = p4_global("numpy", "dtype") + _P.SHORT_BINUNICODE + b"\x02u1" + _P.NEWFALSE + _P.NEWTRUE + _P.TUPLE3 + _P.REDUCE
    data = (b"\x80\x04" + p4_global("numpy._core.multiarray", "_reconstruct") + p4_global("numpy", "ndarray")
            + _P.BININT1 + b"\x00" + _P.TUPLE1 + _P.SHORT_BINBYTES + b"\x01b" + _P.TUPLE3 + _P.REDUCE
            + _P.BINPUT + b"\x00" + _array_state(64, 0x41, u1) + _P.BUILD + _P.POP
            + p4_global("numpy._core.numeric", "_frombuffer") + _P.MARK + _P.BINGET + b"\x00" + u1
            + _P.BININT1 + b"\x40" + _P.TUPLE1 + _P.SHORT_BINUNICODE + b"\x01C" + _P.TUPLE + _P.REDUCE
            + _P.BINPUT + b"\x01" + _P.POP
            + _P.BINGET + b"\x00" + _array_state(100_000, 0x42, u1) + _P.BUILD + _P.POP
            + _P.BINGET + b"\x01" + _P.STOP)
    with pytest.raises(AtlasFormatError, match="_frombuffer over a (ndarray|_Pending)"):
        safepickle.loads(data, trust=False, where=WHERE)


_mam = importlib.import_module("numpy._core.multiarray")
_num = importlib.import_module("numpy._core.numeric")
_O = np.dtype(object)


@pytest.mark.parametrize("payload", [
    pytest.param(Call(_num._frombuffer, b"A" * 16, _O, (2,), "C"), id="frombuffer-object"),
    pytest.param(Call(_num._frombuffer, b"A" * 16, np.dtype([("a", "O"), ("b", "i8")]), (1,), "C"),
                 id="frombuffer-structured-object"),
    pytest.param(Call(_mam.scalar, np.dtype([("a", "O")]), b"A" * 8), id="scalar-structured-object"),
    pytest.param(Call(_mam.scalar, _O, b"A" * 8), id="scalar-object-from-bytes"),
    pytest.param(Call(np.dtype, {"names": ["a", "b"], "formats": ["O", "i8"], "offsets": [0, 0], "itemsize": 8}),
                 id="dtype-overlapping-object"),
    pytest.param(Call(_num._frombuffer, b"A" * 8, np.dtype("f8"), (10**6,), "C"), id="frombuffer-too-short"),
])
def test_numpy_refuses_pointers_from_raw_bytes(payload: Call) -> None:
    with pytest.raises(AtlasFormatError, match="not a valid pickle"):
        safepickle.loads(pickle.dumps(payload, protocol=2), trust=False, where=WHERE)


class ArrayState:
    """Pickles as ``_reconstruct(ndarray, (0,), b'b')`` with the given ndarray state."""

    def __init__(self, state: tuple[Any, ...]) -> None:
        self.state = state

    def __reduce__(self) -> tuple[Any, ...]:
        return (_mam._reconstruct, (np.ndarray, (0,), b"b"), self.state)


@pytest.mark.parametrize("state", [
    pytest.param((1, (2,), _O, False, b"A" * 16), id="object-from-bytes"),
    pytest.param((1, (10**6,), np.dtype("f8"), False, b"A" * 16), id="bytes-too-short"),
    pytest.param((1, (2**62, 2**62), np.dtype("f8"), False, b""), id="shape-overflow"),
    pytest.param((1, (-1,), np.dtype("f8"), False, b""), id="negative-shape"),
    pytest.param((7, (1,), np.dtype("f8"), False, b"\x00" * 8), id="version-7"),
])
def test_ndarray_state_errors_are_format_errors(state: tuple[Any, ...]) -> None:
    with pytest.raises(AtlasFormatError, match="not a valid pickle"):
        safepickle.loads(pickle.dumps(ArrayState(state), protocol=2), trust=False, where=WHERE)


_CRASH_PROBE = """
import pickle, sys
import numpy as np
from atlasfs import AtlasFormatError
from atlasfs.formats import safepickle
mam = __import__("numpy._core.multiarray", fromlist=["_reconstruct"])
class R:
    def __init__(self, *r): self.r = r
    def __reduce__(self): return self.r
case = sys.argv[1]
if case == "object-list-shorter-than-shape":
    payload = R(mam._reconstruct, (np.ndarray, (0,), b"b"), (1, (100000,), np.dtype("O"), False, [1, 2, 3]))
elif case == "structured-object-list-shorter-than-shape":
    payload = R(mam._reconstruct, (np.ndarray, (0,), b"b"), (1, (1000,), np.dtype([("a", "O")]), False, [(1,)]))
elif case == "dtype-field-far-outside-the-item":
    bad = R(np.dtype, ("V8", False, True), (3, "|", None, ("a",), {"a": (np.dtype("V64"), 1 << 20)}, 8, 1, 0))
    payload = R(mam._reconstruct, (np.ndarray, (0,), b"b"), (1, (4,), bad, False, b"A" * 32))
try:
    value = safepickle.loads(pickle.dumps(payload, protocol=2), trust=False, where="W")
    repr(value), value.tolist()  # what any consumer of the example does
except AtlasFormatError as exc:
    print("refused:", exc)
"""


@pytest.mark.parametrize("case", ["object-list-shorter-than-shape", "structured-object-list-shorter-than-shape",
                                  "dtype-field-far-outside-the-item"])
def test_numpy_state_that_would_crash_the_process_is_refused(case: str) -> None:
    # numpy's __setstate__ would apply these states unchecked and crash the interpreter
    # (SIGSEGV) or read outside the array; run apart so that a regression cannot take pytest down
    result = subprocess.run([sys.executable, "-c", _CRASH_PROBE, case], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "refused:" in result.stdout, (result.returncode, result.stdout, result.stderr)
