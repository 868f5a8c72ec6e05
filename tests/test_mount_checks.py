"""The checks and option parsing that run before anything is mounted (no FUSE needed)."""

from __future__ import annotations

import ctypes.util
import os
import re

import pytest

from atlasfs.mount import MountError, MountOptions, check_fuse, check_mountpoint


def test_options_in_fuse_style() -> None:
    options = MountOptions()
    options.apply("ro,cache_size=1G,allow_other,trust_pickle,nofail,_netdev,x-systemd.automount,noauto")
    options.apply("default_permissions,max_read=131072,nothreads,log_file=/tmp/x.log")
    assert options.cache_bytes == 1 << 30
    assert options.allow_other and options.trust_pickle and not options.threads
    assert options.log_file == "/tmp/x.log"
    assert options.fuse_options == {"default_permissions": True, "max_read": "131072"}
    assert "cache 1.0 GiB" in options.describe() and "allow_other" in options.describe()


@pytest.mark.parametrize("text, message", [
    ("rw", "read-only"), ("bogus", "unknown mount option 'bogus'"), ("cache_size=lots", "cache_size"),
    ("cache_size", "unknown mount option"),
])
def test_bad_options(text: str, message: str) -> None:
    with pytest.raises(MountError, match=message):
        MountOptions().apply(text)


def test_missing_libfuse_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    monkeypatch.delenv("FUSE_LIBRARY_PATH", raising=False)
    with pytest.raises(MountError, match="apt-get install fuse3 libfuse3-3"):
        check_fuse(allow_other=False)


@pytest.mark.parametrize("error, said", [
    (FileNotFoundError(2, "No such file or directory"), "/dev/fuse: No such file or directory (load the fuse kernel"),
    (PermissionError(13, "Permission denied"), "/dev/fuse: permission denied (make it 0666"),
])
def test_unusable_dev_fuse_is_explained(monkeypatch: pytest.MonkeyPatch, error: OSError, said: str) -> None:
    real_open = os.open

    def refuse(path: str, *args: object) -> int:
        if path == "/dev/fuse":
            raise error
        return real_open(path, *args)

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libfuse3.so.3")
    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(MountError, match=re.escape(said)):
        check_fuse(allow_other=False)


def test_mount_point_checks(tmp_path) -> None:
    check_mountpoint(str(tmp_path))  # an empty folder is fine
    with pytest.raises(MountError, match="does not exist"):
        check_mountpoint(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(MountError, match="not a folder"):
        check_mountpoint(str(tmp_path / "file"))
    with pytest.raises(MountError, match="not empty"):
        check_mountpoint(str(tmp_path))
    with pytest.raises(MountError, match="already a mount point"):
        check_mountpoint("/proc")
