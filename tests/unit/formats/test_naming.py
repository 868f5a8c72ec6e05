"""The naming contract (docs/layout.md), rule by rule, with literal expectations."""

from __future__ import annotations

import collections
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from webdataset.autodecode import Decoder, basichandlers

from atlasfs.formats.naming import (
    NO_KEY,
    KeyAssigner,
    canonical_pickle,
    encode_field,
    encode_value,
    example_files,
    field_suffix,
    index_key_width,
    json_exact,
    key_problem,
)
from helpers import deep_equal


def wds_decode(suffix: str, data: bytes) -> object:
    """What webdataset's default .decode() makes of one file."""
    return Decoder([basichandlers])({"__key__": "k", suffix.lower(): data})[suffix.lower()]


@pytest.mark.parametrize("name, value, suffix, data", [
    ("cls", 7, "cls", b"7"),
    ("label.cls", -3, "label.cls", b"-3"),
    ("id", 2**63, "id", b"9223372036854775808"),
    ("txt", "héllo", "txt", "héllo".encode()),
    ("caption.transcript", "x", "caption.transcript", b"x"),
    ("json", {"a": [1, 2.5, None, True]}, "json", b'{"a": [1, 2.5, null, true]}'),
    ("jsn", "s", "jsn", b'"s"'),
    ("jpg", b"\xff\xd8raw", "jpg", b"\xff\xd8raw"),
    ("UPPER.JPG", b"raw", "UPPER.JPG", b"raw"),
    ("anything.xyz", b"raw", "anything.xyz", b"raw"),
    ("image", b"raw", "image", b"raw"),
    ("txt", b"already bytes", "txt", b"already bytes"),
    ("name", "str", "name.txt", b"str"),
    ("count", 5, "count.cls", b"5"),
    ("flag", True, "flag.json", b"true"),
    ("score", 0.5, "score.json", b"0.5"),
    ("meta", {"a": 1}, "meta.json", b'{"a": 1}'),
    ("items", [1, "a"], "items.json", b'[1, "a"]'),
    ("cls", "not an int", "cls.txt", b"not an int"),
    ("cls", True, "cls.json", b"true"),
    ("json", (1, 2), "json.pickle", None),
    ("meta", {1: "int key"}, "meta.pickle", None),
    ("pair", (1, 2), "pair.pickle", None),
    ("none", None, "none.pickle", None),
    ("scalar", np.float32(1.5), "scalar.pickle", None),
    ("ordered", collections.OrderedDict(a=1), "ordered.pickle", None),
    ("blob", bytearray(b"x"), "blob.pickle", None),
    ("pkl", {"any": (1,)}, "pkl", None),
])
def test_field_encoding(name: str, value: object, suffix: str, data: bytes | None) -> None:
    got_suffix, got_data = encode_field(name, value)
    assert got_suffix == suffix
    if data is not None:
        assert got_data == data
    if suffix.endswith(("pickle", "pkl")):
        assert deep_equal(pickle.loads(got_data), value)


@pytest.mark.parametrize("value", [
    7, -2**100, "tëxt", b"\x00bytes", 1.5, -0.0, float("inf"), True, {"a": [1, {"b": None}]}, [1, 2],
    np.arange(6, dtype=np.int16).reshape(2, 3), np.zeros((0, 3)), np.array(3.5), np.asfortranarray(np.eye(2)),
    np.array(["ab", "c"]), np.array([(1, 2.0)], dtype=[("x", "i4"), ("y", "f8")]),
    np.array(["2020-01-01"], dtype="datetime64[D]"), (1, "t"), {1, 2}, frozenset({"a"}), 3 + 4j,
    bytearray(b"ab"), np.int64(5), collections.OrderedDict(b=2, a=1),
])
def test_values_come_back_from_webdataset_decode(value: object) -> None:
    for suffix, data in (encode_value(value), encode_field("field", value)):
        assert deep_equal(wds_decode(suffix, data), value), (suffix, value)


def test_npz_round_trip_and_determinism() -> None:
    arrays = {"a": np.arange(3), "b": np.ones((2, 2), dtype=np.float32)}
    suffix, data = encode_field("npz", arrays)
    assert suffix == "npz"
    assert encode_field("npz", arrays)[1] == data
    assert deep_equal(wds_decode("npz", data), arrays)


def test_none_is_the_documented_exception() -> None:
    # webdataset's decoder treats a None result as "not decoded" and returns the raw bytes.
    suffix, data = encode_value(None)
    assert suffix == "pickle" and pickle.loads(data) is None
    assert wds_decode(suffix, data) == data


