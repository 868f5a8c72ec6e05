"""pack, export, index and verify on a real Ray cluster (``--ray``, issue #38): the same bytes
and lines as the local processes, tasks on both nodes of a two-node cluster, a worker killed
mid-pack, a bad shard said once, Ctrl-C. One cluster for the session (conftest's
``ray_address``); the commands run as a user runs them, each a driver of its own."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray") if os.environ.get("CI") != "true" else __import__("ray")

SHARDS = 8
COMMANDS = ("pack", "export", "index", "verify")


def _command() -> list[str]:
    script = Path(sys.executable).parent / "atlasfs"
    return [str(script)] if script.exists() else [sys.executable, "-m", "atlasfs"]


def _env() -> dict[str, str]:
    """This environment without the session driver's RAY_ADDRESS (each command says its own)."""
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def _write_tars(folder: Path, shards: int, samples: int, seed: int = 38) -> Path:
    folder.mkdir(parents=True)
    rng = random.Random(seed)
    for t in range(shards):
        with tarfile.open(folder / f"shard-{t:03d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(samples):
                for ext, data in (("txt", f"sample {t} {i} ".encode() * rng.randint(1, 20)),
                                  ("bin", rng.randbytes(200))):
                    info = tarfile.TarInfo(f"s{t:03d}_{i:04d}.{ext}")
                    info.size, info.mtime = len(data), 0
                    tar.addfile(info, io.BytesIO(data))
    return folder


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight WebDataset tars of 400 samples: enough blocks for strategy 2's dictionary."""
    return _write_tars(tmp_path_factory.mktemp("ray") / "wds", SHARDS, 400)


def _args(command: str, dataset: Path, out: Path) -> list[str]:
    return {"pack": ["pack", str(dataset), str(out)], "export": ["export", str(dataset), str(out)],
            "index": ["index", str(dataset), "--index-dir", str(out)], "verify": ["verify", str(dataset)]}[command]


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_command(), *args], capture_output=True, text=True, timeout=timeout, env=_env())


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _same_output(local: subprocess.CompletedProcess[str], ours: subprocess.CompletedProcess[str],
                 paths: tuple[Path, Path]) -> None:
    assert ours.returncode == local.returncode, ours.stderr
    strip = lambda text, path: re.sub(r" in [\d.]+ s", "", text.replace(str(path), "OUT"))  # noqa: E731
    # lines in the order shards finish (as with local processes): the same lines
    assert sorted(strip(ours.stdout, paths[1]).splitlines()) == sorted(strip(local.stdout, paths[0]).splitlines())


