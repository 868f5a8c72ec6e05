"""Dolma as dolma reads it: the conformance corpus's datasets (tests/fixtures/dolma/, written
by dolma 1.2.1's own `dolma tag` and `dolma mix`) mounted with no option, every file compared
through a real mount with what dolma's own reading returned (expected.json); `atlasfs export`
equal to the mount, `atlasfs verify` clean; and what atlasfs does not read under documents/
(an unknown name, bz2) is one log line and a verify finding."""

from __future__ import annotations

import bz2
import gzip
import json
import re
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
import zstandard

from corpus import FIXTURES, expected, fixture_names
from fusemount import atlasfs, mounted

#: How a documents file's path becomes its folder (docs/sources.md, Dolma): no documents/, no
#: compression extension, then no .json/.jsonl.
_SUFFIX = re.compile(r"(\.jsonl?)?(\.gz|\.zst|\.zstd)?$")


def folder_of(relative: str) -> str:
    assert relative.startswith("documents/")
    return _SUFFIX.sub("", relative[len("documents/"):], count=1)


def raw_lines(path: Path) -> list[bytes]:
    """The lines of a documents or attributes file as dolma's reader sees them (decompressed
    by its extension), without newlines: what `<id>.json` must hold byte for byte."""
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    elif path.name.endswith((".zst", ".zstd")):
        data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines


def files_dolma_read(root: Path, want: dict[str, Any]) -> dict[str, dict[str, bytes | Any]]:
    """Folder -> {file name: expected content}, in listing order: `<id>.json` the raw line (its
    parse is dolma's), `<id>.text` the text in UTF-8, `<id>.<set>.json` the set's row."""
    out: dict[str, dict[str, Any]] = {}
    for relative, entry in want["files"].items():
        lines = raw_lines(root / relative)
        assert len(lines) == len(entry["documents"]), relative
        files: dict[str, Any] = {}
        for i, (line, doc) in enumerate(zip(lines, entry["documents"])):
            assert json.loads(line) == doc  # the fixture's file is what dolma read
            sample = {"json": line, "text": doc["text"].encode("utf-8")}
            for name, aligned in entry["attributes"].items():
                # dolma's rule: the documents path with documents/ replaced by attributes/<set>/
                assert aligned["file"] == f"attributes/{name}/{relative[len('documents/'):]}"
                row = raw_lines(root / aligned["file"])[i]
                assert json.loads(row) == aligned["rows"][i]
                sample[f"{name}.json"] = row
            # a sample's files are listed in the order of their suffixes (the naming layer's)
            files.update((f"{doc['id']}.{suffix}", sample[suffix]) for suffix in sorted(sample))
        out[folder_of(relative)] = files
    return out


def run(*command: str) -> bytes:
    return subprocess.run(command, capture_output=True, check=True, timeout=120).stdout


def copy_fixture(fixture: str, tmp_path: Path) -> Path:
    """The fixture's dataset in tmp: nothing a test runs writes into the repository."""
    return Path(shutil.copytree(FIXTURES / "dolma" / fixture / "data", tmp_path / fixture))


@pytest.mark.parametrize("fixture", fixture_names("dolma"))
def test_corpus_mounts_as_dolma_reads_it(tmp_path: Path, fixture: str) -> None:
    root = copy_fixture(fixture, tmp_path)
    want = expected("dolma", fixture)
    files = files_dolma_read(root, want)
    assert sum(len(f) for f in files.values()) > 0
    log = tmp_path / "daemon.log"
    with mounted(root, "-o", f"log_file={log}") as mnt:
        found = sorted(run("find", str(mnt), "-type", "f", "-printf", "%P\\n").decode().split("\n")[:-1])
        assert found == sorted(f"{folder}/{name}" for folder, names in files.items() for name in names)
        for folder, names in files.items():
            # line order; per line its files by suffix: each set's .json, json, text
            assert run("ls", "-U", str(mnt / folder)).decode().split() == list(names), folder
            for name, content in names.items():
                assert run("cat", str(mnt / folder / name)) == content, (folder, name)
        out = tmp_path / "export"
        result = atlasfs("export", str(root), str(out))
        assert result.returncode == 0, result.stderr
        exported = []
        for folder in files:
            with tarfile.open(out / f"{folder}.tar") as archive:
                for member in archive.getmembers():
                    exported.append(f"{folder}/{member.name}")
                    assert archive.extractfile(member).read() == (mnt / folder / member.name).read_bytes()
        assert sorted(exported) == found
    text = log.read_text()
    # every finding names a file of the dataset: nothing dolma wrote was left out or logged
    assert "Traceback" not in text and str(root / "documents") not in text and str(root / "attributes") not in text
    verify = atlasfs("verify", str(root))
    assert verify.returncode == 0 and "verify: OK" in verify.stdout, verify.stdout + verify.stderr
    assert "warning" not in verify.stdout