def test_non_dict_examples_get_one_file_named_by_type() -> None:
    assert encode_value(b"raw") == ("bin", b"raw")
    assert encode_value("s") == ("txt", b"s")
    assert encode_value(3) == ("cls", b"3")
    assert encode_value(2.0)[0] == "json"
    assert encode_value([1, (2,)])[0] == "pickle"
    assert encode_value(np.array([object()], dtype=object))[0] == "pickle"
    assert example_files("s", 200) == ([("txt", b"s")], None)


def test_metadata_fields_are_hidden_and_files_sorted_by_bytes() -> None:
    files, note = example_files({"__key__": "k", "__url__": "u", "txt": "t", "Z": b"z", "a.jpg": b"j"}, 200)
    assert note is None
    assert [s for s, _ in files] == ["Z", "a.jpg", "txt"]


@pytest.mark.parametrize("example, reason", [
    ({"__key__": "k"}, "no field"),
    ({}, "no field"),
    ({0: "int name"}, "not a string"),
    ({"": "empty"}, "empty"),
    ({"with/slash": "x"}, "'/'"),
    ({"nul\x00": "x"}, "NUL"),
    ({"new\nline": "x"}, "control"),
    ({".hidden": "x"}, "starts with '.'"),
    ({"a": 1, "a.cls": 2}, "both be named"),
    ({"A.txt": "x", "a.txt": "y"}, "both be named"),
    ({"x" * 300: b"long"}, "too long"),
])
def test_unshowable_fields_make_the_whole_example_one_pickle(example: dict, reason: str) -> None:
    files, note = example_files(example, 200)
    assert note is not None and reason in note
    assert [s for s, _ in files] == ["pickle"]
    assert deep_equal(pickle.loads(files[0][1]), example)


@pytest.mark.parametrize("key, reason", [
    (12345, "not a string"), (b"bytes", "not a string"), ("", "empty component"), ("a//b", "empty component"),
    ("trailing/", "empty component"), ("/abs", "absolute"), ("../up", "'.'"), ("a/./b", "'.'"), ("a.b", "'.'"),
    ("dir.x/file", "'.'"), ("nul\x00", "control"), ("tab\t", "control"), ("__key__/x", "reserved"),
    ("__meta__", "reserved"), ("k" * 256, "longer than 255"), ("a/" * 600, "longer than 1024"),
    ("bad\udc80", "UTF-8"),
])
def test_unsafe_keys(key: object, reason: str) -> None:
    problem = key_problem(key, 3)
    assert problem is not None and reason in problem


@pytest.mark.parametrize("key", ["a", "images17/image194", "ünï/例子", "with space", "x-y_z", "__notmeta", "0042"])
def test_safe_keys(key: str) -> None:
    assert key_problem(key, 3) is None


def test_key_must_leave_room_for_the_longest_suffix() -> None:
    assert key_problem("k" * 250, 4) is None
    assert "too long" in key_problem("k" * 250, 5)


def test_key_assignment_falls_back_to_index_keys_and_never_collides() -> None:
    assigner = KeyAssigner(index_key_width(100))
    assert index_key_width(100) == 6 and index_key_width(10_000_001) == 8
    assert assigner.assign("a/b", 0, 3) == ("a/b", None)
    key, note = assigner.assign("a/b", 1, 3)
    assert key == "000001" and "already used" in note
    key, note = assigner.assign("000005", 2, 3)  # another example's index key: refused
    assert key == "000002" and "index key" in note
    assert assigner.assign("000003", 3, 3) == ("000003", None)  # its own: fine
    assert assigner.assign(NO_KEY, 5, 3) == ("000005", None)
    key, note = assigner.assign("../x", 6, 3)
    assert key == "000006" and "using index key 000006" in note


