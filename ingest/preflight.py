"""What a server checks before it serves: its data dir (locked for one server) and its ports.

One server per data dir: two writers appending to one block log corrupt it (two servers on one data dir
once lost 160k of 200k acked records at the next restart). The lock is an flock on DATA_DIR/sluice.lock,
held for as long as the holder lives: the OS drops it when the process dies, by kill -9 too, so it never
goes stale. The file names the holder's pid for the message; it is never deleted (deleting a locked file
would let the next server lock a new file of the same name while the old one still writes).

`sluice serve` starts Spark's JVM (seconds) before its gRPC server (see ingest.cli), so it runs these
checks first: a mistake fails at once, not after Spark has started. That includes the TLS files and the
auth file (check_security): a missing or unreadable file, a file that is not PEM, a key that is not the
certificate's, an invalid auth file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import resource
import socket
from collections.abc import Callable
from pathlib import Path

from ingest.config import ServeConfig
from ingest.tls import load_tls
from receivers.auth import AuthTable
from receivers.files import check_regular
from sluice_client.credentials import Credentials, CredentialsError

LOCK_FILE = "sluice.lock"


class _PlainOSError(OSError):
    """An OSError whose str() is its message alone (no "[Errno n]"): the CLI prints it as is."""

    def __str__(self) -> str:
        return str(self.strerror)


class DataDirInUseError(_PlainOSError):
    """Another live process holds the data dir's lock."""

    def __init__(self, data_dir: Path, holder: int | None) -> None:
        who = f"pid {holder}" if holder is not None else "pid unknown"
        super().__init__(
            errno.EBUSY,
            f"data dir {data_dir} is in use by another sluice server ({who}): one server per data dir; "
            "stop that one or give this one another --data-dir",
        )
        self.data_dir = data_dir
        self.holder = holder


def _failed(message: str, exc: OSError | None = None) -> OSError:
    return _PlainOSError(exc.errno if exc is not None and exc.errno else errno.EINVAL, message)


def make_dirs(*dirs: Path) -> None:
    """Create each directory (and its parents) unless it exists; a precise OSError when a file stands
    where a directory should be, or the directory cannot be made."""
    for path in dirs:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except FileExistsError as exc:
            if path.is_symlink() and not path.exists():
                dangling = f"{path} is a symlink to {os.readlink(path)}, which does not exist"
                raise _failed(dangling, exc) from None
            raise _failed(f"{path} is a file, not a directory", exc) from None
        except NotADirectoryError as exc:
            raise _failed(f"cannot create {path}: a file stands in its path", exc) from None
        except OSError as exc:
            raise _failed(f"cannot create {path}: {exc.strerror}", exc) from None


def check_dirs(*dirs: Path) -> None:
    """Each path is a directory or absent (to be created later, by Spark for instance)."""
    for path in dirs:
        if path.is_symlink() and not path.exists():
            raise _failed(f"{path} is a symlink to {os.readlink(path)}, which does not exist")
        if path.exists() and not path.is_dir():
            raise _failed(f"{path} is a file, not a directory")


class DataDirLock:
    """An exclusive lock on a data dir for this process; `release()` (idempotent) or process exit frees
    it. Creates the data dir. Raises DataDirInUseError when another process holds it, OSError when the
    dir cannot be made, written or locked."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._fd: int | None = None
        make_dirs(data_dir)
        path = data_dir / LOCK_FILE
        try:
            # not inherited by children (Python's default, O_CLOEXEC): Spark's JVM must not keep it
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            raise _failed(f"cannot open the lock file {path}: {exc.strerror}", exc) from None
        # a FIFO or device there was locked, then refused as "data dir ... is not writable: Invalid argument"
        try:
            check_regular(fd, path)
        except OSError as exc:
            os.close(fd)
            raise _failed(f"cannot open the lock file {path}: {exc.strerror}; remove it", exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise DataDirInUseError(data_dir, holder) from None
        except OSError as exc:  # e.g. a file system without locks
            os.close(fd)
            raise _failed(f"cannot lock data dir {data_dir}: {exc.strerror}", exc) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise _failed(f"data dir {data_dir} is not writable: {exc.strerror}", exc) from None
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def lost(self) -> str | None:
        """Why the lock no longer guards the data dir (its file deleted or replaced: `rm -rf` of the
        data dir while the server runs, so a second server could lock a new file there), else None."""
        if self._fd is None:
            return None
        path = self.data_dir / LOCK_FILE
        try:
            held, now = os.fstat(self._fd), os.stat(path)
        except FileNotFoundError:
            return f"the lock file {path} was deleted: the data dir {self.data_dir} was removed"
        except OSError:
            return None  # unreadable for a moment (a permission change): not proof of loss
        if held.st_nlink == 0 or (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino):
            return f"the lock file {path} was replaced: the data dir {self.data_dir} was removed"
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()  # an owner dropped without stop(): free the data dir with the object


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip())
    return None  # the holder has not written it yet


def bind_address(host: str, port: int) -> str:
    """host:port as gRPC takes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def check_port(host: str, port: int, what: str) -> None:
    """Fail now, with an OSError starting with `what`, when `host:port` cannot be bound: in use by a
    listening socket (another server), or not an address of this host. Port 0 (any) always passes.

    A probe, not a reservation: a server binding in between still fails at its own bind.
    """
    if port == 0:
        return
    name = host.strip("[]")
    try:
        addresses = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise _failed(f"{what} {host}:{port}: {exc.strerror}") from None
    problems: list[OSError] = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            # as the servers do: connections of an earlier run in TIME_WAIT are no conflict, a
            # listening socket is (Linux refuses that bind even with SO_REUSEADDR)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # gRPC binds dual-stack
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise _failed(
                        f"{what} {host}:{port}: address in use (by another sluice serve? "
                        f"`ss -ltnp 'sport = :{port}'` names the process)",
                        exc,
                    ) from None
                problems.append(exc)
    if problems and len(problems) == len(addresses):  # gRPC binds if any address binds
        raise _failed(f"{what} {host}:{port}: {problems[0].strerror}", problems[0])


