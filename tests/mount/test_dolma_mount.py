"""Dolma through a real mount: listing, reads, the tar view, export and verify; bad input one
line each while the rest serves; a second mount from the stored table; reads from many threads
(the source alone: tests/unit/formats/test_dolma_source.py)."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

from atlasfs.formats.dolma import LINES_PER_BLOCK
from dolmadata import FOLDERS, docs, expected_files, make_dataset, write_jsonl
from fusemount import atlasfs, is_mounted, mounted


def run(*command: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(command, capture_output=True, check=True, timeout=120)


def test_mounted_dolma_lists_reads_tars_exports_and_verifies(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    made = make_dataset(root)
    expected = expected_files(root, made)
    log = tmp_path / "daemon.log"
    with mounted(root, "-o", f"log_file={log}") as mnt:
        assert sorted(os.listdir(mnt)) == ["cc", "wiki"] and sorted(os.listdir(mnt / "cc")) == ["2019", "b"]
        for folder, files in expected.items():
            listed = run("ls", "-U", str(mnt / folder)).stdout.decode().split()
            assert listed == list(files), folder  # line order; per line json, text, tox.json
        found = run("find", str(mnt), "-type", "f").stdout.decode().split()
        assert len(found) == sum(len(files) for files in expected.values())
        for folder, files in expected.items():
            for name in ("a5.text", "b700.json", "w1030.tox.json", *list(files)[::401]):
                if name in files:
                    assert run("cat", str(mnt / folder / name)).stdout == files[name], (folder, name)
        # tar of a folder, read back by webdataset: the samples are the lines
        for folder, relative in FOLDERS.items():
            tar = tmp_path / f"{folder.replace('/', '_')}.tar"
            subprocess.run(f"cd {mnt / folder} && find . -type f -printf '%P\\n' | tar cf {tar} --no-recursion -T -",
                           shell=True, check=True)
            samples = list(wds.WebDataset(str(tar), shardshuffle=False))
            rows = made[relative]
            assert [s["__key__"] for s in samples] == [r["id"] for r in rows]
            assert [json.loads(s["json"]) for s in samples] == rows
            assert [s["text"].decode() for s in samples] == [r["text"] for r in rows]
            assert json.loads(samples[17]["tox.json"]) == {"id": rows[17]["id"], "attributes": {"tox": 17 / 7}}
            assert "bad.json" not in samples[0]
        out = tmp_path / "export"
        result = atlasfs("export", str(root), str(out))
        assert result.returncode == 0, result.stderr
        for folder in FOLDERS:
            with tarfile.open(out / f"{folder}.tar") as archive:
                members = archive.getmembers()
                assert len(members) == len(expected[folder])
                for member in members:
                    assert archive.extractfile(member).read() == (mnt / folder / member.name).read_bytes()
    text = log.read_text()
    assert "Traceback" not in text
    for relative in FOLDERS.values():  # the set that does not line up: one line per file, with line and ids
        lines = [line for line in text.splitlines() if f"attributes/bad/{relative} line 601" in line]
        assert len(lines) == 1 and "where" in lines[0] and f"documents/{relative}" in lines[0], text
    info = atlasfs("info", str(root))
    assert info.returncode == 0 and "dolma" in info.stdout and "3093" in info.stdout, info.stdout + info.stderr
    assert "attribute sets: bad, tox" in info.stdout
    verify = atlasfs("verify", str(root))
    assert verify.returncode == 1
    said = (verify.stdout + verify.stderr).splitlines()
    for relative, prefix in (("cc/2019/a.jsonl.gz", "a"), ("cc/b.jsonl.zst", "b"), ("wiki.jsonl", "w")):
        [line] = [line for line in said if f"attributes/bad/{relative} line 601" in line]
        assert f"id '{prefix}601'" in line and f"has '{prefix}600'" in line


def test_mounted_bad_input_is_one_line_each_and_the_rest_serves(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    rows: list[object] = [*docs("d", 3), b"{not json\n", {"text": "no id"}, *docs("e", 5)]
    write_jsonl(root / "documents" / "bad" / "lines.jsonl.gz", rows, "gz")
    cut = root / "documents" / "bad" / "cut.jsonl.gz"
    write_jsonl(cut, docs("c", 3 * LINES_PER_BLOCK), "gz")
    cut.write_bytes(cut.read_bytes()[:-300])
    write_jsonl(root / "documents" / "good.jsonl", docs("g", 4), "plain")
    log = tmp_path / "daemon.log"
    with mounted(root, "--format", "dolma", "-o", f"log_file={log}") as mnt:
        lines = mnt / "bad" / "lines"
        names = os.listdir(lines)
        assert (lines / "000003.json").read_bytes() == b"{not json"  # only its raw line, under its index key
        assert (lines / "000004.json").read_bytes() == b'{"text": "no id"}'
        assert not [n for n in names if n.startswith(("000003.", "000004.")) and not n.endswith(".json")]
        assert (lines / "e4.text").read_bytes() == b"text 4 \xc3\xbcn\xc3\xaf xxxx"
        # the cut file: its first two blocks serve, the block it is cut in fails with EIO
        listed = os.listdir(mnt / "bad" / "cut")
        unreadable = [n for n in listed if n.endswith(".unreadable")]
        assert unreadable and len([n for n in listed if n.endswith(".text")]) == 2 * LINES_PER_BLOCK
        assert (mnt / "bad" / "cut" / "c1000.text").read_bytes().startswith(b"text 1000")
        with pytest.raises(OSError) as info:
            (mnt / "bad" / "cut" / unreadable[0]).read_bytes()
        assert info.value.errno == errno.EIO
        assert subprocess.run(["cat", str(mnt / "bad" / "cut" / unreadable[-1])], capture_output=True).returncode != 0
        assert (mnt / "bad" / "cut" / "c0.json").read_bytes().startswith(b'{"id": "c0"')  # still serving
        assert (mnt / "good" / "g3.text").read_bytes().startswith(b"text 3")
        assert is_mounted(mnt)
    text = log.read_text()
    assert "Traceback" not in text
    for needle in ("lines.jsonl.gz line 4: not a JSON object", "lines.jsonl.gz line 5: no string id",
                   "cut.jsonl.gz: truncated gzip member"):
        assert len([line for line in text.splitlines() if needle in line]) >= 1, (needle, text)
    assert len([line for line in text.splitlines() if "lines.jsonl.gz line 4:" in line]) == 1
    verify = atlasfs("verify", str(root))
    assert verify.returncode == 1
    said = verify.stdout + verify.stderr
    assert "line 4: not a JSON object" in said and "line 5: no string id" in said and "cut.jsonl.gz" in said
    assert "Traceback" not in said


def test_second_mount_lists_from_the_stored_table_with_no_pass(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    made = make_dataset(root)
    expected = expected_files(root, made)
    listings = {}
    with mounted(root) as mnt:
        for folder in FOLDERS:
            listings[folder] = run("ls", "-U", str(mnt / folder)).stdout
    # Every documents and attributes file now holds garbage of the same size and mtime: the
    # stored tables still match them, so a mount that made a pass would fail its folders
    # (not gzip, not zstd, not JSON), while one that restores lists as before.
    for path in [p for p in root.rglob("*") if p.is_file()]:
        st = path.stat()
        path.write_bytes(b"\xff" * st.st_size)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    log = tmp_path / "second.log"
    with mounted(root, "-o", f"log_file={log}") as mnt:
        for folder in FOLDERS:
            assert run("ls", "-U", str(mnt / folder)).stdout == listings[folder]
            assert run("ls", "-U", str(mnt / folder)).stdout.decode().split() == list(expected[folder])
        sizes = {n: (mnt / "wiki" / n).stat().st_size for n in ("w7.text", "w7.json", "w7.tox.json")}
        assert sizes == {n: len(expected["wiki"][n]) for n in sizes}
    # the restored state still tells, once per mount, which set was left out, where and why
    text = log.read_text()
    for relative in FOLDERS.values():
        assert len([line for line in text.splitlines() if f"attributes/bad/{relative} line 601" in line]) == 1, text
    assert "Traceback" not in text


def test_mounted_random_reads_from_many_threads(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    made = make_dataset(root, 5 * LINES_PER_BLOCK)
    expected = {f"{folder}/{name}": data for folder, files in expected_files(root, made).items()
                for name, data in files.items()}
    chosen = random.Random(3).sample(sorted(expected), 400)
    from concurrent.futures import ThreadPoolExecutor
    with mounted(root, "--cache-size", "1M") as mnt:  # a small cache: blocks are evicted and read again
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda name: (mnt / name).read_bytes(), chosen))
        assert got == [expected[name] for name in chosen]
        assert is_mounted(mnt)
