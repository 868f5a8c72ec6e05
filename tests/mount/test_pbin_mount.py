"""Modalities .pbin through a real mount: folders list, read, tar and export equal; bad documents
and files fail alone while the daemon serves on (the source alone:
tests/unit/formats/test_pbin_source.py)."""

from __future__ import annotations

import errno
import io
import os
import pickle
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from atlasfs.formats.pbin import DOCUMENTS_PER_BLOCK, write_pbin
from fusemount import atlasfs, is_mounted, mounted

FORMS = [(1, 12), (2, 12), (4, 12), (4, 8)]


def _token_files(root: Path) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(7)
    written = {}
    root.mkdir(parents=True, exist_ok=True)
    for width, header in FORMS:
        docs = [rng.integers(0, 1 << (8 * width), size=int(n), dtype=np.uint64).tolist()
                for n in rng.integers(0, 30, size=DOCUMENTS_PER_BLOCK + 5)]
        stem = f"w{width}h{header}"
        write_pbin(str(root / f"{stem}.pbin"), docs, token_width=width, header=header)
        written[stem] = docs
    return written


def test_mounted_pbin_folders_list_read_tar_and_export_equal(tmp_path: Path) -> None:
    written = _token_files(tmp_path / "ds")
    with mounted(tmp_path / "ds") as mnt:  # detected from the layout
        assert sorted(os.listdir(mnt)) == sorted(written)
        for stem, docs in written.items():
            names = subprocess.run(["ls", str(mnt / stem)], capture_output=True, text=True, check=True).stdout.split()
            assert names == [f"{n:06d}.npy" for n in range(len(docs))]
            for n in (0, 5, len(docs) - 1):
                data = subprocess.run(["cat", str(mnt / stem / f"{n:06d}.npy")], capture_output=True, check=True).stdout
                array = np.load(io.BytesIO(data))
                assert array.dtype == np.dtype(f"<u{stem[1]}") and array.tolist() == docs[n]
                assert os.stat(mnt / stem / f"{n:06d}.npy").st_size == len(data)
        found = subprocess.run(["find", str(mnt), "-type", "f"], capture_output=True, text=True, check=True).stdout
        assert len(found.split()) == sum(len(d) for d in written.values())
        stem = "w2h12"
        tar = tmp_path / "w2.tar"
        subprocess.run(f"cd {mnt / stem} && find . -type f -printf '%P\\n' | tar cf {tar} --no-recursion -T -",
                       shell=True, check=True)
        samples = list(wds.WebDataset(str(tar), shardshuffle=False))
        assert [s["__key__"] for s in samples] == [f"{n:06d}" for n in range(len(written[stem]))]
        assert all(np.load(io.BytesIO(s["npy"])).tolist() == d for s, d in zip(samples, written[stem]))
        out = tmp_path / "export"
        result = atlasfs("export", str(tmp_path / "ds"), str(out))
        assert result.returncode == 0, result.stderr
        for stem in written:
            with tarfile.open(out / f"{stem}.tar") as archive:
                members = archive.getmembers()
                assert len(members) == len(written[stem])
                for member in members[:40]:
                    assert archive.extractfile(member).read() == (mnt / stem / member.name).read_bytes()
    info = atlasfs("info", str(tmp_path / "ds"))
    assert info.returncode == 0 and "pbin" in info.stdout, info.stdout + info.stderr
    verify = atlasfs("verify", str(tmp_path / "ds"))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    with mounted(tmp_path / "ds" / "w1h12.pbin", "--format", "pbin") as mnt:  # one file: one folder
        assert os.listdir(mnt) == ["w1h12"]
        assert np.load(mnt / "w1h12" / "000003.npy").tolist() == written["w1h12"][3]


def test_mounted_bad_documents_and_files_fail_alone_and_the_daemon_serves_on(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    root.mkdir()
    data = bytes(range(20))
    (root / "bad.pbin").write_bytes(len(data).to_bytes(8, "little") + (2).to_bytes(4, "little") + data
                                    + pickle.dumps([(0, 4), (2, 4), (4, 3), (10, 20), (16, 4)]))
    (root / "junk.pbin").write_bytes(b"\x10" + bytes(30))
    write_pbin(str(root / "good.pbin"), [[1, 2], [3]], token_width=2)
    log = tmp_path / "daemon.log"
    with mounted(root, "-o", f"log_file={log}") as mnt:
        assert np.load(mnt / "bad" / "000000.npy").tolist() == [0x0100, 0x0302]
        assert np.load(mnt / "bad" / "000004.npy").tolist() == [0x1110, 0x1312]
        for n in (1, 2, 3):
            names = [name for name in os.listdir(mnt / "bad") if name.startswith(f"{n:06d}.")]
            assert len(names) == 1
            with pytest.raises(OSError) as info:
                (mnt / "bad" / names[0]).read_bytes()
            assert info.value.errno == errno.EIO
        with pytest.raises(OSError) as info:
            os.listdir(mnt / "junk")
        assert info.value.errno == errno.EIO
        assert np.load(mnt / "good" / "000001.npy").tolist() == [3]
        assert is_mounted(mnt)
    text = log.read_text()
    for n in (1, 2, 3):  # named when the file is opened, and when its files fail
        assert any(f"bad.pbin document {n}:" in line for line in text.splitlines())
    assert "junk.pbin" in text and "Traceback" not in text
    verify = atlasfs("verify", str(root))
    assert verify.returncode == 1
    assert all(f"bad.pbin document {n}:" in verify.stdout + verify.stderr for n in (1, 2, 3))