def test_canonical_pickle_is_the_same_in_every_process() -> None:
    value = {"s": {"alpha", "beta", "gamma", "delta"}, "f": frozenset({("x", 1), ("y", 2)}), "m": {1, "a"}}
    script = ("import sys; from atlasfs.formats.naming import canonical_pickle; "
              "v={'s': {'alpha','beta','gamma','delta'}, 'f': frozenset({('x',1),('y',2)}), 'm': {1,'a'}}; "
              "sys.stdout.buffer.write(canonical_pickle(v))")
    outputs = {subprocess.run([sys.executable, "-c", script], capture_output=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in range(5)}
    assert outputs == {canonical_pickle(value)}
    assert pickle.loads(canonical_pickle(value)) == value


def test_json_is_only_used_when_it_round_trips_exactly() -> None:
    for value in ({"a": (1,)}, [np.int64(1)], {"k": b"x"}, [collections.OrderedDict()]):
        assert encode_field("x", value)[0] == "x.pickle"
    nested = {"a": [{"b": [1.5, None, "s", False]}]}
    suffix, data = encode_field("x", nested)
    assert suffix == "x.json" and json.loads(data) == nested


def test_shared_references_cannot_blow_up_json() -> None:
    # 64 levels of a list holding the same list twice: a few hundred bytes as a
    # pickle, 2**64 elements as JSON. It must be pickled, and quickly.
    value: list = [1]
    for _ in range(64):
        value = [value, value]
    suffix, data = encode_field("meta", value)
    assert suffix == "meta.pickle" and len(data) < 10_000
    deep: list = []
    for _ in range(300):  # deeper than json_exact accepts, within pickle's reach
        deep = [deep]
    suffix, data = encode_field("x", deep)
    assert suffix == "x.pickle" and pickle.loads(data) == deep


_json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5) | st.binary(max_size=3)
    | st.tuples(st.integers()),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=3) | st.integers(), children, max_size=4),
    max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(_json_like)
def test_json_exact_is_a_json_round_trip(value: object) -> None:
    """json_exact (which decides .json or .pickle without encoding) says yes exactly
    when JSON gives the value back with its types."""
    try:
        back = json.loads(json.dumps(value))
        exact = deep_equal(back, value)
    except TypeError:  # not JSON at all (bytes, non-string keys are coerced, not refused)
        exact = False
    assert json_exact(value) == exact


def test_json_exact_budget_counts_strings_keys_and_items() -> None:
    text = {"key": "x" * 100, "n": [1.5] * 10}
    assert json_exact(text, budget=400)
    assert not json_exact(text, budget=150)
    assert not json_exact(["y" * 60, "y" * 60], budget=100)
    shared: list = [0.5]
    for _ in range(40):  # tiny as a pickle, 2**40 items as JSON
        shared = [shared, shared]
    assert not json_exact(shared)


# -- the quick paths give what the rules give

_KEY_CHARS = st.sampled_from(list("aZ09_-./_ é\x01") + ["__"])


@given(st.lists(_KEY_CHARS, max_size=12).map("".join), st.integers(0, 260))
@settings(max_examples=500)
def test_key_problem_quick_path_agrees_with_the_rules(key: str, longest: int) -> None:
    from atlasfs.formats.naming import _key_rules
    assert key_problem(key, longest) == _key_rules(key, longest)
    long_key = key * 40
    assert key_problem(long_key, longest) == _key_rules(long_key, longest)


@given(st.sampled_from(["txt", "text", "caption", "a.json", "b.pkl", "c.cls", "d.npy", "e.TXT", "f.jsn"]),
       st.one_of(st.text(max_size=20), st.text(alphabet="abc", max_size=20), st.integers(), st.binary(max_size=4)))
@settings(max_examples=500)
def test_field_suffix_quick_path_agrees_with_the_rules(name: str, value: object) -> None:
    from atlasfs.formats.naming import _suffix_rules
    assert field_suffix(name, value) == _suffix_rules(name, value)


# -- names shell tools would misread (issue #35, point 7): one rule, stated once

#: Names no tool may be handed as a file name: options to tar/xargs/rm, names tools trim or
#: split, a folder's own and parent's, separators, NUL and controls.
HOSTILE_NAMES = ["-rf", "-C..", "-C.. ", "-Ctmp", "--checkpoint-action=exec=sh", "-", "--", "name ", " name",
                 "name\u3000", "\u00a0name", "a\tb", "a\nb", "a\rb", "..", ".", "a/b", "/", "a\0b", "a\x85b", "",
                 "x" * 256]
#: Names that are fine, some close to the hostile ones.
FINE_NAMES = ["rf", "a-C..", "a b", "x-", "C..", "_-rf", "ünï", "例子", "x" * 255, "0042", "a.b.c", ".hidden"]


def _raw_table(path: str):
    """A table holding the file ``path`` (its folders before it), its columns made directly
    (no builder in between), saved and loaded: what a forged stored table gives."""
    from atlasfs.tree.table.filetable import FileTable
    from atlasfs.tree.table.layout import DIR, FILE
    parts = path.split("/")
    paths = ["/".join(parts[:k]) for k in range(1, len(parts))] + [path]
    kinds = [DIR] * (len(paths) - 1) + [FILE]
    encoded = [p.encode("utf-8", "surrogatepass") for p in paths]
    n = len(encoded)
    return FileTable(b"".join(encoded), np.cumsum([0] + [len(p) for p in encoded]).astype(np.uint64),
                     {"kind": np.array(kinds, np.uint8), "size": np.ones(n, np.uint64),
                      "block": np.zeros(n, np.uint32), "pos": np.zeros(n, np.uint32), "file": np.zeros(n, np.uint16),
                      "by_path": np.array(sorted(range(n), key=encoded.__getitem__), np.uint32)})


