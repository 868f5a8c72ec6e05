"""A real S3 API server for the tests: moto's server mode, as a subprocess on 127.0.0.1.

Nothing here mocks fsspec or s3fs: the storage layer talks HTTP to a server that
answers like S3 (ranged GETs, listings, ETags, error XML). In CI (``CI=true``) a test
that cannot start the server fails; elsewhere it is skipped with the reason.

Credentials are fixed fake ones, set in the test process's environment, so that
neither the tests nor the daemons they start can pick up a developer's real ones.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"

#: What boto and s3fs read: fake, and the same for every test and daemon.
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "atlasfs-test-key",
    "AWS_SECRET_ACCESS_KEY": "atlasfs-test-secret-never-shown",
    "AWS_DEFAULT_REGION": "us-east-1",
    # No ~/.aws of the developer's: an empty folder stands for it.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


def unavailable(reason: str) -> None:
    """Skip the test, except in CI, where a server that cannot start is a failure."""
    if IN_CI:
        pytest.fail(f"S3 test cannot run in CI: {reason}")
    pytest.skip(reason)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 server, running until :meth:`stop`. ``endpoint`` is its URL."""

    def __init__(self) -> None:
        try:
            import moto.server  # noqa: F401  (only to fail early and clearly)
            import s3fs  # noqa: F401
        except ImportError as exc:
            unavailable(f"moto[server] and s3fs are needed ({exc}); pip install -e '.[test]'")
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()
        env = {**os.environ, **FAKE_CREDENTIALS}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2):
                    break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    unavailable(f"moto's server did not start: {self.output()[-2000:]}")
                time.sleep(0.1)

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def filesystem(self, endpoint: str | None = None):
        """A fresh s3fs file system on this server (or on ``endpoint``, a forwarder)."""
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=endpoint or self.endpoint, skip_instance_cache=True,
                                 key=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                 secret=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def make_bucket(self, name: str) -> None:
        self.filesystem().mkdir(name)

    def upload(self, local: str | Path, url: str) -> None:
        """Copy the folder ``local`` to ``url`` (``s3://bucket/prefix``), file by file."""
        fs = self.filesystem()
        root = Path(local)
        base = url.removeprefix("s3://").rstrip("/")
        for path in sorted(root.rglob("*")):
            if path.is_file():
                fs.pipe_file(f"{base}/{path.relative_to(root).as_posix()}", path.read_bytes())

    def keys(self, url: str) -> dict[str, tuple[int, str]]:
        """``{key: (size, ETag)}`` of every object under ``url``: what a test compares
        before and after, to see that nothing was written."""
        fs = self.filesystem()
        found = fs.find(url.removeprefix("s3://"), detail=True)
        return {k: (v["size"], v.get("ETag", "")) for k, v in found.items()}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    """A moto S3 server for the duration, with the fake credentials in this process's
    environment (restored after)."""
    saved = {k: os.environ.get(k) for k in FAKE_CREDENTIALS}
    os.environ.update(FAKE_CREDENTIALS)
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def upload_copy(server: S3Server, source: Path, url: str) -> Path:
    """Upload a temporary copy of ``source`` (never the fixture itself) to ``url``;
    returns the copy, which tests compare with."""
    folder = Path(tempfile.mkdtemp(prefix="atlasfs-s3-src-"))
    copy = Path(shutil.copytree(source, folder / source.name))
    server.upload(copy, url)
    return copy
