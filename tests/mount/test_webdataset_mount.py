"""WebDataset through a real mount: the corpus mounts and exports as webdataset reads it, and a
truncated member fails its sample alone (the source alone:
tests/unit/formats/test_webdataset_source.py)."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import webdataset

from atlasfs.formats.factory import detect
from corpus import FIXTURES, expected, fixture_names
from formatfixtures import samples_of
from fusemount import atlasfs, mounted
from tardata import add, fields_of


@pytest.mark.parametrize("fixture", fixture_names("webdataset"))
def test_corpus_mounts_and_exports_as_webdataset_reads_it(fixture: str, tmp_path: Path) -> None:
    """Every file of the mounted fixture is its member's bytes (expected.json, what
    webdataset.WebDataset yields), samples in archive order; export's tars and the mount's
    tar view read back by webdataset give the same samples."""
    data = Path(shutil.copytree(FIXTURES / "webdataset" / fixture / "data", tmp_path / "data"))
    exp = expected("webdataset", fixture)
    by_shard: dict[str, list[dict]] = {}
    for sample in exp["samples"]:
        by_shard.setdefault(Path(sample["__local_path__"]).name[:-len(".tar")], []).append(fields_of(sample))
    assert len(by_shard) == len(exp["shards"]) == 2
    assert detect(str(data)) == "webdataset"
    out = tmp_path / "export"
    result = atlasfs("export", str(data), str(out))
    assert result.returncode == 0, result.stderr
    with mounted(data, "--view", "both") as mnt:
        for folder, samples in by_shard.items():
            files = {f"{s['__key__']}.{k}": v for s in samples for k, v in s.items() if k != "__key__"}
            found = subprocess.run(["find", str(mnt / folder), "-type", "f", "-printf", "%P\n"],
                                   capture_output=True, text=True, check=True).stdout.split("\n")[:-1]
            assert sorted(found) == sorted(files)
            assert samples_of(found) == [s["__key__"] for s in samples]
            for name, data_bytes in files.items():
                assert subprocess.run(["cat", str(mnt / folder / name)], capture_output=True,
                                      check=True).stdout == data_bytes, name
            for tar in (out / f"{folder}.tar", mnt / f"{folder}.tar"):
                back = [fields_of(s) for s in webdataset.WebDataset(str(tar), shardshuffle=False, empty_check=False)]
                assert back == samples, tar


def test_a_truncated_member_fails_its_sample_alone(tmp_path: Path) -> None:
    """A tar cut inside a member's data: the samples before it serve; the cut sample's files
    fail with EIO, and verify names the shard and member in one line."""
    (tmp_path / "ds").mkdir()
    path = tmp_path / "ds" / "cut.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for n in range(5):
            add(tar, f"s{n}.txt", f"text {n}".encode())
            add(tar, f"s{n}.bin", bytes(3000))
    raw = path.read_bytes()
    path.write_bytes(raw[:raw.index(b"s4.bin") + 512 + 1000])  # inside s4.bin's data
    with mounted(tmp_path / "ds") as mnt:
        for n in range(4):
            assert (mnt / "cut" / f"s{n}.bin").read_bytes() == bytes(3000)
        names = sorted(p.name for p in (mnt / "cut").iterdir())
        [unreadable] = [n for n in names if n.endswith(".unreadable")]
        assert sorted(set(names) - {unreadable}) == sorted(f"s{n}.{e}" for n in range(4) for e in ("bin", "txt"))
        with pytest.raises(OSError) as info:
            (mnt / "cut" / unreadable).read_bytes()
        assert info.value.errno == 5
    verify = atlasfs("verify", str(tmp_path / "ds"))
    assert verify.returncode == 1 and "Traceback" not in verify.stderr
    assert f"{path} member 's4.bin': truncated" in verify.stdout, verify.stdout