def _ray_calls() -> list[int]:
    """Ray worker processes running a task of ours (Ray titles them ``ray::_call``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "cmdline").read_bytes().startswith(b"ray::_call"):
                    found.append(int(entry.name))
    return found


@pytest.mark.parametrize("command", COMMANDS)
def test_same_bytes_and_lines_as_local_processes(command: str, dataset: Path, ray_address: str,
                                                 tmp_path: Path) -> None:
    local, ours = tmp_path / "local", tmp_path / "ray"
    expected = _run([*_args(command, dataset, local), *(["-j", "2"] if command != "verify" else [])])
    assert expected.returncode == 0, expected.stderr
    got = _run([*_args(command, dataset, ours), "--ray", ray_address])
    _same_output(expected, got, (local, ours))
    assert "Traceback" not in got.stderr, got.stderr
    if command != "verify":
        assert _files(ours) == _files(local) and _files(ours)


def test_two_nodes_share_the_shards(dataset: Path, tmp_path: Path) -> None:
    """A cluster of two nodes on this machine (Ray's own Cluster): the tasks ran on both
    (their node ids, logged with -v) and the dataset is the one the local processes write."""
    from ray.cluster_utils import Cluster
    local = tmp_path / "local"
    assert _run(["pack", str(dataset), str(local), "-j", "2"]).returncode == 0
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ids = {node.node_id for node in cluster.list_all_nodes()}
        ours = tmp_path / "ray"
        got = _run(["-v", "pack", str(dataset), str(ours), "--ray", cluster.address])
    finally:
        cluster.shutdown()
    assert got.returncode == 0, got.stderr
    used = set()
    for line in re.findall(r"Ray: \d+ tasks on \d+ node\(s\): (.*)", got.stderr):
        used |= {part.split()[0] for part in line.split(", ")}
    assert used == ids, (ids, got.stderr)
    assert _files(ours) == _files(local)


def test_a_worker_killed_mid_pack_and_the_pack_completes(ray_address: str, tmp_path: Path) -> None:
    """SIGKILL to the Ray worker process of a shard being packed: Ray runs its task again
    (max_retries), the pack completes, and its bytes are the local processes'."""
    source = _write_tars(tmp_path / "big", 4, 2500, seed=7)
    local, ours = tmp_path / "local", tmp_path / "ray"
    assert _run(["pack", str(source), str(local), "-j", "2"]).returncode == 0
    process = subprocess.Popen([*_command(), "pack", str(source), str(ours), "--ray", ray_address],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    killed = None
    deadline = time.monotonic() + 60
    while killed is None and process.poll() is None and time.monotonic() < deadline:
        calls = _ray_calls()
        if calls and (tmp_path / ".ray.pack-partial").is_dir() and any(
                p.name.endswith(".partial") for p in (tmp_path / ".ray.pack-partial").iterdir()):
            killed = calls[0]
            os.kill(killed, signal.SIGKILL)  # a shard's write under way
        time.sleep(0.02)
    stdout, stderr = process.communicate(timeout=120)
    assert killed is not None, "no shard was being written to kill its worker"
    assert process.returncode == 0, stderr
    assert _files(ours) == _files(local)


def test_a_bad_shard_is_said_once_and_the_others_are_done(dataset: Path, ray_address: str, tmp_path: Path) -> None:
    source = tmp_path / "wds"
    source.mkdir()
    for tar in dataset.iterdir():
        (source / tar.name).write_bytes(tar.read_bytes())
    bad = source / "shard-003.tar"
    bad.write_bytes(bad.read_bytes()[:700] + b"\x07" * 4000)
    for command in ("export", "verify"):
        local = _run([*_args(command, source, tmp_path / f"{command}-local"),
                      *(["-j", "2"] if command != "verify" else [])])
        got = _run([*_args(command, source, tmp_path / f"{command}-ray"), "--ray", ray_address])
        assert got.returncode == local.returncode == 1, (command, got.stderr)
        assert "Traceback" not in got.stderr
        if command == "export":  # its one line; verify says each problem it finds, as in one process
            said = [line for line in (got.stdout + got.stderr).splitlines() if "shard-003" in line]
            assert len(said) == 1, (command, got.stdout, got.stderr)
        _same_output(local, got, (tmp_path / f"{command}-local", tmp_path / f"{command}-ray"))
        # the local workers also log the source's warning about the tar: the line is its failure's
        expected = local.stderr.replace(str(tmp_path / f"{command}-local"), str(tmp_path / f"{command}-ray"))
        assert set(got.stderr.splitlines()) <= set(expected.splitlines()), (got.stderr, expected)


def test_ctrl_c_cancels_the_tasks_and_says_one_line(ray_address: str, tmp_path: Path) -> None:
    """SIGINT to the command's group while its tasks run: status 130 within 2 s, one line,
    the tasks cancelled, no partial shard left; the same command then completes exactly."""
    source = _write_tars(tmp_path / "big", 4, 2500, seed=8)
    local, ours = tmp_path / "local", tmp_path / "ray"
    assert _run(["pack", str(source), str(local), "-j", "2"]).returncode == 0
    process = subprocess.Popen([*_command(), "pack", str(source), str(ours), "--ray", ray_address],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                               start_new_session=True)
    deadline = time.monotonic() + 60
    while not _ray_calls() and process.poll() is None:
        assert time.monotonic() < deadline, "no task started within 60 s"
        time.sleep(0.02)
    time.sleep(0.3)
    assert process.poll() is None, process.communicate()
    os.killpg(process.pid, signal.SIGINT)
    sent = time.monotonic()
    stdout, stderr = process.communicate(timeout=10)
    took = time.monotonic() - sent
    assert process.returncode == 130, stderr
    assert took < 2, f"exited {took:.2f} s after Ctrl-C"
    assert len(stderr.splitlines()) == 1 and stderr.startswith("atlasfs: interrupted: "), stderr
    deadline = time.monotonic() + 5
    while _ray_calls() and time.monotonic() < deadline:  # cancelled: their workers end
        time.sleep(0.05)
    assert _ray_calls() == []
    kept = tmp_path / ".ray.pack-partial"
    assert not kept.exists() or not [p for p in kept.iterdir() if p.name.endswith(".partial")]
    again = _run(["pack", str(source), str(ours), "--ray", ray_address])
    assert again.returncode == 0, again.stderr
    assert _files(ours) == _files(local)


def test_a_local_cluster_started_for_the_command(dataset: Path, tmp_path: Path) -> None:
    """--ray with no address (and no RAY_ADDRESS): a cluster of this machine started for the
    command and ended with it (none of its servers or agents left), also on Ctrl-C; nothing said
    but the result."""
    before = _ray_servers()
    got = _run(["verify", str(dataset), "--ray"])
    assert got.returncode == 0 and got.stdout.startswith(f"verify: OK ({SHARDS} shards"), got.stderr
    assert got.stderr == ""
    deadline = time.monotonic() + 10
    while _ray_servers() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _ray_servers() - before, "the command's cluster outlived it"
    # Ctrl-C once its tasks run: the cluster is killed with the command, within the deadline
    process = subprocess.Popen([*_command(), "pack", str(dataset), str(tmp_path / "out"), "--ray"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                               start_new_session=True)
    deadline = time.monotonic() + 60
    while not _ray_calls() and process.poll() is None:
        assert time.monotonic() < deadline, "no task started within 60 s"
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGINT)
    sent = time.monotonic()
    stdout, stderr = process.communicate(timeout=10)
    assert process.returncode == 130 and time.monotonic() - sent < 2, (process.returncode, stderr)
    assert len(stderr.splitlines()) == 1 and stderr.startswith("atlasfs: interrupted: "), stderr
    deadline = time.monotonic() + 5
    while _ray_servers() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _ray_servers() - before, "the interrupted command's cluster outlived it"


def _ray_servers() -> set[int]:
    """Processes of Ray's servers and agents on this machine (raylet, gcs_server, ray::...Agent...)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                line = (entry / "cmdline").read_bytes().split(b"\0")[0]
                if line.endswith((b"raylet", b"gcs_server")) or b"Agent" in line or b"dashboard" in line:
                    found.add(int(entry.name))
    return found


def test_ray_missing_is_one_line(dataset: Path, tmp_path: Path) -> None:
    """Without Ray installed, --ray says what to install (a folder first on the path whose
    ``ray`` cannot be imported stands for an interpreter without it)."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('No module named ray', name='ray')\n")
    env = {**_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    got = subprocess.run([*_command(), "verify", str(dataset), "--ray"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert got.returncode == 1
    assert got.stderr == "atlasfs: --ray needs Ray (ray cannot be imported): pip install 'atlasfs[ray]'\n"


# -- Atlas in Ray Data (atlasfs.ray)


def _tar_samples(folder: Path) -> list[dict[str, object]]:
    """The samples of the tars of ``folder`` in order: ``__key__`` and each member's bytes."""
    samples: list[dict[str, object]] = []
    for tar_path in sorted(folder.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            for member in tar.getmembers():
                key, suffix = member.name.split(".", 1)
                if not samples or samples[-1]["__key__"] != key:
                    samples.append({"__key__": key})
                samples[-1][suffix] = tar.extractfile(member).read()
    return samples


def _ordered() -> None:
    from ray.data import DataContext
    DataContext.get_current().execution_options.preserve_order = True


def test_read_atlas_gives_the_samples_in_order_from_any_format(dataset: Path, ray_address: str,
                                                               tmp_path: Path) -> None:
    from atlasfs.ray import read_atlas
    _ordered()
    expected = _tar_samples(dataset)
    assert [dict(row) for row in read_atlas(str(dataset)).take_all()] == expected
    packed = tmp_path / "packed"
    assert _run(["pack", str(dataset), str(packed), "-j", "2"]).returncode == 0
    assert [dict(row) for row in read_atlas(str(packed)).take_all()] == expected
    decoded = read_atlas(str(packed), decode=True).take(3)
    assert [row["txt"] for row in decoded] == [s["txt"].decode() for s in expected[:3]]
    assert [row["bin"] for row in decoded] == [s["bin"] for s in expected[:3]]


@pytest.fixture(scope="module")
def pipeline(dataset: Path, ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """WebDataset -> Ray Data (a transform) -> Atlas in one pipeline; the dataset written
    and the samples it must hold."""
    from atlasfs.ray import read_atlas, write_atlas
    _ordered()
    out = tmp_path_factory.mktemp("pipeline") / "atlas"

    def shout(row: dict) -> dict:
        return {**row, "txt": row["txt"].upper()}
    write_atlas(read_atlas(str(dataset)).map(shout), str(out), shard_size=700, block_size=32)
    expected = [{**s, "txt": s["txt"].upper()} for s in _tar_samples(dataset)]
    return out, expected


def test_webdataset_to_atlas_in_one_pipeline(pipeline: tuple[Path, list]) -> None:
    from atlasfs.formats.atlas.dataset import AtlasDataset
    out, expected = pipeline
    root = json.loads((out / "meta.json").read_text())
    assert root["compression_strategy"] == 2 and (out / "zstd_dict.bin").is_file()
    assert root["shard_sizes"] == [700, 700, 700, 700, 400] and len(expected) == 3200
    reader = AtlasDataset(out)
    assert [dict(reader[i]) for i in range(len(reader))] == expected
    check = _run(["verify", str(out)])
    assert check.returncode == 0 and check.stdout.startswith("verify: OK"), check.stdout + check.stderr
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # the temporary folder went


@pytest.mark.fuse
def test_the_pipeline_s_dataset_mounts(pipeline: tuple[Path, list]) -> None:
    from fusemount import mounted
    out, expected = pipeline
    with mounted(out) as mnt:
        shown = {p.relative_to(mnt).as_posix().split("/", 1)[1]: p.read_bytes()
                 for p in sorted(mnt.rglob("*")) if p.is_file()}
    assert shown == {f"{s['__key__']}.{suffix}": data for s in expected for suffix, data in s.items()
                     if suffix != "__key__"}


def test_no_cluster_at_the_address_is_one_line(dataset: Path, tmp_path: Path) -> None:
    """An address where no cluster answers: one line at once (Ray alone retries for minutes)."""
    import socket
    with socket.socket() as unused:  # a port of this machine that nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    started = time.monotonic()
    got = _run(["verify", str(dataset), "--ray", f"127.0.0.1:{port}"], timeout=60)
    assert time.monotonic() - started < 30
    assert got.returncode == 1 and got.stdout == ""
    assert got.stderr == (f"atlasfs: --ray 127.0.0.1:{port}: no Ray cluster answers there (Connection refused); "
                          "start one with `ray start --head`, or give its head's host:port\n")
