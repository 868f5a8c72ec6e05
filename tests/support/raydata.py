"""Helpers of the tests of Ray (--ray, atlasfs.ray): WebDataset tars to read, the command line
as a user runs it (each command a driver of its own), and what runs on this machine."""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import subprocess
import sys
import tarfile
from pathlib import Path

#: The four commands that take --ray.
COMMANDS = ("pack", "export", "index", "verify")


def atlasfs_command() -> list[str]:
    script = Path(sys.executable).parent / "atlasfs"
    return [str(script)] if script.exists() else [sys.executable, "-m", "atlasfs"]


def env() -> dict[str, str]:
    """This environment without the session driver's RAY_ADDRESS (each command says its own)."""
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def write_tars(folder: Path, shards: int, samples: int, seed: int = 38) -> Path:
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


def command_args(command: str, dataset: Path, out: Path) -> list[str]:
    return {"pack": ["pack", str(dataset), str(out)], "export": ["export", str(dataset), str(out)],
            "index": ["index", str(dataset), "--index-dir", str(out)], "verify": ["verify", str(dataset)]}[command]


def run(args: list[str], timeout: float = 120, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """The command line with ``args``, as a user runs it (``extra_env``: RAY_ADDRESS...)."""
    return subprocess.run([*atlasfs_command(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**env(), **extra_env})


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def same_output(local: subprocess.CompletedProcess[str], ours: subprocess.CompletedProcess[str],
                 paths: tuple[Path, Path]) -> None:
    assert ours.returncode == local.returncode, ours.stderr
    strip = lambda text, path: re.sub(r" in [\d.]+ s", "", text.replace(str(path), "OUT"))  # noqa: E731
    # lines in the order shards finish (as with local processes): the same lines
    assert sorted(strip(ours.stdout, paths[1]).splitlines()) == sorted(strip(local.stdout, paths[0]).splitlines())


def ray_calls() -> list[int]:
    """Ray worker processes running a task of ours (Ray titles them ``ray::_call``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "cmdline").read_bytes().startswith(b"ray::_call"):
                    found.append(int(entry.name))
    return found


def ray_servers() -> set[int]:
    """Processes of Ray's servers and agents on this machine (raylet, gcs_server, ray::...Agent...)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                line = (entry / "cmdline").read_bytes().split(b"\0")[0]
                if line.endswith((b"raylet", b"gcs_server")) or b"Agent" in line or b"dashboard" in line:
                    found.add(int(entry.name))
    return found


def tar_samples(folder: Path) -> list[dict[str, object]]:
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


def ordered() -> None:
    from ray.data import DataContext
    DataContext.get_current().execution_options.preserve_order = True


def run_on_terminal(args: list[str], timeout: float = 120, **extra_env: str) -> tuple[int, str, str]:
    """Run the command line with its stderr on a terminal (a pty of 120 columns), as a user
    sees its bar: ``(status, stdout, what the terminal showed)``."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen([*atlasfs_command(), *args], stdout=subprocess.PIPE, stderr=side, text=True,
                               env={**env(), **extra_env})
    os.close(side)
    shown = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the last holder of the terminal's other side ended
                break
            if not chunk:
                break
            shown += chunk
        elif process.poll() is not None:
            break
    os.close(main)
    stdout, _ = process.communicate(timeout=timeout)
    return process.returncode, stdout, shown.decode(errors="replace")


def bar_frames(shown: str, label: str) -> list[str]:
    """The frames of the bar ``label`` a terminal showed (tqdm redraws it after each ``\\r``)."""
    frames = [part.strip() for part in re.split(r"[\r\n]", shown)]
    return [frame for frame in frames if frame.startswith(f"{label}:")]


#: The pipeline's dataset, written once per test session (:func:`pipeline_once`).
_PIPELINE: dict[str, tuple[Path, list[dict[str, object]]]] = {}


def pipeline_once(factory: object) -> tuple[Path, list[dict[str, object]]]:
    """WebDataset -> Ray Data (a transform) -> Atlas in one pipeline, on the session's cluster;
    the dataset written and the samples it must hold. Written once per session: two test
    modules read it (tests/unit/ray/ and tests/mount/), and a Ray Data pipeline costs tens of
    seconds on a loaded 2-core machine. Read only: a test writes nothing into it."""
    if "written" not in _PIPELINE:
        from atlasfs.ray import read_atlas, write_atlas
        ordered()
        dataset = write_tars(factory.mktemp("pipeline-wds") / "wds", 8, 400)  # type: ignore[attr-defined]
        out = factory.mktemp("pipeline") / "atlas"  # type: ignore[attr-defined]

        def shout(row: dict) -> dict:
            return {**row, "txt": row["txt"].upper()}
        write_atlas(read_atlas(str(dataset)).map(shout), str(out), shard_size=700, block_size=32)
        _PIPELINE["written"] = (out, [{**s, "txt": s["txt"].upper()} for s in tar_samples(dataset)])
    return _PIPELINE["written"]
