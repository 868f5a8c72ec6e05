"""The checks and option parsing that run before anything is mounted (no FUSE needed)."""

from __future__ import annotations

import ctypes.util
import os
import re

import pytest

from atlasfs.commands.cli import build_parser
from atlasfs.fuse.mount import MountError, check_fuse, check_mountpoint
from atlasfs.options import OPTIONS, MountOptions, OptionError, from_args


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
    ("rw", "read-only"), ("bogus", "unknown mount option 'bogus'"), ("cache_size=lots", "-o cache_size: "),
    ("cache_size", "-o cache_size: takes a value"), ("allow_other=1", "takes no value"), ("view=trees", "unknown view 'trees'"), ("deadline=-1", "-o deadline: "),
    ("uid=id", "uid= is libfuse's file owner"), ("format=zip", "unknown format 'zip'"),
])
def test_bad_options(text: str, message: str) -> None:
    with pytest.raises(OptionError, match=message):
        MountOptions().apply(text)


def test_every_option_is_one_name_with_one_default_as_flag_and_as_o() -> None:
    """The table makes both: -o NAME=VALUE and --NAME VALUE set the same field to the same
    value, and a flag given after -o wins; the help shows the field's own default."""
    values = {"format": "pbin", "uid_column": "id", "cache_size": "1G", "view": "both", "index_dir": "/x",
              "log_file": "/y", "endpoint_url": "http://127.0.0.1:1", "disk_cache": "/z", "disk_cache_size": "2G",
              "join": "left", "main_shardset": "m", "deadline": "3",
              "energon_split": "8:1:1", "energon_dataset": "/d.yaml", "decoded_cache": "/c",
              "decoded_cache_size": "4G"}
    parser = build_parser()
    for option in OPTIONS:
        if "mount" not in option.commands:
            continue
        said = option.name if option.read is None else f"{option.name}={values[option.name]}"
        by_o = from_args(parser.parse_args(["mount", "DS", "MNT", "-o", said]))
        flag = [option.flag] if option.read is None else [option.flag, values[option.name]]
        by_flag = from_args(parser.parse_args(["mount", "DS", "MNT", *flag]))
        assert by_o == by_flag != MountOptions(), option.name
        if option.read is not None:
            assert "(default " in option.described() or option.default() is None
    help_text = parser._subparsers._group_actions[0].choices["mount"].format_help()  # type: ignore[union-attr]
    assert "(default 256.0 MiB)" in " ".join(help_text.split())
    options = from_args(parser.parse_args(["mount", "DS", "MNT", "-o", "cache_size=1G", "--cache-size", "2G"]))
    assert options.cache_bytes == 2 << 30
    # uid=N stays libfuse's file owner, whatever Lavender's column is called
    options = from_args(parser.parse_args(["mount", "DS", "MNT", "-o", "uid=1000,uid_column=id"]))
    assert options.fuse_options == {"uid": "1000"} and options.uid_column == "id"


def test_missing_libfuse_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
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


def test_a_bucket_deadline_is_a_flag_of_every_command_on_a_dataset() -> None:
    """info and verify with the store down wait the deadline at open: it is theirs to set too."""
    parser = build_parser()
    for command in (["info"], ["verify"], ["index"], ["export", "OUT"], ["show", "0"]):
        options = from_args(parser.parse_args([command[0], "s3://b/ds", *command[1:], "--deadline", "3"]))
        assert options.storage.deadline == 3.0, command
    with pytest.raises(SystemExit):
        parser.parse_args(["info", "s3://b/ds", "--deadline", "soon"])
