"""The daemon's log alone: the state log bounded and rotated, safe names, the state folder,
and the problems of the daemon coming through the ready pipe (through a mount:
tests/mount/test_mount_log.py)."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

import pytest

from atlasfs.fuse import daemonlog
from atlasfs.fuse.daemonlog import LOG_BACKUPS, LOG_BYTES, StartupReport, log_name


def test_problems_of_the_daemon_come_through_the_ready_pipe() -> None:
    read_end, write_end = os.pipe()
    shown = io.StringIO()
    with os.fdopen(write_end, "w") as pipe, os.fdopen(read_end) as lines:
        report = StartupReport("syslog")
        logger = logging.getLogger("atlasfs")
        logger.addHandler(report)
        report.send_to(pipe)  # as the daemon does
        logger.info("the mount's settings: not a problem")
        logger.warning("a shard\nin two lines")
        report.stop("ready")
        logger.error("after ready: only for the log")
        assert report not in logger.handlers
        pipe.close()
        parent = StartupReport("syslog", stream=shown)
        for line in lines:  # as atlasfs mount does
            if line.startswith(daemonlog.PROBLEM_PREFIX):
                parent.show(line[len(daemonlog.PROBLEM_PREFIX):].rstrip("\n"))
            else:
                assert line == "ready\n"
    assert shown.getvalue() == "atlasfs: a shard in two lines\n"


def test_the_state_log_is_bounded_and_rotated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    handler, path = daemonlog.state_file_handler("/mnt/ds")
    assert path == str(tmp_path / "atlasfs" / "mnt-ds.log")
    logger = logging.getLogger("atlasfs.test-rotation")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        line = "x" * 1000
        for _ in range((LOG_BACKUPS + 2) * LOG_BYTES // 1000):
            logger.warning(line)
    finally:
        logger.removeHandler(handler)
        handler.close()
    names = sorted(os.listdir(tmp_path / "atlasfs"))
    assert names == ["mnt-ds.log"] + [f"mnt-ds.log.{i}" for i in range(1, LOG_BACKUPS + 1)]
    assert all(os.path.getsize(tmp_path / "atlasfs" / name) <= LOG_BYTES for name in names)
    assert LOG_BYTES == 1 << 20 and LOG_BACKUPS == 3  # the bound docs/reliability.md states


def test_log_names_are_safe_and_unambiguous() -> None:
    assert log_name("/mnt/ds") == "mnt-ds.log"
    assert log_name("/") == "-.log"
    names = [log_name(p) for p in ("/mnt/a-b", "/mnt/a/b", "/mnt/a%2Db", "/mnt/a b", "/mnt/.x", "/mnt/%2Ex",
                                   "/mnt/\udcff", "/mnt/ü")]
    assert len(set(names)) == len(names)
    long_a, long_b = "/" + "a" * 300, "/" + "a" * 299 + "b"
    for name in names + [log_name(long_a), log_name(long_b)]:
        assert "/" not in name and not name.startswith(".") and len(name.encode()) <= 255
    assert log_name(long_a) != log_name(long_b)


def test_state_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", "/somewhere")
    assert daemonlog.state_dir() == "/somewhere/atlasfs"
    monkeypatch.setenv("XDG_STATE_HOME", "relative")  # not absolute: ignored, as the spec says
    monkeypatch.setenv("HOME", "/home/u")
    assert daemonlog.state_dir() == "/home/u/.local/state/atlasfs"
