"""A forwarder between atlasfs and the test S3 server that a test can break on purpose.

It listens on 127.0.0.1 and passes HTTP/1.1 requests and responses through to the
server, one request at a time per connection (as S3 clients send them), so that it
can:

* ``cut()`` the network: nothing more passes, in either direction, mid-response
  included; connections stay open and silent, as behind a dead link (the
  harshest case: no reset tells the client anything). ``restore()`` lets traffic
  pass again and closes the connections that were held, as a link coming back
  finds them dead.
* ``black_hole()``: the same as ``cut()``, named for what a client meets: every
  connection, open or new (the listener still accepts), is silent for good.
* ``reset()``: every open connection is reset (RST: ``SO_LINGER`` 0), and so is
  every new one, at once after it is accepted: a store behind a firewall that
  rejects, or a proxy whose upstream is gone. ``refuse()``: open connections are
  reset and the listener is closed, so new connections are refused
  (``ECONNREFUSED``): a store that is down. ``restore()`` ends either (the listener
  comes back on the same port).
* ``storm(n)``: answer the next ``n`` requests itself with ``503 SlowDown`` (S3's
  throttling answer, with its XML body) instead of passing them on.
* ``rate``: pass responses at most this many bytes a second, so that a cut lands
  in the middle of a transfer.
* count requests by method (``counts["GET"]``), the figure the bench's bound is on.

It only ever talks to the two addresses it is given, both on this machine.
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time

from s3server import free_port

_SLOWDOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
             b"<Message>Please reduce your request rate.</Message><RequestId>atlasfs-test</RequestId></Error>")


class _Closed(Exception):
    """The connection (or the forwarder) was closed."""


class Forwarder:
    """Forward ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream_port>`` (see the module)."""

    def __init__(self, upstream_port: int, rate: float | None = None) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.rate = rate
        self.counts: collections.Counter[str] = collections.Counter()
        #: Bytes of the response bodies relayed (what the store sent: a read's cost in bytes).
        self.body_bytes = 0
        self.storm_answers = 0
        self._lock = threading.Lock()
        self._passing = threading.Event()
        self._passing.set()
        self._storm_left = 0
        self._closed = False
        self._resetting = False  # reset() or refuse(): every connection is reset
        self.resets = 0  # connections reset by reset() or refuse(), for tests to see they happened
        self._held: set[socket.socket] = set()
        self._sockets: set[socket.socket] = set()
        self._clients: set[socket.socket] = set()
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._listener: socket.socket | None = None
        self._listen()

    def _listen(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True, name="forwarder-accept").start()

    # -- what tests call

    def cut(self) -> None:
        """Stop all traffic, open connections included, without closing anything."""
        self._passing.clear()

    def black_hole(self) -> None:
        """Every connection, open or new, is accepted and never answered (``cut()``)."""
        self.cut()

    def reset(self) -> None:
        """Reset every open connection, and every new one as soon as it is accepted."""
        with self._lock:
            self._resetting = True
            clients = list(self._clients)
        for sock in clients:
            self._reset(sock)
        self._passing.set()  # connections held by a cut go too: they were just reset

    def refuse(self) -> None:
        """Reset every open connection and close the listener: new ones are refused."""
        self.reset()
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            _close(listener)

    def restore(self) -> None:
        """Let traffic pass again; connections held during the cut are closed, and a
        listener closed by :meth:`refuse` listens again on the same port."""
        with self._lock:
            held, self._held = self._held, set()
            self._resetting = False
            relisten = self._listener is None and not self._closed
        for sock in held:
            _close(sock)
        if relisten:
            self._listen()
        self._passing.set()

    def storm(self, requests: int) -> None:
        """Answer the next ``requests`` requests with 503 SlowDown."""
        with self._lock:
            self._storm_left = requests

    @property
    def gets(self) -> int:
        return self.counts["GET"]

    def close(self) -> None:
        self._closed = True
        self._passing.set()
        if self._listener is not None:
            _close(self._listener)
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _close(sock)

    def __enter__(self) -> "Forwarder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the work

    def _accept(self, listener: socket.socket) -> None:
        while not self._closed:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            self._track(client, client=True)
            if self._resetting:
                self._reset(client)
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True, name="forwarder-conn").start()

    def _track(self, sock: socket.socket, client: bool = False) -> None:
        with self._lock:
            self._sockets.add(sock)
            if client:
                self._clients.add(sock)

    def _reset(self, sock: socket.socket) -> None:
        """Close a client connection with a reset (RST), not a FIN; a thread blocked
        reading it wakes up (shutdown of the reading side sends nothing)."""
        with self._lock:
            self._clients.discard(sock)
            self._sockets.discard(sock)
            self.resets += 1
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        try:
            sock.close()
        except OSError:
            pass

    def _wait_passing(self, *socks: socket.socket) -> None:
        """Block while the network is cut; a connection caught in a cut is closed when
        it is restored (raises :class:`_Closed` then)."""
        if self._passing.is_set():
            return
        with self._lock:
            self._held.update(socks)
        self._passing.wait()
        if self._closed or any(s.fileno() < 0 for s in socks):
            raise _Closed()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        reader = _Reader(client)
        try:
            while not self._closed:
                self._wait_passing(client)
                head, body = reader.request()
                self._wait_passing(client)
                if self._resetting:  # a request that raced reset(): reset too, never answered
                    self._reset(client)
                    return
                method = head.split(b" ", 1)[0].decode("ascii", "replace")
                with self._lock:
                    storming = self._storm_left > 0
                    if storming:
                        self._storm_left -= 1
                        self.storm_answers += 1
                if storming:
                    client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                                   b"Content-Length: %d\r\nConnection: keep-alive\r\n\r\n" % len(_SLOWDOWN)
                                   + _SLOWDOWN)
                    continue
                with self._lock:
                    self.counts[method] += 1
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    self._track(upstream)
                    up_reader = _Reader(upstream)
                upstream.sendall(head + body)
                keep = self._relay_response(up_reader, client, method, (client, upstream))
                if not keep:
                    return
        except (_Closed, OSError):
            pass
        finally:
            with self._lock:
                self._clients.discard(client)
            _close(client)
            if upstream is not None:
                _close(upstream)

    def _relay_response(self, up: "_Reader", client: socket.socket, method: str,
                        socks: tuple[socket.socket, socket.socket]) -> bool:
        """Pass one response on; False if the connection ends with it."""
        head = up.until(b"\r\n\r\n")
        self._send(client, head, socks)
        status = int(head.split(b" ", 2)[1])
        headers = _headers(head)
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return headers.get(b"connection", b"").lower() != b"close"
        if b"content-length" in headers:
            left = int(headers[b"content-length"])
            with self._lock:
                self.body_bytes += left
            while left:
                chunk = up.some(min(left, 65536))
                left -= len(chunk)
                self._send(client, chunk, socks)
        elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            while True:
                line = up.until(b"\r\n")
                self._send(client, line, socks)
                size = int(line.split(b";")[0], 16)
                data = up.exactly(size + 2)
                self._send(client, data, socks)
                if size == 0:
                    break
        else:  # until the server closes
            while True:
                chunk = up.some(65536, eof_ok=True)
                if not chunk:
                    return False
                self._send(client, chunk, socks)
        return headers.get(b"connection", b"").lower() != b"close"

    def _send(self, client: socket.socket, data: bytes, socks: tuple[socket.socket, ...]) -> None:
        """Send to the client in slices, stopping dead (mid-response) if the network is cut."""
        step = 16384
        for i in range(0, len(data), step):
            self._wait_passing(*socks)
            piece = data[i:i + step]
            client.sendall(piece)
            if self.rate:
                time.sleep(len(piece) / self.rate)


class _Reader:
    """Buffered reads of one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self, eof_ok: bool = False) -> bool:
        data = self.sock.recv(65536)
        if not data:
            if eof_ok:
                return False
            raise _Closed()
        self.buf += data
        return True

    def until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            self._fill()
        end = self.buf.index(marker) + len(marker)
        out, self.buf = self.buf[:end], self.buf[end:]
        return out

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def some(self, most: int, eof_ok: bool = False) -> bytes:
        if not self.buf and not self._fill(eof_ok):
            return b""
        out, self.buf = self.buf[:most], self.buf[most:]
        return out

    def request(self) -> tuple[bytes, bytes]:
        """One request: its head, and its body (by Content-Length or chunked)."""
        head = self.until(b"\r\n\r\n")
        headers = _headers(head)
        if b"content-length" in headers:
            return head, self.exactly(int(headers[b"content-length"]))
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            body = b""
            while True:
                line = self.until(b"\r\n")
                size = int(line.split(b";")[0], 16)
                body += line + self.exactly(size + 2)
                if size == 0:
                    return head, body
        return head, b""


def _headers(head: bytes) -> dict[bytes, bytes]:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            out[name.strip().lower()] = value.strip()
    return out


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
