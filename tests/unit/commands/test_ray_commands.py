"""pack, export, index and verify on a real Ray cluster (``--ray``, issue #38): the same bytes
and lines as the local processes, tasks on both nodes of a two-node cluster, a worker killed
mid-pack, a bad shard said once, Ctrl-C, a cluster started for the command. One cluster for
the session (conftest's ``ray_address``); the commands run as a user runs them, each a
driver of its own."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray") if os.environ.get("CI") != "true" else __import__("ray")

from raydata import (COMMANDS, atlasfs_command, bar_frames, command_args, env, files, ray_calls,  # noqa: E402
                     ray_servers, run, run_on_terminal, same_output, write_tars)

SHARDS = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight WebDataset tars of 400 samples: enough blocks for strategy 2's dictionary."""
    return write_tars(tmp_path_factory.mktemp("ray") / "wds", SHARDS, 400)



@pytest.mark.parametrize("command", COMMANDS)
def test_same_bytes_and_lines_as_local_processes(command: str, dataset: Path, ray_address: str,
                                                 tmp_path: Path) -> None:
    """The cluster from RAY_ADDRESS, ``--ray`` before the positionals (``pack --ray DATASET
    OUTDIR``: DATASET is no address, so it is the dataset)."""
    local, ours = tmp_path / "local", tmp_path / "ray"
    expected = run([*command_args(command, dataset, local), *(["-j", "2"] if command != "verify" else [])])
    assert expected.returncode == 0, expected.stderr
    name, *rest = command_args(command, dataset, ours)
    got = run([name, "--ray", *rest], RAY_ADDRESS=ray_address)
    same_output(expected, got, (local, ours))
    assert "Traceback" not in got.stderr, got.stderr
    if command != "verify":
        assert files(ours) == files(local) and files(ours)


def test_verify_bar_has_its_total_from_the_start_and_q_hides_it(dataset: Path, ray_address: str) -> None:
    """verify --ray's bar, as a terminal shows it: every frame has the same total (the shards'
    bytes, known before any task ran), from the first; with -q no bar and no summary."""
    status, stdout, shown = run_on_terminal(["verify", str(dataset), "--ray", ray_address])
    assert status == 0 and stdout.startswith("verify: OK"), shown
    frames = bar_frames(shown, "verify")
    assert len(frames) >= 2, shown
    totals = [re.search(r"\| *[\d.]+[kMG]?B?/([\d.]+[kMG]?B?) \[", frame) for frame in frames]
    assert all(totals), frames  # a frame without a total: the total came later
    assert len({t.group(1) for t in totals}) == 1, frames
    assert frames[0].startswith("verify:   0%") and frames[-1].startswith("verify: 100%"), frames
    status, stdout, shown = run_on_terminal(["verify", str(dataset), "--ray", ray_address, "-q"])
    assert (status, stdout, shown) == (0, "", ""), (stdout, shown)