def _table_refuses(path: str, folder: str) -> str | None:
    """Why loading a stored table with the file ``path`` fails, or None if it loads."""
    from atlasfs.tree.table.filetable import FileTable, Limits, TableError
    stored = os.path.join(folder, "t.table")
    _raw_table(path).save(stored, {"layout": 2})
    try:
        FileTable.load(stored, {"layout": 2}, Limits(blocks=1, block_size=1))
    except TableError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_names_are_refused_as_names_keys_and_fields(name: str) -> None:
    from atlasfs.formats.naming import field_name_problem, name_problem
    assert name_problem(name) is not None
    if "/" not in name:  # a key may have folders: "a/b"
        assert key_problem(name, 3) is not None
        assert key_problem(f"k/{name}", 3) is not None and key_problem(f"{name}/k", 3) is not None
    assert field_name_problem(name) is not None
    files, note = example_files({"__key__": "k", name: b"x", "txt": "t"}, 200)
    assert [suffix for suffix, _ in files] == ["pickle"] and note is not None
    if "/" not in name:
        key, note = KeyAssigner(6).assign(name, 7, 3)
        assert key == "000007" and note is not None and "using index key 000007" in note


@pytest.mark.parametrize("name", FINE_NAMES)
def test_names_close_to_hostile_ones_stay(name: str) -> None:
    from atlasfs.formats.naming import field_name_problem, name_problem
    assert name_problem(name) is None
    if "." not in name and len(name) < 200:
        assert key_problem(name, 3) is None and KeyAssigner(6).assign(name, 7, 3) == (name, None)
    if not name.startswith("."):
        assert field_name_problem(name) is None


@pytest.mark.parametrize("path", HOSTILE_NAMES + FINE_NAMES + ["a/-rf", "-C../x", "a /b", "a/ b", "a//b", "a/./b",
                                                                "a/../b", "ok/fine.jpg", "x" * 300 + "/y"])
def test_a_stored_table_is_checked_by_the_naming_layers_rule(path: str, tmp_path) -> None:
    """The table validator and the naming layer agree: a stored table may hold exactly the
    paths every component of which the naming layer would show."""
    from atlasfs.formats.naming import path_problem
    refused = _table_refuses(path, str(tmp_path)) if path else "empty"
    problem = path_problem(path)
    assert (refused is not None) == (problem is not None), (path, refused)
    if refused is not None and "unsafe name" in refused:  # else a check before names' (NUL, empty) refused it
        assert refused == f"is corrupt (an unsafe name: {problem})"
    if any(part.startswith("-") or part != part.strip() for part in path.split("/")):
        assert refused is not None and "unsafe name" in refused


def test_every_name_the_naming_layer_makes_loads_as_a_stored_table(tmp_path) -> None:
    """Files named by KeyAssigner and example_files, hostile keys and fields included, make a
    table that loading accepts."""
    from atlasfs.tree.table.filetable import FileTable, Limits
    from atlasfs.tree.table.layout import FILE
    assigner = KeyAssigner(6)
    rows = []
    for i, name in enumerate(HOSTILE_NAMES + FINE_NAMES + ["a/b", "a/-rf", "-C../x"]):
        example = {"__key__": name, name if name else "f": b"x", "txt": "t"}
        files, _ = example_files(example, 120)
        key, _ = assigner.assign(name, i, max(len(s.encode()) for s, _ in files))
        rows += [(f"{key}.{suffix}", FILE, 1, 0, i, j) for j, (suffix, _) in enumerate(files)]
    FileTable.build(rows).save(str(tmp_path / "t"), {"layout": 2})
    loaded = FileTable.load(str(tmp_path / "t"), {"layout": 2}, Limits(blocks=1, block_size=len(rows)))
    assert loaded is not None and len(loaded) >= len(rows)


_PATH_CHARS = st.sampled_from(list("aZ09_-./ é例\t\n\x85\u3000\u00a0\u0301") + ["x" * 120])


@given(st.lists(st.lists(_PATH_CHARS, max_size=8).map("".join), min_size=1, max_size=4))
@settings(max_examples=1000)
def test_paths_problem_quick_path_agrees_with_the_rules(paths: list[str]) -> None:
    from atlasfs.formats.naming import path_problem, paths_problem
    first = next((p for p in (path_problem(path) for path in paths) if p), None)
    assert paths_problem([path.encode() for path in paths]) == first
