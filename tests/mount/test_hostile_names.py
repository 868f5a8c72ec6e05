"""Names shell tools would misread (issue #35, point 7): a name starting with ``-`` is an
option to ``tar -T``, ``xargs``, ``rm *``; trailing spaces are trimmed. atlasfs shows no such
name (keys fall back to index keys, whatever the source), refuses a stored table holding one,
and the README's own ``find | tar`` line archives any tree as it is, never walking out of it.
The line is taken from README.md itself, so the docs and this test cannot drift apart."""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest

from atlasfs import AtlasWriter
from atlasfs.tree.table.filetable import FileTable, Limits
from atlasfs.tree.table.layout import FILE, UNKNOWN_SIZE
from atlasfs.tree.table.store import BESIDE_DATASET
from fusemount import IN_CI, atlasfs, mounted

README = Path(__file__).resolve().parents[2] / "README.md"
#: What the README's line archives, and into what, as it is written there.
README_FOLDER, README_TAR = "/tmp/ds/0", "0.tar"

#: Keys that are options or trimmed; each also a folder (``<key>/inner``).
HOSTILE_KEYS = ["-rf", "-C", "-Cx", "--checkpoint-action=exec=touch PWNED", "--", "-", " lead", "trail ",
                "-C/inner", "ok/-rf", "ok/trail "]


def readme_command(folder: Path, out: Path) -> str:
    """The README's ``find | tar`` line, archiving ``folder`` into ``out``."""
    lines = [line for line in README.read_text().splitlines() if line.startswith("$ find ") and "| tar " in line]
    assert len(lines) == 1, lines
    line = lines[0][2:]
    assert line.count(README_FOLDER) == 2 and line.count(f" {README_TAR} ") == 1, line
    return line.replace(README_FOLDER, shlex.quote(str(folder))).replace(f" {README_TAR} ",
                                                                         f" {shlex.quote(str(out))} ")


def require_gnu_tar() -> None:
    try:
        version = subprocess.run(["tar", "--version"], capture_output=True, text=True).stdout
    except OSError:
        version = ""
    if "GNU tar" not in version:
        if IN_CI:
            pytest.fail("GNU tar is needed in CI")
        pytest.skip("GNU tar is not installed")


