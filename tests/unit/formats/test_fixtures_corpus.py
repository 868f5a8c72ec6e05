"""The committed conformance corpus is intact: every file matches its manifest's checksum, no
file is missing or extra, and each expected.json parses, decodes and points at files that
exist. Needs none of the producer tools (CI never regenerates the corpus)."""

from __future__ import annotations

import hashlib
import json
import struct
import tarfile

import numpy as np
import pytest

from corpus import FIXTURES, FORMATS, decode, expected, fixture_names


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_manifest_matches_files(fmt: str) -> None:
    """Every file of the format's folder is in manifest.json with its size and sha256, and
    the manifest names no file that is not there."""
    folder = FIXTURES / fmt
    manifest = json.loads((folder / "manifest.json").read_text())["files"]
    on_disk = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                     if p.is_file() and p.name != "manifest.json")
    assert sorted(manifest) == on_disk
    for rel, entry in manifest.items():
        data = (folder / rel).read_bytes()
        assert len(data) == entry["size"], rel
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], rel


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_readme_names_tool_and_version(fmt: str) -> None:
    """The README says which tool, at which version, wrote the fixtures."""
    dist, version = FORMATS[fmt]
    text = (FIXTURES / fmt / "README.md").read_text()
    assert f"- {dist}: `{version}`" in text
    assert "scripts/make-fixtures.py" in text


def test_corpus_is_small() -> None:
    """The corpus stays well under 2 MB."""
    total = sum(p.stat().st_size for fmt in FORMATS for p in (FIXTURES / fmt).rglob("*")
                if p.is_file())
    assert total < 1_000_000


def test_decode_tags() -> None:
    """The tagged JSON values decode to bytes, arrays and NaN, and plain values stay."""
    got = decode({"b": {"$bytes": "AAE="}, "f": {"$float": "nan"}, "x": [1, "s", {"k": None}]})
    assert got["b"] == b"\x00\x01" and got["f"] != got["f"] and got["x"] == [1, "s", {"k": None}]


@pytest.mark.parametrize("fixture", ["tagged", "mixed"])
def test_dolma_expected(fixture: str) -> None:
    """dolma: the layout is the data folder's files; every documents file and attribute
    file exists; attribute rows align with documents by id."""
    root = FIXTURES / "dolma" / fixture / "data"
    exp = expected("dolma", fixture)
    assert exp["layout"] == sorted(str(p.relative_to(root)) for p in root.rglob("*")
                                   if p.is_file())
    assert exp["files"]
    for rel, entry in exp["files"].items():
        assert (root / rel).is_file() and entry["documents"]
        for name, attrs in entry["attributes"].items():
            assert attrs["file"] == rel.replace("documents/", f"attributes/{name}/", 1)
            assert [r["id"] for r in attrs["rows"]] == [d["id"] for d in entry["documents"]]
    if fixture == "tagged":
        assert {n for e in exp["files"].values() for n in e["attributes"]} == {
            "basic", "char_length_with_paragraphs_v1"}


@pytest.mark.parametrize("fixture", ["wds_images", "tabular"])
def test_lavender_expected(fixture: str) -> None:
    """lavender: every shard exists; each sample's uid is its uid column; ndarray columns
    decode to arrays; the tabular set has the one uid missing from a feature shardset."""
    root = FIXTURES / "lavender" / fixture
    exp = expected("lavender", fixture)
    for shardset in exp["shardsets"].values():
        for shard in shardset["shards"]:
            assert (root / shard["location"]).is_file()
    main = exp["shardsets"][exp["main_shardset"]]
    assert len(exp["samples"]) == sum(s["samples"] for s in main["shards"])
    for s in exp["samples"]:
        assert s["left"][exp["uid_column"]] == s["uid"]
        assert all(isinstance(a, np.ndarray) for a in s["deserialized"].values())
    failed = [s["uid"] for s in exp["samples"] if "$error" in s["inner"]]
    assert failed == ([4] if fixture == "tabular" else [])


@pytest.mark.parametrize("fixture", ["widths", "merged"])
def test_modalities_expected(fixture: str) -> None:
    """modalities: each .pbin's 12-byte header is the recorded one, and the document count
    is the index's."""
    root = FIXTURES / "modalities" / fixture
    exp = expected("modalities", fixture)
    files = exp["files"] if fixture == "widths" else {"merged": exp["merged"], **exp["parts"]}
    for name, rec in files.items():
        path = root / ("data" if name in ("merged", "w1", "w2", "w4") else "parts") / rec["file"]
        data_len, width = struct.unpack("<QI", path.read_bytes()[:12])
        assert (data_len, width) == (rec["header"]["data_len"], rec["header"]["token_size_in_bytes"])
        assert len(rec["documents"]) == len(rec["index"])
    if fixture == "widths":
        assert [files[w]["header"]["token_size_in_bytes"] for w in ("w1", "w2", "w4")] == [1, 2, 4]


@pytest.mark.parametrize("fixture", ["images", "tiny"])
def test_webdataset_expected(fixture: str) -> None:
    """webdataset: the samples' fields are the tar members' bytes, in shard order."""
    root = FIXTURES / "webdataset" / fixture
    exp = expected("webdataset", fixture)
    members = {}
    for shard in exp["shards"]:
        with tarfile.open(root / shard) as tar:
            for m in tar.getmembers():
                members[m.name] = tar.extractfile(m).read()
    fields = {f"{s['__key__']}.{k}": v for s in exp["samples"] for k, v in s.items()
              if not k.startswith("__")}
    assert fields == members


def test_every_fixture_is_covered() -> None:
    """The tests above cover every fixture the corpus has."""
    assert {f: fixture_names(f) for f in FORMATS} == {
        "dolma": ["mixed", "tagged"], "lavender": ["tabular", "wds_images"],
        "modalities": ["merged", "widths"], "webdataset": ["images", "tiny"]}
