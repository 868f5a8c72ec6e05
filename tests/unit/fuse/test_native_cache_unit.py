"""The native engine's byte cache (atlasfs/fuse/native/cache.c) tested alone, as C.

cache.c knows no table, no format and no FUSE: tests/unit/fuse/cache_test.c links it with
nothing else and checks its entries, bound, least-recently-used eviction and its order by
kind, that an entry being read is never evicted, single flight (of 8 threads missing one
entry, one fills it and the others read it), and that reservations are served in turn (a
large one is not overtaken by smaller ones arriving after it). This builds it with gcc, plainly
and under AddressSanitizer and UBSan (a use after free there is a report, not luck), and
runs it: it exits 1 naming each check that failed. Linking cache.c with nothing else is
itself the check that it includes none of the engine's headers (Python, FUSE, zstd).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

#: The repository (found upward, so that this file may move within tests/).
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())
NATIVE = ROOT / "atlasfs" / "fuse" / "native"
PROGRAM = Path(__file__).resolve().parent / "cache_test.c"
FLAGS = ["-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pthread"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]


def _gcc() -> str:
    gcc = shutil.which("gcc")
    if gcc is None:
        if os.environ.get("CI") == "true":
            pytest.fail("gcc is not installed (CI builds the native engine with it)")
        pytest.skip("gcc is not installed")
    return gcc


@pytest.mark.parametrize("sanitized", [False, True], ids=["plain", "asan-ubsan"])
def test_the_byte_cache_alone(tmp_path: Path, sanitized: bool) -> None:
    binary = tmp_path / "cache_test"
    build = subprocess.run(
        [_gcc(), *FLAGS, *(SANITIZE if sanitized else []), f"-I{NATIVE}", str(PROGRAM), str(NATIVE / "cache.c"),
         "-o", str(binary)], capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0"
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("ok ") and run.stderr == "", run.stdout + run.stderr

