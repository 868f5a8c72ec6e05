"""``index`` and ``export`` over shards in parallel processes (-j, issue #26): the same
tables and the same tar bytes whatever the number of processes, an index run that
resumes, and a shard failing in a worker that is one line while the others are done."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from atlasfs.commands.jobs import LOST, Opener, run
from atlasfs.formats.factory import SourceOptions, open_source
from atlasfs.storage import StorageOptions
from fusemount import atlasfs
from helpers import REFERENCE
from jobsdata import dies_on_shard_2, jobs_dataset, no_state


TWELVE = REFERENCE / "s2_twelve_shards" / "dataset"  # keys partNN/itemNNNN: a sub-folder per part


def _tables(folder: Path) -> dict[str, bytes]:
    """The file tables stored in ``folder`` (beside them, energon's index.sqlite: one, checked)."""
    assert len(list(folder.glob("energon-*.sqlite"))) == 1
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.table"))}


def _stored_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if "stored the file table of shard" in line]


def test_index_in_two_processes_stores_the_same_tables_and_resumes(tmp_path: Path) -> None:
    dataset = jobs_dataset(tmp_path / "ds")
    one, two = tmp_path / "one", tmp_path / "two"
    first = atlasfs("index", str(dataset), "-j", "1", "--index-dir", str(one), "-v")
    second = atlasfs("index", str(dataset), "--jobs", "2", "--index-dir", str(two), "-v")
    assert first.returncode == second.returncode == 0, (first.stderr, second.stderr)
    assert second.stdout == f"file tables of 5 shards are up to date in {two}\n"
    assert len(_stored_lines(second)) >= 5  # each shard built (stored, then again once sized)
    assert _tables(one) == _tables(two) and len(_tables(two)) == 5  # byte for byte
    # run again: nothing is built, every shard counts as done at once
    mtimes = {p.name: p.stat().st_mtime_ns for p in two.iterdir()}
    again = atlasfs("index", str(dataset), "-j", "2", "--index-dir", str(two), "-v")
    assert again.returncode == 0 and _stored_lines(again) == [], again.stderr
    assert again.stdout == f"file tables of 5 shards are up to date in {two} (5 of them were already)\n"
    assert {p.name: p.stat().st_mtime_ns for p in two.iterdir()} == mtimes
    # an interrupted run left shard 2's table out: only it is built
    (two / "2.table").unlink()
    resumed = atlasfs("index", str(dataset), "-j", "2", "--index-dir", str(two), "-v")
    assert resumed.returncode == 0
    assert sorted({line.split("shard ")[1].split()[0] for line in _stored_lines(resumed)}) == ["2"], resumed.stderr
    assert resumed.stdout.endswith("(4 of them were already)\n")
    assert _tables(two) == _tables(one)


def test_a_table_stored_without_its_sizes_is_sized_on_the_next_run(tmp_path: Path) -> None:
    """A run stopped between building a table and sizing it left a table that does not
    know every size: valid, but not done; the next run sizes it."""
    from atlasfs import AtlasDataset
    from atlasfs.tree.blocktree import BlockTree
    from atlasfs.tree.table.store import TableStore
    dataset = jobs_dataset(tmp_path / "ds")
    folder = tmp_path / "tables"
    with AtlasDataset(dataset) as source:  # what a first listing stores: names, not every size
        tree = BlockTree(source, store=TableStore(str(dataset), index_dir=str(folder)))
        tree.names("/1")
    assert sorted(p.name for p in folder.iterdir()) == ["1.table"]
    result = atlasfs("index", str(dataset), "-j", "2", "--index-dir", str(folder), "-v")
    assert result.returncode == 0, result.stderr
    assert "1" in {line.split("shard ")[1].split()[0] for line in _stored_lines(result)}
    assert result.stdout == f"file tables of 5 shards are up to date in {folder}\n"
    again = atlasfs("index", str(dataset), "-j", "2", "--index-dir", str(folder), "-v")
    assert _stored_lines(again) == [] and again.stdout.endswith("(5 of them were already)\n")


