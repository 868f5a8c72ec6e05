"""Every format from a bucket (issue #25): Dolma, Lavender, ``.pbin`` and WebDataset datasets
in moto's S3 server on 127.0.0.1, mounted with ``atlasfs mount s3://...`` and no options.

Each real producer's corpus fixture (tests/fixtures/<format>/) goes into the bucket as it is
on disk: the format is detected from the bucket's layout, the mounted tree is the same, file
for file and byte for byte, as the fixture mounted from disk, ``atlasfs export s3://...`` is
the local export, ``info`` and ``verify`` work, and a mount writes nothing into the bucket.
A Dolma ``.gz`` read at random fetches a few ranges, not the object (zran's seek points
read through ranged GETs); a bucket that stops answering fails a read with EIO within the
deadline, the daemon stays up, and the same read works once it answers again.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import random
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from atlasfs.storage.health import QUIET
from corpus import FIXTURES
from fusemount import atlasfs, is_mounted, mounted
from s3server import S3Server, s3_server, upload_copy
from tcpcut import Forwarder

BUCKET = "atlas-formats-test"
#: Each producer's fixtures: (format folder, fixture) -> the dataset inside it.
CORPUS = [("dolma", "tagged"), ("dolma", "mixed"), ("lavender", "wds_images"), ("lavender", "tabular"),
          ("modalities", "widths"), ("modalities", "merged"), ("webdataset", "images"), ("webdataset", "tiny")]
KINDS = {"dolma": "dolma", "lavender": "lavender", "modalities": "pbin", "webdataset": "webdataset"}


@pytest.fixture(scope="module")
def server():
    with s3_server() as s:
        s.make_bucket(BUCKET)
        yield s


def _tree(root: Path) -> list[str]:
    """``find``'s listing of a mounted tree: every path, its type and size."""
    out = subprocess.run(["find", str(root), "-mindepth", "1", "-printf", r"%P\t%y\t%s\n"], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return sorted(line for line in out.splitlines() if "\td\t" not in line) + \
        sorted(line.split("\t")[0] for line in out.splitlines() if "\td\t" in line)


def _tar_members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive if m.isfile()}


def _exports(folder: Path) -> dict[str, dict[str, bytes]]:
    return {str(tar.relative_to(folder)): _tar_members(tar) for tar in sorted(folder.rglob("*.tar"))}


