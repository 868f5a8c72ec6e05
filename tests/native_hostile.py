"""A mount whose control plane answers the native engine with wrong values, for
tests/test_native.py: ``python native_hostile.py MOUNTPOINT``.

Each name at the root is one way of answering wrong (see ``ANSWERS``); ``good`` is answered
right, so that the test can see the daemon still serves after every wrong answer.
"""

from __future__ import annotations

import sys

from atlasfs.fuse.engine import NativeBridge, NativeSession
from atlasfs.tree.base import Entry, Tree, not_found

GOOD = Entry(False, 5, 0.0, 77)

#: lookup answers by name: each is wrong for the C side to catch (EIO, never a crash).
ANSWERS = {
    "not-a-tuple": "a string",
    "short-tuple": (5, False),
    "negative-size": (5, False, -5, 0.0, 7),
    "huge-size": (5, False, 1 << 63, 0.0, 7),
    "root-node": (1, True, 0, 0.0, 7),
    "text-node": ("5", False, 1, 0.0, 7),
    "positive-errno": 5,
}


class Flat(Tree):
    """``/good``, and ``/too-long`` and ``/text`` whose reads the bridge answers wrong."""

    def lookup(self, path: str) -> Entry:
        if path == "/":
            return Entry(True, 0, 0.0, 1)
        if path in ("/good", "/too-long", "/text"):
            return GOOD
        raise not_found(path)

    def listdir(self, path: str) -> list[tuple[str, Entry]]:
        return [("good", GOOD)]

    def read(self, entry: Entry, offset: int, size: int) -> bytes:
        return b"hello"[offset:offset + size]


class Hostile(NativeBridge):
    """Answers right for ``good``, wrong for the rest."""

    def lookup(self, parent: int, name: bytes):  # type: ignore[override]
        text = name.decode()
        if text == "raises":
            raise RuntimeError("a bug in the control plane")
        if text in ANSWERS:
            return ANSWERS[text]
        if text == "nan-mtime":  # a value C takes, as no time
            return self._register("/good"), False, 5, float("nan"), 77
        return super().lookup(parent, name)

    def read(self, node: int, offset: int, size: int):  # type: ignore[override]
        path = self._nodes[node][0]
        if path == "/too-long":
            return b"x" * (size + 1)
        if path == "/text":
            return "hello"
        return super().read(node, offset, size)

    def readdir(self, node: int, offset: int, count: int, plus: bool):  # type: ignore[override]
        if offset == 0:
            return [(b"bad\0name", False, 3, 0, 1, 0.0, 1)]
        return [(b"x", False)]


def main() -> None:
    mountpoint = sys.argv[1]
    bridge = Hostile(Flat(), lambda: print("ready", flush=True))
    NativeSession(bridge, mountpoint, {"fsname": "hostile", "subtype": "atlasfs", "ro": True}).run()


if __name__ == "__main__":
    main()
