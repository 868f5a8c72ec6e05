"""Where a background mount's daemon logs, and the problems ``atlasfs mount`` shows.

The daemon has no terminal. Its log goes to ``--log-file`` if given, else to syslog if a
syslog daemon answers on ``/dev/log`` (``ATLASFS_SYSLOG_SOCKET`` names another socket), else
to a file of the user's own: ``$XDG_STATE_HOME/atlasfs/<mount point>.log`` (by default
``~/.local/state/atlasfs``), rotated at :data:`LOG_BYTES` with :data:`LOG_BACKUPS` old copies.
Whatever the tree or the source logs as a warning or an error while the mount starts (in
``atlasfs mount`` itself, or in the daemon until its mount is ready: sent through the ready
pipe) is also shown on the terminal, at most :data:`SHOWN_PROBLEMS` lines and then a count.
"""

from __future__ import annotations

import hashlib
import logging
import logging.handlers
import os
import socket
import sys
import threading
from typing import IO

log = logging.getLogger("atlasfs")

#: The environment variable naming the syslog socket (tests point it elsewhere).
SYSLOG_SOCKET_ENV = "ATLASFS_SYSLOG_SOCKET"
#: The syslog socket used when the variable is not set.
SYSLOG_SOCKET = "/dev/log"
#: Bytes a state log file grows to before it is rotated...
LOG_BYTES = 1 << 20
#: ...and the rotated copies kept (``.1`` newest): at most 4 MiB in all.
LOG_BACKUPS = 3
#: Problems ``atlasfs mount`` prints before it says how many more there were.
SHOWN_PROBLEMS = 10
#: How the daemon marks a problem line in the ready pipe (any other line ends the start).
PROBLEM_PREFIX = "problem "
#: The format of the lines of a log file.
FILE_FORMAT = "%(asctime)s atlasfs[%(process)d]: %(message)s"
#: Longest file name made from a mount point (NAME_MAX is 255, and ``.log.3`` follows).
_NAME_BYTES = 200
#: Bytes of a mount point's path that stand for themselves in its log's name.
_PLAIN = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")


def state_dir() -> str:
    """The folder of the daemons' log files: ``$XDG_STATE_HOME/atlasfs`` (the variable is
    ignored unless absolute, as the XDG spec says), by default ``~/.local/state/atlasfs``."""
    base = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "atlasfs")


def log_name(mountpoint: str) -> str:
    """The log file name of the mount at absolute path ``mountpoint``: its components joined
    by ``-`` (``/mnt/ds`` -> ``mnt-ds.log``), each byte other than a letter, a digit, ``_``
    or a ``.`` not leading a component written ``%XX``. So ``-`` and ``%`` in the path are
    escaped, no two mount points share a name, and the name holds no ``/`` (it stays in the
    folder) and never starts with a dot. A name too long for the file system is cut and
    ends with ``~`` and a hash of the whole path (``~`` is escaped otherwise)."""
    parts = [part for part in os.fsencode(mountpoint).split(b"/") if part]
    name = "-".join("".join(chr(b) if b in _PLAIN and not (b == 0x2E and i == 0) else f"%{b:02X}"
                            for i, b in enumerate(part)) for part in parts) or "-"
    if len(name) > _NAME_BYTES:
        name = name[:_NAME_BYTES - 17] + "~" + hashlib.sha256(os.fsencode(mountpoint)).hexdigest()[:16]
    return name + ".log"


def syslog_handler() -> logging.Handler | None:
    """A handler sending to the syslog socket, or None if nothing there accepts (no
    ``/dev/log`` in a container, most CI and many desktops)."""
    address = os.environ.get(SYSLOG_SOCKET_ENV) or SYSLOG_SOCKET
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        with socket.socket(socket.AF_UNIX, kind) as probe:
            try:
                probe.connect(address)
            except OSError:
                continue
        handler = logging.handlers.SysLogHandler(address, socktype=kind)
        handler.setFormatter(logging.Formatter("atlasfs[%(process)d]: %(message)s"))
        return handler
    return None


def file_handler(path: str, rotate: bool = False) -> logging.Handler:
    """A handler appending to ``path`` (rotated at :data:`LOG_BYTES` if ``rotate``); raises
    :class:`OSError` if the file cannot be opened. A rotated file is opened at its first line."""
    path = os.path.abspath(path)
    handler: logging.FileHandler
    if rotate:
        handler = logging.handlers.RotatingFileHandler(path, maxBytes=LOG_BYTES, backupCount=LOG_BACKUPS,
                                                       delay=True)
    else:
        handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    return handler