def check_security(config: ServeConfig) -> None:
    """Read and check the TLS files, the auth file and the peer token file as the server will; raise a
    ValueError (ingest.tls.TlsFileError, receivers.auth.AuthFileError) that names the file and the flag."""
    security = config.security
    if security.tls is not None:
        load_tls(security.tls)
    if security.auth_file is not None:
        AuthTable.load(security.auth_file, base=security.limits)
    if config.peer_token_file is not None:
        try:
            Credentials.from_files(token_file=config.peer_token_file)
        except CredentialsError as exc:
            raise ValueError(f"--peer-token-file: {exc}") from None


def check_ports(grpc_port: tuple[str, int, str], metrics: tuple[str, int | None], health: int | None) -> None:
    """check_port for a server's gRPC port ((host, port, what it is for)), its metrics port and its
    plaintext health port (which binds every address), those that are set."""
    check_port(*grpc_port)
    if metrics[1] is not None:
        check_port(metrics[0], metrics[1], "cannot serve metrics on")
    if health is not None:
        check_port("0.0.0.0", health, "cannot serve health on")  # noqa: S104 - as it binds


def check_file_size_limit(segment_bytes: int) -> None:
    """Refuse a file size limit (RLIMIT_FSIZE, `ulimit -f`) below the block log's segment size: every
    write past it fails with EFBIG (Python ignores SIGXFSZ), so the block that would cross it was retried
    every 0.2 s for good and intake stopped. Checked against the segment size, not the segment size plus
    the largest block (a segment is closed once it reaches segment_bytes, so its last block may end past
    it): a block's bound is the per-stream buffer, hundreds of MiB by default, and refusing every limit
    below that would refuse sane ones; a limit this close to the segment size is rare and a block that
    crosses it still fails loudly. The other files the server writes (settings, states) are small."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft == resource.RLIM_INFINITY or soft >= segment_bytes:
        return
    raise _failed(
        f"the file size limit (RLIMIT_FSIZE, `ulimit -f`: {soft:,} bytes) is below the block log's segment "
        f"size ({segment_bytes:,} bytes, --segment-bytes): writing a block past it fails with EFBIG; "
        "raise the limit (`ulimit -f unlimited`; LimitFSIZE= in a systemd unit) or lower --segment-bytes"
    )


def lock_checked(data_dir: Path, check: Callable[[], None]) -> DataDirLock:
    """Lock `data_dir` (DataDirLock), then run `check`; if it raises, the lock is released first."""
    lock = DataDirLock(data_dir)
    try:
        check()
    except BaseException:
        lock.release()
        raise
    return lock


def prepare(config: ServeConfig) -> DataDirLock:
    """Everything `sluice serve` can check before it starts Spark: the data dir (locked for this
    process: hold the returned lock for the process's life and give it to SluiceServer), the folders
    it will use, and its ports. An OSError that says what is wrong, and nothing held, otherwise."""

    def check() -> None:
        check_file_size_limit(config.wal_segment_bytes)
        make_dirs(config.blocks_dir)
        check_dirs(*(config.blocks_dir / stream for stream in config.streams))
        if config.spark:
            check_dirs(config.checkpoint_dir, config.sink_dir)
        check_ports(
            (config.host, config.port, "cannot bind gRPC to"),
            (config.metrics_host, config.metrics_port),
            config.health_port,
        )

    return lock_checked(config.data_dir, check)