def _truncated_copy(tmp_path: Path) -> Path:
    """The twelve-shard fixture with shard 03's data.bin cut short (it cannot be opened)."""
    dataset = Path(shutil.copytree(TWELVE, tmp_path / "ds"))
    data = dataset / "03" / "data.bin"
    data.write_bytes(data.read_bytes()[:-20])
    return dataset


def test_a_shard_failing_in_a_worker_is_one_line_and_the_others_are_done(tmp_path: Path) -> None:
    dataset = _truncated_copy(tmp_path)
    result = atlasfs("index", str(dataset), "-j", "2")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"atlasfs: index of shard 03 failed: {dataset / '03' / 'data.bin'}"), line
    assert result.stdout == f"file tables of 11 of 12 shards are up to date in {dataset / '.atlasfs-tables'}\n"
    assert sorted(p.name for p in (dataset / ".atlasfs-tables").glob("*.table")) == \
        sorted(f"{i:02d}.table" for i in range(12) if i != 3)
    out = tmp_path / "out"
    result = atlasfs("export", str(dataset), str(out), "-j", "2")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line, summary] = result.stderr.splitlines()
    assert line.startswith(f"atlasfs: export of shard 03 failed: {dataset / '03' / 'data.bin'}"), line
    assert line.endswith("; the other shards are written") and summary.startswith("atlasfs: 1 of 12 shards")
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{i:02d}.tar" for i in range(12) if i != 3]
                                                           + ["shards.json"])


def test_a_worker_that_dies_loses_its_own_shard_only(tmp_path: Path) -> None:
    dataset = jobs_dataset(tmp_path / "ds")
    opener = Opener(str(dataset), None, SourceOptions(), StorageOptions())
    with open_source(str(dataset)) as source:
        results = list(run(source, opener, no_state, dies_on_shard_2, range(5), 2, lambda what, n: None))
    assert sorted(done.shard for done in results) == [0, 1, 2, 3, 4]  # each once
    assert {done.shard: done.error for done in results if done.error} == {2: LOST}


def test_work_a_worker_cannot_load_fails_each_shard_in_one_line(tmp_path: Path) -> None:
    """A module of the work that does not import in a worker (moved meanwhile, or a native
    library that does not load there): each shard fails in one line naming why; the workers
    did not die (it was LOST for every shard, a traceback from each worker)."""
    import importlib
    import sys
    (tmp_path / "here_only.py").write_text(
        "import os\n"
        f"if os.getpid() != {os.getpid()}:\n"
        "    raise ImportError('here_only imports in the test process only')\n"
        "def no_state(source):\n"
        "    return None\n")
    sys.path.insert(0, str(tmp_path))
    try:
        here_only = importlib.import_module("here_only")
        dataset = jobs_dataset(tmp_path / "ds")
        opener = Opener(str(dataset), None, SourceOptions(), StorageOptions())
        with open_source(str(dataset)) as source:
            results = list(run(source, opener, here_only.no_state, dies_on_shard_2, range(3), 2,
                               lambda what, n: None))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("here_only", None)
    assert {done.shard: done.error for done in results} == {
        s: "a worker process cannot load its work: here_only imports in the test process only" for s in range(3)}


def test_jobs_must_be_a_positive_number(tmp_path: Path) -> None:
    for value in ("0", "two"):
        result = atlasfs("index", str(TWELVE), "-j", value, "--index-dir", str(tmp_path))
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert "argument -j/--jobs: " in result.stderr and ("at least 1" in result.stderr or "whole number" in
                                                            result.stderr), result.stderr


