"""Builds atlasfs's native data plane, ``atlasfs.fuse._native`` (C, on libfuse 3's low-level API;
docs/native.md). Everything else is in pyproject.toml.

The extension is optional: without libfuse3's headers, pkg-config or a C compiler the package
installs without it, and ``atlasfs mount`` says what to install.
``ATLASFS_SANITIZE=1`` at build time builds it with AddressSanitizer and UBSan (docs/native.md
says how to run the FUSE tests under it).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from setuptools import Extension, setup

SOURCES = ["atlasfs/fuse/native/module.c", "atlasfs/fuse/native/ops.c", "atlasfs/fuse/native/bridge.c",
           "atlasfs/fuse/native/tables.c", "atlasfs/fuse/native/cache.c", "atlasfs/fuse/native/readpath.c",
           "atlasfs/fuse/native/reader.c", "atlasfs/fuse/native/dictionaries.c", "atlasfs/fuse/native/diskblocks.c",
           # Atlas's located reads, beside its format; they use of the engine only reader.h
           "atlasfs/formats/atlas/native/located.c"]
INCLUDE_DIRS = ["atlasfs/fuse/native", "atlasfs/formats/atlas/native"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]


#: The libraries the extension links, by their pkg-config names: libfuse 3 (the session), zstd
#: (decompressing a block for a located read in C) and zlib (its CRC-32 checks).
PACKAGES = ["fuse3", "libzstd", "zlib"]
#: Debian's packages of their headers, and what else the build needs.
BUILD_PACKAGES = "libfuse3-dev libzstd-dev zlib1g-dev pkg-config gcc python3-dev"


def pkg_config(*args: str) -> list[str] | None:
    """pkg-config's answer for PACKAGES, split; None without pkg-config or any of their -dev packages."""
    try:
        out = subprocess.run(["pkg-config", *args, *PACKAGES], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return shlex.split(out)


def native_extension() -> list[Extension]:
    cflags, libs = pkg_config("--cflags"), pkg_config("--libs")
    if cflags is None or libs is None:
        print(f"atlasfs: pkg-config finds no {' or '.join(PACKAGES)}: building without the native engine "
              f"(Debian/Ubuntu: apt-get install {BUILD_PACKAGES})", file=sys.stderr)
        return []
    compile_args = cflags + ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                             "-Wno-missing-field-initializers"]
    link_args = list(libs)
    if os.environ.get("ATLASFS_SANITIZE") == "1":
        compile_args += SANITIZE + ["-O1", "-g"]
        link_args += SANITIZE
    return [Extension("atlasfs.fuse._native", SOURCES,
                      include_dirs=INCLUDE_DIRS,
                      depends=["atlasfs/fuse/native/engine.h", "atlasfs/fuse/native/layout.h",
                               "atlasfs/fuse/native/cache.h", "atlasfs/fuse/native/reader.h",
                               "atlasfs/formats/atlas/native/located.h"],
                      extra_compile_args=compile_args, extra_link_args=link_args, optional=True)]


setup(ext_modules=native_extension())
