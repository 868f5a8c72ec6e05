"""The harness every benchmark of ``bench/`` runs in: one argument parser, one work folder, one
``timed``, one report writer.

A probe (``bench/run.py``, ``bench/floor.py``, ``bench/tarview.py``...) keeps only what is its
own: its data and its measurements. It gets from here:

* :func:`parser`: the common flags (``--smoke``, ``--repeat``, ``--out``, ``--json``,
  ``--workdir``/``--keep``), and :func:`add_ratarmount_args` for probes that compare with it;
* :func:`workspace`: a work folder on /dev/shm (or the one ``--workdir`` names, kept), a
  scratch folder, SIGTERM and SIGHUP turned into KeyboardInterrupt so that every mount the
  probe made (each a :class:`bench.systems.System` session) is unmounted on the way out;
* :func:`timed` and :class:`Timed`;
* :func:`write_report`: ``OUT/<name>.md`` (a common header, then the probe's tables; also
  printed on stdout) and ``OUT/<name>.json`` (``{"meta": ..., ...}``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from bench import systems

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
DEFAULT_OUT = os.path.join(BENCH_DIR, "results")
#: /dev/shm when there is one: the page cache of a disk may be reclaimed at any moment (a VM's
#: proactive reclaim does it within seconds), which would make every FUSE figure partly a disk one.
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None
START = time.monotonic()


def log(message: str) -> None:
    """Progress, on stderr, with the seconds since the probe started."""
    print(f"[{time.monotonic() - START:7.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass
class Timed:
    """Seconds taken, and what the timed action answered (for checks across systems)."""

    seconds: float
    answer: Any = None


def timed(action: Callable[[], Any]) -> Timed:
    """Run ``action`` once; its wall-clock seconds (``perf_counter``) and its return value."""
    start = time.perf_counter()
    answer = action()
    return Timed(time.perf_counter() - start, answer)


# -- arguments


def parser(doc: str | None, repeat: int | None = 3) -> argparse.ArgumentParser:
    """An argument parser with the flags every probe has; ``repeat`` is the default of
    ``--repeat`` (1 with ``--smoke``), None for a probe that measures each thing once."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="small sizes, one repeat: seconds, checks that it runs")
    if repeat is not None:
        p.add_argument("--repeat", type=int, help=f"runs of every figure; medians are reported "
                                                  f"(default {repeat}, --smoke 1)")
        p.set_defaults(default_repeat=repeat)
    p.add_argument("--out", help="folder for the report, NAME.md and NAME.json "
                                 "(default bench/results, or bench/results/smoke with --smoke)")
    p.add_argument("--json", help="write the JSON report here instead of OUT/NAME.json")
    p.add_argument("--workdir", "--keep", dest="workdir", metavar="DIR",
                   help="keep the generated data here and reuse it when it matches "
                        "(default: a temporary folder on /dev/shm, removed at the end)")
    return p