def test_two_nodes_share_the_shards(dataset: Path, tmp_path: Path) -> None:
    """A cluster of two nodes on this machine (Ray's own Cluster): the tasks ran on both
    (their node ids, logged with -v) and the dataset is the one the local processes write.
    Meanwhile --ray with no address (and no RAY_ADDRESS) starts a cluster of its own for the
    command, ended with it (none of its servers or agents left): it does not join the one
    running here (Ray would, and refuse the CPUs asked for it with a traceback)."""
    from ray.cluster_utils import Cluster
    local = tmp_path / "local"
    assert run(["pack", str(dataset), str(local), "-j", "2"]).returncode == 0
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ids = {node.node_id for node in cluster.list_all_nodes()}
        ours = tmp_path / "ray"
        got = run(["-v", "pack", str(dataset), str(ours), "--ray", cluster.address])
        before = ray_servers()
        alone = run(["verify", str(dataset), "--ray"])
        deadline = time.monotonic() + 10
        while ray_servers() - before and time.monotonic() < deadline:
            time.sleep(0.1)
        left = ray_servers() - before
    finally:
        cluster.shutdown()
    assert alone.returncode == 0 and alone.stdout.startswith(f"verify: OK ({SHARDS} shards"), alone.stderr
    assert alone.stderr == ""
    assert not left, "the command's cluster outlived it"
    assert got.returncode == 0, got.stderr
    used = set()
    for line in re.findall(r"Ray: \d+ tasks on \d+ node\(s\): (.*)", got.stderr):
        used |= {part.split()[0] for part in line.split(", ")}
    assert used == ids, (ids, got.stderr)
    assert files(ours) == files(local)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Four tars of 2500 samples (a pack long enough to be caught under way) and their pack by
    the local processes (-j 2), made once for the tests that interrupt a --ray pack."""
    folder = tmp_path_factory.mktemp("big")
    source, local = write_tars(folder / "wds", 4, 2500, seed=7), folder / "local"
    assert run(["pack", str(source), str(local), "-j", "2"]).returncode == 0
    return source, local


def test_a_worker_killed_mid_pack_and_the_pack_completes(big: tuple[Path, Path], ray_address: str,
                                                         tmp_path: Path) -> None:
    """SIGKILL to the Ray worker process of a shard being packed: Ray runs its task again
    (max_retries), the pack completes, and its bytes are the local processes'."""
    (source, local), ours = big, tmp_path / "ray"
    process = subprocess.Popen([*atlasfs_command(), "pack", str(source), str(ours), "--ray", ray_address],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    killed = None
    deadline = time.monotonic() + 60
    while killed is None and process.poll() is None and time.monotonic() < deadline:
        calls = ray_calls()
        if calls and (tmp_path / ".ray.pack-partial").is_dir() and any(
                p.name.endswith(".partial") for p in (tmp_path / ".ray.pack-partial").iterdir()):
            killed = calls[0]
            os.kill(killed, signal.SIGKILL)  # a shard's write under way
        time.sleep(0.02)
    stdout, stderr = process.communicate(timeout=120)
    assert killed is not None, "no shard was being written to kill its worker"
    assert process.returncode == 0, stderr
    assert files(ours) == files(local)


def test_a_bad_shard_is_said_once_and_the_others_are_done(dataset: Path, ray_address: str, tmp_path: Path) -> None:
    source = tmp_path / "wds"
    source.mkdir()
    for tar in dataset.iterdir():
        (source / tar.name).write_bytes(tar.read_bytes())
    bad = source / "shard-003.tar"
    bad.write_bytes(bad.read_bytes()[:700] + b"\x07" * 4000)
    with tarfile.open(source / "shard-001.tar", "a") as tar:  # a good shard's warning: its member is left out
        info = tarfile.TarInfo("README")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    for command in ("export", "verify"):
        local = run([*command_args(command, source, tmp_path / f"{command}-local"),
                      *(["-j", "2"] if command != "verify" else [])])
        got = run([*command_args(command, source, tmp_path / f"{command}-ray"), "--ray", ray_address])
        assert got.returncode == local.returncode == 1, (command, got.stderr)
        assert "Traceback" not in got.stderr
        if command == "export":  # its one line; verify says each problem it finds, as in one process
            said = [line for line in (got.stdout + got.stderr).splitlines() if "shard-003" in line]
            assert len(said) == 1, (command, got.stdout, got.stderr)
        same_output(local, got, (tmp_path / f"{command}-local", tmp_path / f"{command}-ray"))
        # the same lines as the local processes' (whose worker said the tar's warning too, before #38's
        # fix), the good shard's warning among them (it stayed in Ray's worker log before)
        expected = local.stderr.replace(str(tmp_path / f"{command}-local"), str(tmp_path / f"{command}-ray"))
        assert sorted(got.stderr.splitlines()) == sorted(expected.splitlines()), (got.stderr, expected)


def test_ctrl_c_cancels_the_tasks_and_says_one_line(big: tuple[Path, Path], ray_address: str, tmp_path: Path) -> None:
    """SIGINT to the command's group while its tasks run: status 130 within 2 s, one line,
    the tasks cancelled, no partial shard left; the same command then completes exactly."""
    (source, local), ours = big, tmp_path / "ray"
    process = subprocess.Popen([*atlasfs_command(), "pack", str(source), str(ours), "--ray", ray_address],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                               start_new_session=True)
    deadline = time.monotonic() + 60
    while not ray_calls() and process.poll() is None:
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
    while ray_calls() and time.monotonic() < deadline:  # cancelled: their workers end
        time.sleep(0.05)
    assert ray_calls() == []
    kept = tmp_path / ".ray.pack-partial"
    assert not kept.exists() or not [p for p in kept.iterdir() if p.name.endswith(".partial")]
    again = run(["pack", str(source), str(ours), "--ray", ray_address])
    assert again.returncode == 0, again.stderr
    assert files(ours) == files(local)


def test_a_local_cluster_started_for_the_command(dataset: Path, tmp_path: Path) -> None:
    """--ray with no address (and no RAY_ADDRESS), Ctrl-C once its tasks run: the cluster
    started for the command is killed with it, within the deadline, none of its servers or
    agents left; one line said. (Its normal end: test_two_nodes_share_the_shards.)"""
    before = ray_servers()
    process = subprocess.Popen([*atlasfs_command(), "pack", str(dataset), str(tmp_path / "out"), "--ray"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                               start_new_session=True)
    deadline = time.monotonic() + 60
    while not ray_calls() and process.poll() is None:
        assert time.monotonic() < deadline, "no task started within 60 s"
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGINT)
    sent = time.monotonic()
    stdout, stderr = process.communicate(timeout=10)
    assert process.returncode == 130 and time.monotonic() - sent < 2, (process.returncode, stderr)
    assert len(stderr.splitlines()) == 1 and stderr.startswith("atlasfs: interrupted: "), stderr
    deadline = time.monotonic() + 5
    while ray_servers() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ray_servers() - before, "the interrupted command's cluster outlived it"


def test_ray_missing_is_one_line(dataset: Path, tmp_path: Path) -> None:
    """Without Ray installed, --ray says what to install (a folder first on the path whose
    ``ray`` cannot be imported stands for an interpreter without it)."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('No module named ray', name='ray')\n")
    environ = {**env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    got = subprocess.run([*atlasfs_command(), "verify", str(dataset), "--ray"], capture_output=True, text=True, env=environ,
                         timeout=60)
    assert got.returncode == 1
    assert got.stderr == "atlasfs: --ray needs Ray (ray cannot be imported): pip install 'atlasfs[ray]'\n"


def test_no_cluster_at_the_address_is_one_line(dataset: Path, tmp_path: Path) -> None:
    """An address where no cluster answers: one line at once (Ray alone retries for minutes)."""
    import socket
    with socket.socket() as unused:  # a port of this machine that nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    started = time.monotonic()
    got = run(["verify", str(dataset), "--ray", f"127.0.0.1:{port}"], timeout=60)
    assert time.monotonic() - started < 30
    assert got.returncode == 1 and got.stdout == ""
    assert got.stderr == (f"atlasfs: --ray 127.0.0.1:{port}: no Ray cluster answers there (Connection refused); "
                          "start one with `ray start --head`, or give its head's host:port\n")