@pytest.mark.parametrize("fmt,fixture", CORPUS, ids=[f"{f}-{x}" for f, x in CORPUS])
def test_a_fixture_in_a_bucket_mounts_as_it_does_from_disk(server: S3Server, tmp_path: Path, fmt: str, fixture: str):
    url = f"s3://{BUCKET}/{fmt}-{fixture}"
    local = upload_copy(server, FIXTURES / fmt / fixture / "data", url)
    before = server.keys(url)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    endpoint = ("--endpoint-url", server.endpoint)

    info = atlasfs("info", url, *endpoint, env={**os.environ, **env})
    assert info.returncode == 0, info.stderr
    assert info.stdout.startswith(f"dataset      {url}\n") and f"format       {KINDS[fmt]}" in info.stdout, info.stdout
    local_info = atlasfs("info", str(local), env={**os.environ, **env})
    assert info.stdout.splitlines()[1:3] == local_info.stdout.splitlines()[1:3]  # examples, shards
    verify = atlasfs("verify", url, *endpoint, env={**os.environ, **env})
    local_verify = atlasfs("verify", str(local), env={**os.environ, **env})
    # the same findings (some fixtures hold what their producer really writes wrong), named by URL
    assert (verify.returncode, verify.stdout) == (local_verify.returncode, local_verify.stdout.replace(str(local), url))
    assert "verify: " in verify.stdout, verify.stdout + verify.stderr

    with mounted(local, env=env) as disk, mounted(url, *endpoint, env=env) as bucket:
        listed = _tree(bucket)
        assert listed == _tree(disk) and listed
        for line in listed:
            if "\tf\t" in line:
                name = line.split("\t")[0]
                result = subprocess.run(["cmp", str(disk / name), str(bucket / name)], capture_output=True,
                                        timeout=60)
                assert result.returncode == 0, (name, result.stdout, result.stderr)

    assert atlasfs("export", str(local), str(tmp_path / "disk")).returncode == 0
    result = atlasfs("export", url, str(tmp_path / "bucket"), *endpoint, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    exported = _exports(tmp_path / "bucket")
    assert exported and exported == _exports(tmp_path / "disk")
    assert server.keys(url) == before, "nothing was written into the bucket"


# -------------------------------------------------------------------- Dolma .gz by ranges

#: Documents of the big file, and the bytes of random text each (base64: gzip saves a quarter).
DOCUMENTS = 6000
TEXT_BYTES = 2000


def _big_dolma(folder: Path) -> dict[str, str]:
    """A Dolma dataset of one ``.jsonl.gz`` of about 9 MiB (one gzip member, as dolma writes
    it); returns each document's text by id."""
    rng = random.Random(25)
    texts = {f"doc-{i:05d}": base64.b64encode(rng.randbytes(TEXT_BYTES * 3 // 4)).decode() for i in range(DOCUMENTS)}
    lines = "".join(json.dumps({"id": key, "text": text, "source": "test"}) + "\n" for key, text in texts.items())
    (folder / "documents").mkdir(parents=True)
    (folder / "documents" / "big.jsonl.gz").write_bytes(gzip.compress(lines.encode(), compresslevel=1))
    return texts


@pytest.fixture(scope="module")
def big_dolma(server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str], int]:
    """The big Dolma dataset in the bucket, its tables stored beside it by ``atlasfs index``
    (so a mount makes no pass over it); its URL, its texts and its .gz's size."""
    work = tmp_path_factory.mktemp("big-dolma")
    texts = _big_dolma(work / "big")
    url = f"s3://{BUCKET}/dolma-big"
    server.upload(work / "big", url)
    result = atlasfs("index", url, "--endpoint-url", server.endpoint,
                     env={**os.environ, "XDG_CACHE_HOME": str(work / "index-cache")})
    assert result.returncode == 0, result.stderr
    assert f"{BUCKET}/dolma-big/.atlasfs-tables/big.table" in server.keys(url)
    return url, texts, (work / "big" / "documents" / "big.jsonl.gz").stat().st_size


def test_a_random_read_of_a_dolma_gz_fetches_ranges_not_the_object(
        server: S3Server, big_dolma: tuple[str, dict[str, str], int], tmp_path: Path):
    url, texts, size = big_dolma
    before = server.keys(url)
    cache = tmp_path / "cache"
    with Forwarder(server.port) as fw, mounted(url, "--endpoint-url", fw.endpoint,
                                               env={"XDG_CACHE_HOME": str(cache)}) as mnt:
        assert len(os.listdir(mnt / "big")) == 2 * DOCUMENTS  # <id>.text and <id>.json, from the bucket's table
        listed = fw.body_bytes
        table = server.filesystem().cat_file(f"{BUCKET}/dolma-big/.atlasfs-tables/big.table")
        # to list: the bucket's table (its gzip seek points included) and the listing, no data
        assert listed < len(table) + (64 << 10) and listed < size // 5, \
            f"{listed} bytes fetched to list a {size}-byte file whose table is {len(table)} bytes"
        key = f"doc-{DOCUMENTS * 2 // 3:05d}"
        result = subprocess.run(["cat", str(mnt / "big" / f"{key}.text")], capture_output=True, timeout=60)
        assert result.returncode == 0 and result.stdout.decode() == texts[key], result.stderr
        fetched = fw.body_bytes - listed
        assert 0 < fetched < 3 << 20 and fetched < size // 3, f"{fetched} bytes of a {size}-byte object for one cat"
        assert set(fw.counts) <= {"GET"}
    # the bucket's table was used: mapped from a copy in the user's cache, byte for byte the bucket's
    assert [p.read_bytes() for p in cache.rglob("*.table")] == [table], "the mount mapped a copy of the bucket's table"
    assert server.keys(url) == before


def test_a_bucket_gone_fails_a_dolma_read_with_eio_within_the_deadline_and_it_reads_again_once_back(
        server: S3Server, big_dolma: tuple[str, dict[str, str], int], tmp_path: Path):
    url, texts, _ = big_dolma
    deadline, slack = 3.0, 2.0
    with Forwarder(server.port) as fw, mounted(url, "--endpoint-url", fw.endpoint, "-o", f"deadline={deadline:g}",
                                               env={"XDG_CACHE_HOME": str(tmp_path / "cache")}) as mnt:
        assert len(os.listdir(mnt / "big")) == 2 * DOCUMENTS
        key = f"doc-{DOCUMENTS - 7:05d}"
        fw.black_hole()
        start = time.monotonic()
        result = subprocess.run(["cat", str(mnt / "big" / f"{key}.text")], capture_output=True, timeout=120)
        elapsed = time.monotonic() - start
        assert result.returncode != 0 and b"Input/output error" in result.stderr and not result.stdout, result
        assert elapsed < deadline + slack, f"{elapsed:.1f} s for a deadline of {deadline:g} s"
        assert is_mounted(mnt) and os.listdir(mnt) == ["big"]
        fw.restore()
        time.sleep(QUIET)
        with open(mnt / "big" / f"{key}.text", "rb", buffering=0) as f:  # the same file, no remount
            assert f.read().decode() == texts[key]
