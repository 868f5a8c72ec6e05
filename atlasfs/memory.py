"""The daemon's allocator: few arenas, big buffers given back to the system, trimmed after evictions.

glibc's malloc gives each thread that allocates concurrently an arena of its own (up to 8 per
core), and keeps freed memory in the arena it came from. A mount's libfuse workers each decode
and encode blocks, and a block decoded in one worker is often freed in another (evicted when a
third inserts): every arena grows to its own high-water mark, and the daemon's resident memory
to several times what it holds (docs/performance.md, "Memory"). So the daemon

* caps the arenas (:data:`ARENAS`): the workers take turns in them;
* fixes the mmap threshold (:data:`MMAP_THRESHOLD`): a block's decompressed pickle and any
  big file are mapped and unmapped, instead of glibc raising its threshold after the first such
  free and keeping them in an arena from then on;
* and gives free pages back after large evictions (:func:`trim`).

Everything here is a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import threading
import time

#: Arenas the daemon's threads share (glibc's default: 8 per core). Most allocations are
#: made holding the GIL, so few contend; the second serves what runs without it (zstd, libfuse).
#: One and two measured the same after each step of bench/memory.py, two's peaks ~8 MiB higher.
ARENAS = 2
#: Allocations from this size up are mapped, and unmapped when freed.
MMAP_THRESHOLD = 256 << 10
#: Free memory at the top of an arena beyond this goes back to the system at once.
TRIM_THRESHOLD = 1 << 20
#: :func:`trim` runs at most this often (it walks every arena: 0.6 ms, ~13 ms when it hands
#: back tens of MiB; ctypes releases the GIL meanwhile).
MIN_TRIM_INTERVAL = 0.5

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_libc: ctypes.CDLL | None = None
_looked_up = False
_trim_lock = threading.Lock()
_last_trim = 0.0
_pending: threading.Timer | None = None


def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    global _libc, _looked_up
    if not _looked_up:
        _looked_up = True
        try:
            # The process's own symbols, where libc's are: find_library would run ldconfig.
            libc = ctypes.CDLL(None)
            libc.gnu_get_libc_version  # only glibc has it (musl has no malloc_trim)
            libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
            _libc = libc
        except (OSError, AttributeError):
            _libc = None
    return _libc


def configure_allocator(arenas: int = ARENAS, mmap_threshold: int = MMAP_THRESHOLD,
                        trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Set the daemon's allocator up (see the module's docstring); False where it cannot.

    Call it early, before the serving threads start: threads that already have an
    arena keep it."""
    libc = _glibc()
    if libc is None:
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, arenas), (_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold)))


def trim(force: bool = False) -> bool:
    """Give the free pages of every arena back to the system (``malloc_trim``) now, or, if
    a trim ran less than :data:`MIN_TRIM_INTERVAL` ago, once that interval is over (on a
    timer thread, so that memory freed by the last evictions of a burst goes back too).
    ``force`` trims now whatever the interval. True if it trimmed now."""
    global _last_trim, _pending
    libc = _glibc()
    if libc is None:
        return False
    now = time.monotonic()
    with _trim_lock:
        wait = _last_trim + MIN_TRIM_INTERVAL - now
        if not force and wait > 0:
            if _pending is None:
                _pending = threading.Timer(wait, _deferred_trim)
                _pending.daemon = True
                _pending.start()
            return False
        _last_trim = now
    libc.malloc_trim(0)  # outside the lock: it takes the arenas' own locks, and releases the GIL (ctypes)
    return True


def _deferred_trim() -> None:
    global _pending
    with _trim_lock:
        _pending = None
    trim(force=True)