def add_ratarmount_args(p: argparse.ArgumentParser) -> None:
    """The flags of probes that compare with ratarmount."""
    p.add_argument("--ratarmount-venv", default=systems.DEFAULT_RATARMOUNT_VENV,
                   help="virtualenv for ratarmount, created and installed from PyPI if missing "
                        "(default bench/.venv-ratarmount)")
    p.add_argument("--no-ratarmount", action="store_true", help="skip ratarmount (its figures are reported missing)")
    p.add_argument("--no-install", action="store_true", help="do not install ratarmount if it is missing")


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p.parse_args(argv)`` with the common defaults filled in (``repeat``, ``out``), and the
    command line kept (``args.argv``) for the report."""
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if hasattr(args, "default_repeat"):
        args.repeat = args.repeat or (1 if args.smoke else args.default_repeat)
        if args.repeat < 1:
            p.error("--repeat must be >= 1")
    args.out = args.out or (os.path.join(DEFAULT_OUT, "smoke") if args.smoke else DEFAULT_OUT)
    return args


def ratarmount(args: argparse.Namespace) -> tuple[str | None, str, str | None]:
    """(executable, version, None), or (None, "missing", why not) per the ratarmount flags;
    installs it into its own virtualenv when missing (never into the project's)."""
    if args.no_ratarmount:
        return None, "missing", "skipped (--no-ratarmount)"
    try:
        executable, version = systems.ensure_ratarmount(args.ratarmount_venv, log, install=not args.no_install)
    except systems.SystemUnavailable as exc:
        log(f"ratarmount figures are MISSING: {exc}")
        return None, "missing", str(exc)
    return executable, version, None


# -- the work folder


@dataclass
class Workspace:
    """Where a probe's data lives (``workdir``: kept when the user named it) and a scratch
    folder on tmpfs (always removed)."""

    workdir: str
    scratch: str
    kept: bool


@contextlib.contextmanager
def workspace(name: str, args: argparse.Namespace) -> Iterator[Workspace]:
    """The probe's folders, removed on the way out (the work folder only if it was not named).
    Folders are named ``atlasfs-bench-<name>-*``, so are the mount points inside them: the smoke
    tests look for mounts left behind by that name."""
    systems.stop_on_signals()
    kept = args.workdir is not None
    workdir = os.path.abspath(args.workdir) if kept else tempfile.mkdtemp(prefix=f"atlasfs-bench-{name}-", dir=SHM)
    os.makedirs(workdir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f"atlasfs-bench-{name}-scratch-", dir=SHM)
    try:
        yield Workspace(workdir, scratch, kept)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not kept:
            shutil.rmtree(workdir, ignore_errors=True)


def kept(stamp_path: str, key: dict[str, Any]) -> dict[str, Any] | None:
    """What :func:`keep` recorded in ``stamp_path`` with the data it stamps, if it was made from
    ``key`` (the generator's version and its settings); None if not, or if there is no stamp."""
    try:
        with open(stamp_path) as f:
            done = json.load(f)
    except FileNotFoundError:
        return None
    return done if isinstance(done, dict) and done.get("key") == key else None


def keep(stamp_path: str, key: dict[str, Any], **facts: Any) -> None:
    """Stamp kept data as made from ``key``, with ``facts`` about it (JSON) for :func:`kept`."""
    with open(stamp_path, "w") as f:
        json.dump({"key": key, **facts}, f)


def export_files(atlas: str, files: str) -> list[str]:
    """The files of the Atlas dataset ``atlas`` as ``atlasfs export`` writes them, extracted
    into ``files/<shard>/`` (the tars made beside ``files`` and removed); the shard names."""
    tars = os.path.join(os.path.dirname(os.path.abspath(files)), "tars")
    result = subprocess.run([sys.executable, "-m", "atlasfs", "export", atlas, tars], capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"atlasfs export {atlas} failed: {result.stderr.strip()[-500:]}")
    shards = sorted(f[:-4] for f in os.listdir(tars) if f.endswith(".tar"))
    for shard in shards:
        os.makedirs(os.path.join(files, shard))
        subprocess.run(["tar", "xf", os.path.join(tars, f"{shard}.tar"), "-C", os.path.join(files, shard)],
                       check=True)
    shutil.rmtree(tars)
    return shards


def fstype(path: str) -> str:
    """The type of the file system holding ``path`` (``tmpfs``, ``ext4``...)."""
    result = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, check=False, text=True)
    return result.stdout.strip() or "unknown"


# -- the report


def git(*args: str) -> str:
    """``git -C REPO ARGS``' output, "" if git fails."""
    try:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, check=False, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


_LOAD_AT_START = os.getloadavg()


def meta(script: str, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """What every report says about its run: date, code, host, command, duration, load."""
    from atlasfs import __version__

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "atlasfs": f"{__version__} (commit {git('rev-parse', '--short', 'HEAD') or '?'}"
                   f"{', with uncommitted changes' if dirty else ''})",
        "host": systems.host(),
        "command": " ".join([f"python bench/{script}", shlex.join(args.argv)]).strip(),
        "load": " ".join(f"{x:.2f}" for x in _LOAD_AT_START),
        "smoke": bool(getattr(args, "smoke", False)),
        "seconds": time.monotonic() - START,
        **extra,
    }


def header(title: str, meta_: dict[str, Any]) -> list[str]:
    """The Markdown lines every report starts with."""
    lines = [f"# {title}", "",
             f"- date: {meta_['date']}",
             f"- atlasfs: {meta_['atlasfs']}",
             f"- host: {meta_['host']}; load average at start: {meta_['load']}",
             f"- command: `{meta_['command']}`",
             f"- run time: {meta_['seconds']:.0f} s"]
    lines += [f"- {note}" for note in meta_.get("notes", [])]
    return lines + [""]


def write_report(name: str, args: argparse.Namespace, title: str, body: list[str], meta_: dict[str, Any],
                 data: dict[str, Any]) -> str:
    """Write ``OUT/<name>.md`` (the header, then ``body``) and the JSON report (``{"meta": meta_,
    **data}``, to ``--json`` or ``OUT/<name>.json``), each atomically; print the Markdown on
    stdout; return it."""
    text = "\n".join(header(title, meta_) + body).rstrip("\n") + "\n"
    os.makedirs(args.out, exist_ok=True)
    md = os.path.join(args.out, f"{name}.md")
    js = args.json or os.path.join(args.out, f"{name}.json")
    for path, content in ((md, text), (js, json.dumps({"meta": meta_, **data}, indent=1) + "\n")):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(content)
        os.replace(path + ".tmp", path)
    print(text, end="", flush=True)
    log(f"wrote {md} and {js}")
    return text


def table(header_cells: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table."""
    return (["| " + " | ".join(header_cells) + " |", "|" + " --- |" * len(header_cells)]
            + ["| " + " | ".join(row) + " |" for row in rows])


def run_main(main: Callable[[], int]) -> None:
    """``sys.exit(main())``; a stopped probe (Ctrl-C, SIGTERM, SIGHUP) exits 130, after its
    sessions have unmounted on the way out."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench: interrupted (every mount was unmounted on the way out)", file=sys.stderr)
        sys.exit(130)
