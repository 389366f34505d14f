"""A TCP server that feeds Spark's socket sources (the DStream receiver, Structured Streaming's `socket`
format) lines of a fixed size: the baselines of bench/control_loop.py and bench/overload_memory.py."""

from __future__ import annotations

import math
import socket
import threading
import time


class LineServer:
    """A server thread writing `record_bytes`-byte lines to whoever connects, each connection at `rate`
    lines/s, or as fast as the socket takes them when it falls behind (then it is always sending);
    `rate` inf: always as fast as the socket takes them."""

    def __init__(self, record_bytes: int, rate: float = math.inf) -> None:
        self.chunk_lines = 10_000
        self._payload = (b"v" * (record_bytes - 1) + b"\n") * self.chunk_lines
        self.rate = rate
        self.sent = 0
        self.connected_at: float | None = None
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.5)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="line-server")
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._feed, args=(conn,), daemon=True).start()

    def _feed(self, conn: socket.socket) -> None:
        conn.settimeout(0.5)
        t0 = time.monotonic()
        if self.connected_at is None:
            self.connected_at = t0
        view = memoryview(self._payload)
        sent = 0
        with conn:
            while not self._stop.is_set():
                if math.isfinite(self.rate) and sent >= self.rate * (time.monotonic() - t0):
                    time.sleep(0.002)
                    continue
                try:
                    conn.sendall(view)
                    sent += self.chunk_lines
                    self.sent += self.chunk_lines
                except TimeoutError:
                    continue  # a partial chunk at worst: lines keep their size but for one
                except OSError:
                    return

    def stop(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(2)