def files_under(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder``: relative path -> bytes."""
    out = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = Path(parent) / name
            out[str(path.relative_to(folder))] = path.read_bytes()
    return out


def archive_with_readme_line(folder: Path, out: Path, cwd: Path) -> dict[str, bytes]:
    """Run the README's line on ``folder``; the tar's members: name -> bytes."""
    require_gnu_tar()
    result = subprocess.run(["bash", "-c", readme_command(folder, out)], cwd=cwd, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    with tarfile.open(out) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def test_the_readme_line_archives_any_tree_as_it_is(tmp_path: Path) -> None:
    """Without atlasfs: a folder of names that are tar options (``-C..`` twice walks two
    folders up, to a planted ``SECRET``), trimmed or split names. The archive holds exactly
    the folder's files, bytes and all, and nothing ran."""
    outer = tmp_path / "outer"
    folder = outer / "mnt" / "00"
    (folder / "-Cdir").mkdir(parents=True)
    secret = outer / "SECRET"
    secret.write_bytes(b"planted outside the folder")
    secret.chmod(0o600)
    names = ["-C..", "-C.. ", "-C..  ", "SECRET", "-rf", "--checkpoint-action=exec=touch PWNED", "--",
             "-T", " lead", "trail ", "a\nb", "-Cdir/-x", "plain.txt"]
    for i, name in enumerate(names):
        (folder / name).write_bytes(f"file {i}".encode())
    members = archive_with_readme_line(folder, tmp_path / "x.tar", cwd=tmp_path)
    assert members == files_under(folder)
    assert b"planted outside the folder" not in members.values()
    assert not (tmp_path / "PWNED").exists() and not (folder / "PWNED").exists()


# ---------------------------------------------------------------- through a mount


def _examples(keys: list[str]) -> list[dict[str, Any]]:
    return [{"__key__": key, "txt": f"text {i}", "cls": i} for i, key in enumerate(keys)]


def _assert_names_safe(mnt: Path) -> None:
    """No name under ``mnt`` is an option or trimmed by tools."""
    for parent, folders, files in os.walk(mnt):
        for name in folders + files:
            assert not name.startswith("-") and name == name.strip(), (parent, name)


def test_hostile_keys_get_index_keys_and_the_readme_line_archives_the_mount(tmp_path: Path) -> None:
    """Keys that are tar options, from an Atlas dataset and from WebDataset tar members: the
    mount shows them under index keys (every sample still there), and the README's line
    archives exactly the mount's files."""
    atlas = tmp_path / "atlas"
    keys = HOSTILE_KEYS + [f"s{i}" for i in range(4)]
    with AtlasWriter(atlas, shard_size=len(keys), block_size=4, compression_strategy=1) as writer:
        writer.add_examples(_examples(keys))
    wds = tmp_path / "wds"
    wds.mkdir()
    with tarfile.open(wds / "hostile.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for i, key in enumerate(keys):
            for suffix, data in (("txt", f"text {i}".encode()), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    for dataset, shard in ((atlas, "0"), (wds, "hostile")):
        log = tmp_path / f"{dataset.name}.log"
        with mounted(dataset, "-o", f"log_file={log}", env=env) as mnt:
            _assert_names_safe(mnt)
            files = files_under(mnt / shard)
            assert len(files) == 2 * len(keys)  # no sample lost
            texts = sorted(data for name, data in files.items() if name.endswith(".txt"))
            assert texts == sorted(f"text {i}".encode() for i in range(len(keys)))
            for i in range(4):
                assert files[f"s{i}.txt"] == f"text {len(HOSTILE_KEYS) + i}".encode()
            members = archive_with_readme_line(mnt / shard, tmp_path / f"{shard}.tar", cwd=tmp_path)
            assert members == files
        assert not (tmp_path / "PWNED").exists()
        text = log.read_text()
        assert text.count("using index key") == len(HOSTILE_KEYS), text


def _stored_key(path: Path) -> dict[str, Any]:
    """The key a stored table was built for (its header's), so a forged one is not stale."""
    data = path.read_bytes()
    length = int.from_bytes(data[8:12], "little")
    return json.loads(data[16:16 + length])["key"]


def test_a_forged_table_of_option_names_is_refused_and_rebuilt(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A stored table beside an untouched dataset, forged (checksums valid) to name the files
    ``-C..``, ``-C.. ``, ``-C..  ``, ``SECRET``: through the old README line, tar would walk
    from MNT/0 two folders up and archive the 0600 ``SECRET`` planted there. The table is
    refused with a log line, the mount shows the dataset's real names, and the README line
    archives them."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # mount points in tmp_path: MNT/0/../.. is tmp_path
    secret = tmp_path / "SECRET"
    secret.write_bytes(b"planted outside the mount")
    secret.chmod(0o600)
    dataset = tmp_path / "ds"
    with AtlasWriter(dataset, shard_size=8, block_size=4, compression_strategy=1) as writer:
        writer.add_examples(_examples([f"s{i:03d}" for i in range(8)]))
    result = atlasfs("index", str(dataset))
    assert result.returncode == 0, result.stderr
    stored = dataset / BESIDE_DATASET / "0.table"
    key = _stored_key(stored)
    real = FileTable.load(str(stored), key, Limits(blocks=2, block_size=4))
    assert real is not None
    forged_names = ["-C..", "-C.. ", "-C..  ", "-Ctmp", "SECRET", "--checkpoint-action=exec=touch PWNED", "name "]
    forged = FileTable.build([(name, FILE, UNKNOWN_SIZE, i // 4 % 2, i % 4, 0) for i, name in enumerate(forged_names)])
    forged.state = real.state
    forged.save(str(stored), key)
    data_before = {p.name: p.read_bytes() for p in (dataset / "0").iterdir()}
    log = tmp_path / "log"
    with mounted(dataset, "-o", f"log_file={log}", env={"XDG_CACHE_HOME": str(tmp_path / "cache")}) as mnt:
        assert mnt.parent == tmp_path
        names = os.listdir(mnt / "0")
        assert sorted(names) == sorted(f"s{i:03d}.{e}" for i in range(8) for e in ("cls", "txt"))
        files = files_under(mnt / "0")
        members = archive_with_readme_line(mnt / "0", tmp_path / "0.tar", cwd=tmp_path)
        assert members == files
        assert b"planted outside the mount" not in members.values()
    assert {p.name: p.read_bytes() for p in (dataset / "0").iterdir()} == data_before
    assert not (tmp_path / "PWNED").exists()
    text = log.read_text()
    refused = [line for line in text.splitlines() if "ignoring the stored file table" in line]
    assert len(refused) == 1 and "unsafe name" in refused[0] and "'-C..'" in refused[0], text


#: File names a downloaded dataset may hold, whose shard folders cannot be shown as they are.
_HOSTILE_FILE_STEMS = ["-rf", "-C..", " lead", "trail ", "x\x1b]0;PWNED\x07", "y\x1b[2K\rverify: OK"]


def _tar(path: Path, stem: str) -> None:
    with tarfile.open(path, "w") as tar:
        for ext, data in (("txt", f"in {stem!r}".encode()), ("cls", b"1")):
            member = tarfile.TarInfo(f"k0.{ext}")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


@pytest.mark.parametrize("kind", ["webdataset", "dolma", "pbin"])
def test_shard_files_whose_names_cannot_be_shown_are_left_out_in_one_line_each(tmp_path: Path, kind: str) -> None:
    """A shard's folder is named after its file: tars, .pbin files and Dolma documents files named
    -rf, ' lead', or with terminal control sequences (which retitle the terminal of whoever lists
    the mount or reads verify, or erase verify's line: ESC [2K) were shown as folders of those
    names. Now each is left out with one line (the name escaped), verify exits 1, the mount
    shows the others."""
    from atlasfs.formats.pbin import write_pbin
    root = tmp_path / kind
    folder = root / "documents" if kind == "dolma" else root
    folder.mkdir(parents=True)
    suffix = {"webdataset": ".tar", "dolma": ".jsonl", "pbin": ".pbin"}[kind]
    for stem in ["ok", *_HOSTILE_FILE_STEMS]:
        path = folder / f"{stem}{suffix}"
        if kind == "webdataset":
            _tar(path, stem)
        elif kind == "dolma":
            path.write_text(json.dumps({"id": "d0", "text": "t"}) + "\n")
        else:
            write_pbin(str(path), [[1, 2]], token_width=2)
    result = atlasfs("verify", str(root), timeout=60)
    assert result.returncode == 1, result
    assert "\x1b" not in result.stdout + result.stderr and "Traceback" not in result.stderr
    for stem in _HOSTILE_FILE_STEMS:
        lines = [line for line in result.stdout.splitlines() if repr(str(folder / f"{stem}{suffix}")) in line]
        assert len(lines) == 1 and "left out: its folder could not be named as it is" in lines[0], result.stdout
    with mounted(root) as mnt:
        assert sorted(os.listdir(mnt)) == ["ok"]
