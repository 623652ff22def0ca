"""The raw-TCP baselines: two Python processes moving a preallocated buffer with sendall/recv_into,
the best a Python peer can do on this machine (a ratio of 1.0 means "as fast as the socket").

The other end runs as `python -m weightsvc.cli.bench.rawtcp PORT NBYTES send|recv`; this module
imports nothing heavy, so the peer starts at once.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from weightsvc.memory import alloc

RECV_PIECE = 4 << 20


def recv_exactly(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got : got + RECV_PIECE])
        if n == 0:
            raise ConnectionError("peer closed early")
        got += n


def _fresh(nbytes: int) -> memoryview:
    return alloc(nbytes)  # as the clients allocate their receive buffers: both pay the same


def _ones(nbytes: int) -> memoryview:
    return memoryview(bytearray(b"\x01") * nbytes)


def _peer(port: int, nbytes: int, mode: str) -> None:
    """The other end, in its own process: sends `nbytes`, or receives them and says so."""
    buf = memoryview(bytearray(nbytes))
    with socket.create_connection(("127.0.0.1", port)) as s:
        if mode == "send":
            s.sendall(buf)
        else:
            recv_exactly(s, buf)
            s.sendall(b"k")  # every byte is in: the clock stops here


def _start_peer(port: int, nbytes: int, mode: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "weightsvc.cli.bench.rawtcp", str(port), str(nbytes), mode])


def raw_tcp_seconds(nbytes: int, *, download: bool) -> float:
    """Seconds to move `nbytes` over loopback between two processes (download: the peer sends)."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        port = ls.getsockname()[1]
        peer = _start_peer(port, nbytes, "send" if download else "recv")
        conn, _ = ls.accept()
        with conn:
            if download:
                buf = _fresh(nbytes)  # outside the clock: the baseline is the socket alone
                start = time.perf_counter()
                recv_exactly(conn, buf)
            else:
                buf = _ones(nbytes)
                start = time.perf_counter()
                conn.sendall(buf)
                conn.recv(1)
            elapsed = time.perf_counter() - start
        if peer.wait(60) != 0:
            raise RuntimeError("raw TCP peer failed")
    return elapsed


def raw_tcp_fanout_seconds(nbytes: int, peers: int) -> float:
    """Seconds for one process to send `nbytes` to each of `peers` receiving processes at once."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(peers)
        port = ls.getsockname()[1]
        procs = [_start_peer(port, nbytes, "recv") for _ in range(peers)]
        conns = [ls.accept()[0] for _ in range(peers)]
        buf = _ones(nbytes)

        def send(conn: socket.socket) -> None:
            conn.sendall(buf)  # releases the GIL: the streams run in parallel, as a server's would
            conn.recv(1)

        threads = [threading.Thread(target=send, args=(c,)) for c in conns]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        for c in conns:
            c.close()
        if any(p.wait(60) != 0 for p in procs):
            raise RuntimeError("raw TCP peer failed")
    return elapsed


class RawTcp:
    """The raw-TCP baselines of one run, each measured once (best of `repeat`) for all the figures
    that compare with it. Measured while no server runs."""

    def __init__(self, repeat: int) -> None:
        self.repeat = repeat
        self._seconds: dict[tuple[str, int], float] = {}

    def _get(self, key: tuple[str, int], fn: Callable[[], float]) -> float:
        if key not in self._seconds:
            self._seconds[key] = min(fn() for _ in range(self.repeat))
        return self._seconds[key]

    def up(self, nbytes: int) -> float:
        return self._get(("up", nbytes), lambda: raw_tcp_seconds(nbytes, download=False))

    def down(self, nbytes: int) -> float:
        return self._get(("down", nbytes), lambda: raw_tcp_seconds(nbytes, download=True))

    def fanout(self, nbytes: int, peers: int) -> float:
        if peers == 1:
            return self.down(nbytes)
        return self._get((f"fanout{peers}", nbytes), lambda: raw_tcp_fanout_seconds(nbytes, peers))


if __name__ == "__main__":
    _peer(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