def state_file_handler(mountpoint: str) -> tuple[logging.Handler, str]:
    """``(handler, path)`` of the rotated log file of the mount at ``mountpoint`` in
    :func:`state_dir`, made 0700 if it is new (it is the user's own); :class:`OSError` if
    the folder cannot be made."""
    folder = state_dir()
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    try:
        os.mkdir(folder, 0o700)
        os.chmod(folder, 0o700)  # whatever the umask
    except FileExistsError:
        pass
    path = os.path.join(folder, log_name(mountpoint))
    return file_handler(path, rotate=True), path


class StartupReport(logging.Handler):
    """Shows the problems (warnings and errors) logged while a background mount starts on
    ``atlasfs mount``'s terminal: the first :data:`SHOWN_PROBLEMS`, then how many more.

    In ``atlasfs mount`` it prints them; in the daemon (after :meth:`send_to`) it writes them
    to the ready pipe for ``atlasfs mount`` to print (:meth:`show`), until :meth:`stop`.
    """

    def __init__(self, where: str | None, stream: IO[str] | None = None, lost: str | None = None) -> None:
        super().__init__(logging.WARNING)
        #: Where the whole log goes, for the user: a file's path, "syslog", or None (nowhere).
        self.where = where
        #: Why the log goes nowhere, said once the mount is live (a refused mount says only why).
        self.lost = lost
        self._stream = stream if stream is not None else sys.stderr
        self._pipe: IO[str] | None = None
        self._stopped = False
        self._shown = 0
        self._more = 0
        self._count_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        if self._stopped:
            return
        try:
            line = " ".join(record.getMessage().splitlines())  # one line each, also in the pipe
            if self._pipe is None:
                self.show(line)
            else:
                self._pipe.write(f"{PROBLEM_PREFIX}{line}\n")
                self._pipe.flush()
        except Exception:  # logging must never break the mount
            self.handleError(record)

    def show(self, line: str) -> None:
        """Print ``line`` (a problem) unless :data:`SHOWN_PROBLEMS` were shown; count it then."""
        with self._count_lock:
            if self._shown >= SHOWN_PROBLEMS:
                self._more += 1
                return
            self._shown += 1
        print(f"atlasfs: {line}", file=self._stream, flush=True)

    def send_to(self, pipe: IO[str]) -> None:
        """In the daemon: write problems to ``pipe`` from now on."""
        with self.lock:  # type: ignore[union-attr]  # Handler.createLock made it
            self._pipe = pipe

    def stop(self, last_line: str | None = None) -> None:
        """Show or send nothing more (after writing ``last_line`` to the pipe, if given) and
        leave the logger: the mount is ready, or failed."""
        with self.lock:  # type: ignore[union-attr]
            if last_line is not None and self._pipe is not None:
                self._pipe.write(last_line + "\n")
                self._pipe.flush()
            self._stopped = True
            self._pipe = None
        log.removeHandler(self)

    def finish(self, mounted: bool) -> None:
        """In ``atlasfs mount``, once it is done: say how many problems were not shown, and
        where the log is if it is a file of the state folder (``mounted``: the mount is live)."""
        self.stop()
        where = self.where or "nowhere: the daemon's log is lost"
        if self._more:
            print(f"atlasfs: ... and {self._more} more (see {where})", file=self._stream, flush=True)
        if mounted and self.where and self.where.startswith(state_dir() + os.sep):
            print(f"atlasfs: logging to {self.where}", file=self._stream, flush=True)
        if mounted and self.lost:
            print(f"atlasfs: {self.lost}", file=self._stream, flush=True)


def log_in_background(mountpoint: str, log_file: str | None) -> StartupReport:
    """Route the log for a background mount at ``mountpoint`` (``log_file``: the user's
    ``--log-file``, already added to the logger) and return the report that shows its
    start's problems on the terminal instead of the whole log."""
    for handler in list(log.handlers):  # the terminal's handler: the report takes its place
        if type(handler) is logging.StreamHandler and handler.stream in (sys.stderr, sys.__stderr__):
            log.removeHandler(handler)
    where: str | None
    lost = None
    if log_file is not None:
        where = os.path.abspath(log_file)
    else:
        handler = syslog_handler()
        where = "syslog"
        if handler is None:
            try:
                handler, where = state_file_handler(mountpoint)
            except OSError as exc:
                handler, where = None, None
                lost = f"cannot keep the daemon's log in {state_dir()} ({exc.strerror}); give one with --log-file"
        if handler is not None:
            log.addHandler(handler)
    report = StartupReport(where, lost=lost)
    log.addHandler(report)
    return report
