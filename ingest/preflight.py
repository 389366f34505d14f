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
import logging
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

log = logging.getLogger(__name__)


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
    it, `abandon()` after a start that failed. Creates the data dir. Raises DataDirInUseError when another
    process holds it, OSError when the dir cannot be made, written or locked."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._fd: int | None = None
        self._made = _missing_folders(data_dir)
        """The folders of the data dir's path that did not exist (the data dir first, then its parents)."""
        path = data_dir / LOCK_FILE
        self._made_lock_file = not os.path.lexists(path)
        self._was_empty = False
        """Whether the data dir held nothing (but an old lock file) once locked: all in it is this start's."""
        make_dirs(data_dir)
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
        with contextlib.suppress(OSError):  # unlistable: not known to be empty
            self._was_empty = set(os.listdir(data_dir)) <= {LOCK_FILE}

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

    def abandon(self) -> None:
        """Release the lock of a start that failed before it served (its gRPC port taken since the
        check, Spark that did not start, a setting refused): when the data dir held nothing as it was
        locked (new, or empty but for an old lock file), what the start put there goes first, so the
        next start finds it as this one did. A start that bound no port left a node.json that named
        the node it was (by mistake) started as, and refused the next start as the right node; and
        left a new data dir where there was none.

        Only what a start writes before it serves is removed: its state files (_start_files()), its
        empty folders (blocks/), the lock file if this lock made it, then the folders of the data dir's
        path this lock made. A data dir that held anything when locked is left as it is, and so is one
        that now holds any other file (a segment, an incarnation: the start got further than its ports;
        a file of someone else's): all of it or none. The lock is released in any case."""
        if self._fd is None:
            return
        try:
            if self._was_empty:
                _take_back(self.data_dir, self._made, lock_file=self._made_lock_file)
        except Exception:  # never in place of the error that failed the start
            log.warning("could not remove what the failed start put in %s", self.data_dir, exc_info=True)
        finally:
            self.release()

    def __del__(self) -> None:
        self.release()  # an owner dropped without stop(): free the data dir with the object


def _missing_folders(path: Path) -> list[Path]:
    """`path` and its parents that do not exist (none is a file or a symlink), innermost first."""
    missing: list[Path] = []
    for folder in (path, *path.absolute().parents):
        if os.path.lexists(folder):
            break
        missing.append(folder)
    return missing


def _start_files() -> tuple[str, ...]:
    """The state files a start writes under a data dir before it serves (claim_data_dir's node.json,
    a cluster node's committed.json, the settings and streams a start may rewrite)."""
    from ingest import runtime_config, streams  # noqa: PLC0415 - a failed start's only
    from ingest.receiver_node import COMMITTED_FILE  # noqa: PLC0415
    from receivers.node_identity import NODE_FILE  # noqa: PLC0415

    return (NODE_FILE, COMMITTED_FILE, runtime_config.FILE, streams.FILE)


def _take_back(data_dir: Path, made: list[Path], *, lock_file: bool) -> None:
    """DataDirLock.abandon's removal, in a data dir that held nothing when it was locked: all of it or
    nothing, when it holds a file that a start does not write before it serves."""
    state = {data_dir / name for name in _start_files()}
    folders: list[str] = []

    def raise_it(exc: OSError) -> None:
        raise exc

    # children first; a folder that cannot be listed fails it all before anything is removed
    for folder, subfolders, files in os.walk(data_dir, topdown=False, onerror=raise_it):
        for path in (Path(folder, name) for name in (*files, *subfolders)):
            ours = path.is_dir() or path == data_dir / LOCK_FILE or (path in state and path.is_file())
            if path.is_symlink() or not ours:
                return  # a log's file, Spark's or someone's: the start went further than its ports
        folders.append(folder)
    for path in state:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    for empty in folders[:-1]:  # the last is the data dir itself
        os.rmdir(empty)
    if lock_file:
        # unlinked while still locked: a start that opened it meanwhile found it locked, and refused
        (data_dir / LOCK_FILE).unlink()
    for made_here in made:
        try:
            os.rmdir(made_here)
        except OSError:
            break  # not empty (what is in it stays), or gone


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
        AuthTable.load(security.auth_file, base=security.limits, client_ca=security.verifies_clients)
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
    """Lock `data_dir` (DataDirLock), then run `check`; if it raises, the lock is abandoned first (a
    new data dir is left as it was found: DataDirLock.abandon)."""
    lock = DataDirLock(data_dir)
    try:
        check()
    except BaseException:
        lock.abandon()
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