def test_ray_takes_an_address_only_when_it_looks_like_one() -> None:
    """``--ray``'s value is optional: a word after it that is no address is given back to the
    positionals (``pack --ray DATASET OUTDIR``), an address stays its value, and --help says so."""
    from atlasfs.commands.cli import build_parser
    from atlasfs.commands.jobs import is_ray_address, ray_address_apart
    for address in ("auto", "local", "10.0.0.5:6379", "head-0.cluster.local:6379", "[::1]:6379",
                    "ray://head:10001"):
        assert is_ray_address(address), address
    for word in ("wds", "/data/wds", "s3://bucket/wds", "./out", "data:set", "10.0.0.5"):
        assert not is_ray_address(word), word
    parser = build_parser()

    def parsed(*argv: str) -> tuple[str | None, str, str]:
        args = parser.parse_args(ray_address_apart(list(argv)))
        return args.ray, args.dataset, args.outdir
    assert parsed("pack", "--ray", "wds", "out") == ("", "wds", "out")
    assert parsed("pack", "--ra", "wds", "out") == ("", "wds", "out")  # argparse's abbreviation too
    assert parsed("pack", "--ray", "10.0.0.5:6379", "wds", "out") == ("10.0.0.5:6379", "wds", "out")
    assert parsed("pack", "wds", "--ray", "ray://head:10001", "out") == ("ray://head:10001", "wds", "out")
    assert parsed("pack", "wds", "out", "--ray") == ("", "wds", "out")
    assert parsed("pack", "-j", "2", "--ray", "-q", "wds", "out") == ("", "wds", "out")
    assert ray_address_apart(["pack", "--", "--ray", "wds"]) == ["pack", "--", "--ray", "wds"]  # after --: as is
    help_text = " ".join(parser.commands["pack"].format_help().split())
    assert "auto, HOST:PORT or ray://HOST:PORT" in help_text and "pack --ray DATASET OUTDIR" in help_text


def test_ray_with_a_value_that_is_no_address_is_one_line(tmp_path: Path) -> None:
    result = atlasfs("verify", str(TWELVE), "--ray=wds")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("atlasfs verify: argument --ray: 'wds' is no Ray address "
                             "(auto, local, HOST:PORT or ray://HOST:PORT)\n")


def _damaged_and_warned(tmp_path: Path) -> Path:
    """Four tars: shard-003 cut short (it fails), shard-001 with a member of no '.' in its
    name (left out with a warning; the shard is written)."""
    import io
    import tarfile
    from raydata import write_tars
    source = write_tars(tmp_path / "wds", 4, 40)
    bad = source / "shard-003.tar"
    bad.write_bytes(bad.read_bytes()[:700] + b"\x07" * 4000)
    with tarfile.open(source / "shard-001.tar", "a") as tar:
        info = tarfile.TarInfo("README")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    return source


def test_a_damaged_tar_is_said_once_and_a_good_shards_warning_too(tmp_path: Path) -> None:
    """The pass's warning about a damaged tar is not said again beside the shard's failure line
    (it was, by the worker, before it); a warning of a shard that is written is said, once."""
    source = _damaged_and_warned(tmp_path)
    runs = {"export -j 2": ["export", str(source), str(tmp_path / "e2"), "-j", "2"],
            "export -j 1": ["export", str(source), str(tmp_path / "e1"), "-j", "1"],
            "index -j 2": ["index", str(source), "--index-dir", str(tmp_path / "i2"), "-j", "2"],
            "pack -j 2": ["pack", str(source), str(tmp_path / "p2"), "-j", "2"]}
    for what, args in runs.items():
        result = atlasfs(*args)
        assert result.returncode == 1 and "Traceback" not in result.stderr, (what, result.stderr)
        damaged = [line for line in result.stderr.splitlines() if "shard-003.tar" in line]
        assert len(damaged) == 1 and ("failed" in damaged[0] or "cannot be read" in damaged[0]), (what, result.stderr)
        if what != "pack -j 2":  # pack stops at its first failure: shard-001 may not have been read
            warned = [line for line in result.stderr.splitlines() if "'README'" in line]
            assert len(warned) == 1 and "no '.' in its file name" in warned[0], (what, result.stderr)