def test_the_issue_s_mix_output_shows_every_shard(tmp_path: Path) -> None:
    """Issue #25: `cc-wiki-long-0000.jsonl.gz` beside `cc-wiki-long-0001.json.gz` (the mixer's
    last shard): both are folders, no document is missing."""
    root = copy_fixture("mixed", tmp_path)
    documents = root / "documents"
    assert sorted(p.name for p in documents.iterdir()) == [
        "cc-wiki-long-0000.jsonl.gz", "cc-wiki-long-0001.jsonl.gz", "cc-wiki-long-0002.json.gz"]
    (documents / "cc-wiki-long-0002.json.gz").rename(documents / "cc-wiki-long-0001.json.gz")
    (documents / "cc-wiki-long-0001.jsonl.gz").rename(documents / "cc-wiki-long-0001.jsonl.zst")
    recompressed = zstandard.ZstdCompressor().compress(
        gzip.decompress((documents / "cc-wiki-long-0001.jsonl.zst").read_bytes()))
    (documents / "cc-wiki-long-0001.jsonl.zst").write_bytes(recompressed)
    want = expected("dolma", "mixed")["files"]
    with mounted(root) as mnt:
        # two files named cc-wiki-long-0001: each keeps its whole name as its folder
        assert sorted(p.name for p in mnt.iterdir()) == [
            "cc-wiki-long-0000", "cc-wiki-long-0001.json.gz", "cc-wiki-long-0001.jsonl.zst"]
        for folder, relative in (("cc-wiki-long-0001.json.gz", "documents/cc-wiki-long-0002.json.gz"),
                                 ("cc-wiki-long-0001.jsonl.zst", "documents/cc-wiki-long-0001.jsonl.gz")):
            for doc in want[relative]["documents"]:
                assert json.loads(run("cat", str(mnt / folder / f"{doc['id']}.json"))) == doc
                assert run("cat", str(mnt / folder / f"{doc['id']}.text")) == doc["text"].encode()
        total = len(run("find", str(mnt), "-name", "*.json").split())
        assert total == sum(len(entry["documents"]) for entry in want.values())


def test_files_not_read_are_one_log_line_and_a_verify_finding_each(tmp_path: Path) -> None:
    root = copy_fixture("tagged", tmp_path)
    want = files_dolma_read(root, expected("dolma", "tagged"))
    line = b'{"id": "x-0", "text": "in bz2", "source": "cc"}\n'
    not_read = {root / "documents" / "cc" / "README.md": b"# notes\n",
                root / "documents" / "wiki" / "en" / "0001.json.bz2": bz2.compress(line),
                root / "documents" / "wiki" / "en" / "0002.json.xz": b"\xfd7zXZ\x00"}
    for path, data in not_read.items():
        path.write_bytes(data)
    (root / "documents" / "wiki" / ".0003.json.gz.partial").write_bytes(b"hidden: ignored")
    log = tmp_path / "daemon.log"
    with mounted(root, "-o", f"log_file={log}") as mnt:
        found = sorted(run("find", str(mnt), "-type", "f", "-printf", "%P\\n").decode().split("\n")[:-1])
        assert found == sorted(f"{folder}/{name}" for folder, names in want.items() for name in names)
        assert run("cat", str(mnt / "wiki" / "en" / "0000" / "0000-0.text")) == \
            want["wiki/en/0000"]["0000-0.text"]
    text = log.read_text()
    assert "Traceback" not in text
    for path in not_read:
        lines = [line for line in text.splitlines() if str(path) in line]
        assert len(lines) == 1 and "not read" in lines[0], (path, text)
    [bz2_line] = [line for line in text.splitlines() if "0001.json.bz2" in line]
    assert "bz2 has no cheap random access" in bz2_line
    assert ".0003.json.gz.partial" not in text
    verify = atlasfs("verify", str(root))
    assert verify.returncode == 1
    findings = [line for line in verify.stdout.splitlines() if "not read" in line]
    assert sorted(findings) == sorted(line for line in verify.stdout.splitlines()
                                      if any(str(p) in line for p in not_read))
    assert len(findings) == 3 and all(any(line.startswith(f"{p}: not read") for line in findings) for p in not_read)
    assert "verify: 3 problem(s)" in verify.stdout and "Traceback" not in verify.stdout + verify.stderr


def test_only_unreadable_names_fail_the_mount_in_one_line(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    (root / "documents").mkdir(parents=True)
    (root / "documents" / "part-0.json.bz2").write_bytes(bz2.compress(b'{"id": "a", "text": "b"}\n'))
    result = atlasfs("verify", str(root))
    assert result.returncode == 1
    assert f"{root / 'documents'}: no documents files" in result.stdout and "part-0.json.bz2: not read" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_a_missing_attributes_file_serves_without_that_set_and_is_a_verify_warning(tmp_path: Path) -> None:
    root = copy_fixture("tagged", tmp_path)
    want = files_dolma_read(root, expected("dolma", "tagged"))
    missing = root / "attributes" / "basic" / "wiki" / "en" / "0000.jsonl.gz"
    missing.unlink()
    log = tmp_path / "daemon.log"
    with mounted(root, "-o", f"log_file={log}") as mnt:
        names = run("ls", "-U", str(mnt / "wiki" / "en" / "0000")).decode().split()
        assert names == [n for n in want["wiki/en/0000"] if not n.endswith(".basic.json")]
        assert run("cat", str(mnt / "cc" / "2019-09" / "part-a" / "part-a-2.basic.json")) == \
            want["cc/2019-09/part-a"]["part-a-2.basic.json"]
    text = log.read_text()
    lines = [line for line in text.splitlines() if "attribute set 'basic' has no file" in line]
    assert len(lines) == 1 and str(missing) in lines[0], text
    verify = atlasfs("verify", str(root))
    assert verify.returncode == 0, verify.stdout
    [warning] = [line for line in verify.stdout.splitlines() if line.startswith("warning:")]
    assert str(missing) in warning and "attribute set 'basic'" in warning
