"""The command line as a newcomer meets it (issue #37, point 5): progress bars whose total is
known from the start, ``-q`` and a closing summary, one line for a misspelled flag (with a
suggestion) or a bad value, a closed pipe ending quietly, one problem said once, hints where
a path is a shard folder or inside the dataset, an index folder that cannot be written,
``demo`` with the umask's modes, ``pack`` saying when it fell back, and ``make demo``'s script.
Every command runs as a user runs it: ``python -m atlasfs`` in a subprocess, bars on a pty."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import termios
from pathlib import Path

import pytest

from atlasfs import AtlasWriter
from fusemount import atlasfs, is_mounted
from helpers import REFERENCE, SHARED_DICT


TWELVE = REFERENCE / "s2_twelve_shards" / "dataset"


#: One frame of a tqdm bar: "label:  42%|####  | 1.2k/3.4k [..." (the done and total counts).
FRAME = re.compile(r"^(?P<label>\w+): +(?P<percent>\d+)%\|[^|]*\| *(?P<done>[\d.]+\w?)/(?P<total>[\d.]+\w?) ")


def on_terminal(*args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run ``atlasfs ARGS`` with stderr on a pseudo-terminal (120 columns: where tqdm draws
    its bars) and stdout a pipe; returns the run (its stderr the terminal's text) and the
    bars' frames as drawn, in order."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "atlasfs", *args], stdout=subprocess.PIPE, stderr=slave,
                               stdin=subprocess.DEVNULL, text=True)
    os.close(slave)
    drawn = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the terminal's last holder exited
            break
        if not chunk:
            break
        drawn.append(chunk)
    stdout = process.stdout.read()  # type: ignore[union-attr]
    process.wait(timeout=120)
    os.close(master)
    terminal = b"".join(drawn).decode(errors="replace")
    frames = [f.strip() for f in re.split(r"[\r\n]", terminal) if f.strip()]
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, terminal), frames


def _many_shards(path: Path, shards: int = 12) -> Path:
    with AtlasWriter(path, shard_size=300, block_size=20, compression_strategy=1) as writer:
        writer.add_examples({"txt": f"example {i} " * 40, "cls": i} for i in range(shards * 300))
    return path


def test_export_bar_knows_its_total_from_the_start(tmp_path: Path) -> None:
    """The bar's total was grown as each shard started (a 400-shard export showed 97% and
    00:00 left most of the run): now every frame, the first included, shows the same total,
    the shards' bytes summed before any is read, and the last one 100%."""
    dataset = _many_shards(tmp_path / "ds")
    result, frames = on_terminal("export", "-j", "2", str(dataset), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    bars = [FRAME.match(frame) for frame in frames]
    assert frames and all(bars), frames  # nothing else on the terminal
    assert {bar["total"] for bar in bars} == {bars[-1]["total"]}, frames  # type: ignore[index]
    assert bars[0]["percent"] == "0" and bars[-1]["percent"] == "100", frames  # type: ignore[index]
    assert bars[-1]["done"] == bars[-1]["total"], frames  # type: ignore[index]


def test_export_says_one_closing_line_and_each_tar_only_with_verbose(tmp_path: Path) -> None:
    """400 shards were 400 lines and no total: now one line (shards, samples, bytes, time,
    the index); -v adds a line per tar, -q says nothing (no bar on a terminal either)."""
    dataset = _many_shards(tmp_path / "ds")
    result = atlasfs("export", str(dataset), str(tmp_path / "out"))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    size = sum(p.stat().st_size for p in (tmp_path / "out").glob("*.tar"))
    [line] = result.stdout.splitlines()
    assert re.fullmatch(rf"exported 12 shards \(3600 samples, [\d.]+ MiB\) to {re.escape(str(tmp_path / 'out'))} "
                        rf"in [\d.]+ s; wids index: {re.escape(str(tmp_path / 'out' / 'shards.json'))}", line), line
    assert f"{size / 2**20:.1f} MiB" in line
    loud = atlasfs("export", "-v", str(dataset), str(tmp_path / "loud"))
    lines = loud.stdout.splitlines()
    assert len(lines) == 13 and lines[-1].startswith("exported 12 shards"), lines
    assert sorted(lines[:-1])[0].startswith(f"{tmp_path / 'loud' / '00.tar'}: 300 samples, 600 files, "), lines
    quiet, frames = on_terminal("export", "-q", str(dataset), str(tmp_path / "quiet"))
    assert quiet.returncode == 0 and quiet.stdout == "" and frames == [], (quiet, frames)
    assert len(list((tmp_path / "quiet").glob("*.tar"))) == 12


@pytest.mark.parametrize("command", ["verify", "index", "pack"])
def test_quiet_says_nothing_when_all_is_well_and_what_went_wrong_otherwise(tmp_path: Path, command: str) -> None:
    """-q in verify, index and pack as in export: no bar, no summary; a problem is still said."""
    dataset = Path(shutil.copytree(SHARED_DICT, tmp_path / "ds"))
    args = {"verify": ["verify", str(dataset)], "index": ["index", str(dataset), "--index-dir", str(tmp_path / "t")],
            "pack": ["pack", str(dataset), str(tmp_path / "packed")]}[command]
    loud, frames = on_terminal(*args)
    assert loud.returncode == 0 and loud.stdout and frames, (loud, frames)
    shutil.rmtree(tmp_path / "packed", ignore_errors=True)
    shutil.rmtree(tmp_path / "t", ignore_errors=True)
    quiet, frames = on_terminal(*args, "-q")
    assert quiet.returncode == 0 and quiet.stdout == "" and frames == [], (quiet, frames)
    (dataset / "1" / "data.bin").write_bytes((dataset / "1" / "data.bin").read_bytes()[:-20])
    broken = atlasfs(*args[:2], "-q", *args[2:] if command != "pack" else [str(tmp_path / "again")])
    assert broken.returncode == 1 and str(dataset / "1" / "data.bin") in broken.stdout + broken.stderr, broken


def test_a_misspelled_flag_is_one_line_naming_it_with_a_suggestion(tmp_path: Path) -> None:
    """`mount --cachesize 1G ds mnt` printed the top-level usage, then 'unrecognized
    arguments: --cachesize mnt' (blaming the mount point, the flag's value taken for the
    dataset); a bad value printed the command's 8-line usage above its error."""
    result = atlasfs("mount", "--cachesize", "1G", "ds", "mnt")
    assert result.returncode == 2
    assert result.stderr == "atlasfs mount: --cachesize: no such flag (did you mean --cache-size?)\n", result.stderr
    result = atlasfs("show", "--dedline", "3", str(SHARED_DICT), "0")  # its index took the dataset: still the flag
    assert result.stderr == "atlasfs show: --dedline: no such flag (did you mean --deadline?)\n", result.stderr
    result = atlasfs("mount", "--cache-size", "lots", "ds", "mnt")
    assert result.returncode == 2
    assert result.stderr == ("atlasfs mount: argument --cache-size: not a size: 'lots' (examples: 268435456, 512M, 1G)\n"), \
        result.stderr
    result = atlasfs("info", str(SHARED_DICT), "--zzz")
    assert result.stderr == "atlasfs info: --zzz: no such flag (atlasfs info --help lists them)\n", result.stderr
    result = atlasfs("mout", "ds", "mnt")
    assert result.stderr.startswith("atlasfs: argument COMMAND: invalid choice 'mout' (did you mean 'mount'?)"), result.stderr
    result = atlasfs("info", str(SHARED_DICT), "extra")
    assert result.stderr == "atlasfs info: unexpected argument: 'extra'\n", result.stderr
    for args in (["mount", "ds"], ["pack", "ds", "out", "--strategy", "9"], []):
        result = atlasfs(*args)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and "usage" not in result.stderr, result
    # what still parses: a negative index, a short flag with its value attached, a long prefix
    assert atlasfs("show", str(SHARED_DICT), "-1").returncode == 0
    assert atlasfs("export", "-j1", "--sha", "2", "--", str(SHARED_DICT), str(tmp_path / "o")).returncode == 0


def test_help_says_what_atlasfs_is_for_every_format() -> None:
    from atlasfs.formats.factory import FORMATS
    result = atlasfs("--help")
    text = " ".join(result.stdout.split())
    assert result.returncode == 0 and "Atlas datasets" not in text
    assert f"Formats: {', '.join(FORMATS)}" in text, text


@pytest.mark.parametrize("args", [["info", "{ds}"], ["verify", "{ds}"], ["show", "{ds}", "0"], ["cache"],
                                  ["export", "-v", "{ds}", "{tmp}/out"], ["index", "{ds}", "--index-dir", "{tmp}/t"],
                                  ["demo", "{tmp}/demo"]])
def test_output_whose_reader_left_ends_quietly(tmp_path: Path, args: list[str]) -> None:
    """`atlasfs info DS | head -5` ended with 'atlasfs: Broken pipe' (status 1). Now a
    command whose reader is gone before it prints says nothing and exits as a tool killed
    by SIGPIPE is seen by the shell: 141."""
    dataset = shutil.copytree(SHARED_DICT, tmp_path / "ds")
    argv = [a.format(ds=dataset, tmp=tmp_path) for a in args]
    process = subprocess.Popen([sys.executable, "-m", "atlasfs", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # type: ignore[union-attr]  # the reader is gone before anything is printed
    stderr = process.stderr.read()  # type: ignore[union-attr]
    assert process.wait(timeout=60) == 141 and stderr == "", (process.returncode, stderr)


def _small_tar(tar: Path, keys: list[str]) -> Path:
    """A WebDataset tar of a ``txt`` and a ``cls`` member for each key."""
    with tarfile.open(tar, "w", format=tarfile.USTAR_FORMAT) as archive:
        for key in keys:
            for ext in ("txt", "cls"):
                data = f"sample {key}".encode()
                member = tarfile.TarInfo(f"{key}.{ext}")
                member.size = len(data)
                archive.addfile(member, io.BytesIO(data))
    return tar


def test_verify_of_a_cut_off_tar_says_its_problem_once(tmp_path: Path) -> None:
    """The tar's walk and its last block's decode both found the cut: printed twice, counted 2."""
    (tmp_path / "wds").mkdir()
    tar = _small_tar(tmp_path / "wds" / "a.tar", [f"s{i}" for i in range(6)])
    tar.write_bytes(tar.read_bytes()[:512 * 17 + 100])
    result = atlasfs("verify", str(tmp_path / "wds"))
    assert result.returncode == 1 and result.stderr == "", result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{tar} sample 's4': may lack files, as the tar after it is cut"), \
        lines
    assert lines[1].startswith("verify: 1 problem(s)"), lines


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_pack_of_a_damaged_tar_says_its_problem_once(tmp_path: Path, jobs: str) -> None:
    """With -j 1 the tar walk's warning came first, then pack's line saying the same again."""
    (tmp_path / "wds").mkdir()
    for n in range(2):
        _small_tar(tmp_path / "wds" / f"{n}.tar", [f"k{n}{i}" for i in range(5)])
    damaged = bytearray((tmp_path / "wds" / "1.tar").read_bytes())
    damaged[1024 + 148:1024 + 156] = b"99999999"  # the second header's checksum
    (tmp_path / "wds" / "1.tar").write_bytes(bytes(damaged))
    result = atlasfs("pack", "-j", jobs, str(tmp_path / "wds"), str(tmp_path / "out"))
    lines = result.stderr.splitlines()
    assert result.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("atlasfs: pack stopped") and "1.tar sample 'k10'" in lines[0], lines


@pytest.mark.parametrize("command", ["mount", "export", "pack"])
def test_a_path_inside_the_dataset_is_refused_in_one_line(tmp_path: Path, command: str) -> None:
    """A mount point made in the dataset said 'shard folder name is not a number'; `export
    DS DS` wrote its tars among the dataset's shards. Nothing is written into it now."""
    dataset = Path(shutil.copytree(SHARED_DICT, tmp_path / "ds"))
    before = sorted(p.name for p in dataset.rglob("*"))
    inside = dataset / "sub"
    if command == "mount":
        inside.mkdir()
        before = sorted(p.name for p in dataset.rglob("*"))
    for where in (inside, dataset):
        result = atlasfs(command, str(dataset), str(where))
        assert result.returncode == 1 and result.stderr.startswith(
            f"atlasfs: {where}: inside the dataset {dataset}; "), result.stderr
        assert result.stderr.count("\n") == 1 and not is_mounted(where)
    assert sorted(p.name for p in dataset.rglob("*")) == before


def test_pack_that_cannot_write_names_the_output_given(tmp_path: Path) -> None:
    """It named its hidden '.NAME.pack-partial', a folder the user never asked for."""
    result = atlasfs("pack", str(SHARED_DICT), "/proc/atlasfs-packed")
    assert result.returncode == 1
    assert result.stderr == ("atlasfs: pack stopped, /proc/atlasfs-packed not written: No such file or directory "
                             "(pack writes it in /proc first, then renames it)\n"), result.stderr


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_demo_folders_and_files_get_the_umasks_modes(tmp_path: Path, umask: int) -> None:
    """The dataset's folder was 0700 whatever the umask (other users' info failed on it)."""
    result = atlasfs("demo", str(tmp_path / "demo"), preexec_fn=lambda: os.umask(umask))
    assert result.returncode == 0, result.stderr
    for path in [tmp_path / "demo", *(tmp_path / "demo").rglob("*")]:
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert path.stat().st_mode & 0o777 == expected, (path, oct(path.stat().st_mode))


def test_pack_says_when_it_fell_back_to_another_strategy(tmp_path: Path) -> None:
    """The demo's export packed (tars of 50 samples, blocks of 64: one block each) said
    'strategy 1' where 2 is the default, and not why."""
    assert atlasfs("demo", str(tmp_path / "demo")).returncode == 0
    assert atlasfs("export", str(tmp_path / "demo"), str(tmp_path / "tars")).returncode == 0
    result = atlasfs("pack", str(tmp_path / "tars"), str(tmp_path / "packed"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"{tmp_path / 'packed'}: 4 shards, 200 examples, strategy 1",
        "pack: strategy 1 used, not 2: the first shard has 1 block, fewer than the 7 zstd trains a dictionary on "
        "(--block-size 7 or less makes 7 blocks)"]
    result = atlasfs("pack", str(tmp_path / "tars"), str(tmp_path / "per-shard"), "--strategy", "3")
    assert result.stdout.splitlines()[1] == ("pack: strategy 1 used for 4 of 4 shards, not 3: those shards have at "
                                             "most 1 block, fewer than the 7 zstd trains a dictionary on "
                                             "(--block-size 7 or less makes 7 blocks)"), result.stdout
    result = atlasfs("pack", str(tmp_path / "tars"), str(tmp_path / "small"), "--block-size", "7")
    assert result.stdout.splitlines() == [f"{tmp_path / 'small'}: 4 shards, 200 examples, strategy 2"], result.stdout
