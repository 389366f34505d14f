"""The `sluice` command: serve, push, rate.

Exit codes: 0 done, 1 failed (the message says why), 2 bad usage or a missing prerequisite, 3 refused by
the server: not authenticated (UNAUTHENTICATED), not permitted (PERMISSION_DENIED), or a TLS handshake
refused on certificates, 130 stopped by Ctrl-C.

The console script's entry point is ingest.console, which holds the signals while this module is imported.

The client commands (push, rate, sessions) take credentials the usual gRPC way: --ca-file, --cert-file,
--key-file and --token-file, or SLUICE_CA_FILE, SLUICE_CERT_FILE, SLUICE_KEY_FILE and SLUICE_TOKEN_FILE or
SLUICE_TOKEN (sluice_client.credentials); never a token on the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import dataclasses
import errno
import functools
import io
import ipaddress
import logging
import math
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import grpc

from ingest import console, logs
from ingest.client_hints import connect_hint, refused, tls_to_plaintext_hint
from ingest.config import (
    DEFAULT_METRICS_PORT,
    DEFAULT_PORT,
    DRIVER_ONLY_SETTINGS,
    OutOfRange,
    RateConfig,
    SecurityConfig,
    ServeConfig,
    TlsConfig,
    ascii_float,
    ascii_int,
    format_estimator_params,
    is_loopback,
    parse_estimator_params,
)
from ingest.config_sources import (
    CONFIG_ENV,
    ENV,
    FILE,
    FLAG,
    RUNTIME,
    ConfigError,
    Key,
    Origin,
    apply_sources,
    explicit_dests,
    keys_of,
    name_keys,
    subparser,
)
from ingest.extras import server_extra_problem
from ingest.logs import SPARK_LOG_LEVELS, SPARK_QUIET
from ingest.pipeline_control import BOUNDARY_TIMEOUT, DEFAULT_FIRST_BATCH_TIMEOUT, STOP_TIMEOUT
from ingest.pipeline_state import STATE_FILE, PipelineStateError, in_force, read_state
from ratecontrol import InvalidRateError, StreamPolicy, UnknownEstimatorError
from receivers.auth import AuthFileError, new_token, token_hash
from receivers.cluster import REFUSAL_HEADER, Cluster, ClusterConfigError, Node, load_nodes
from receivers.config import FsyncPolicy, ReceiverConfig
from receivers.errors import printable, shown
from receivers.files import DataDirStateError
from receivers.names import check_stream_name
from receivers.principal import MAX_IDLE_TIMEOUT, MIN_IDLE_TIMEOUT, Limits
from receivers.sizes import parse_size
from sluice_client.credentials import Credentials, CredentialsError
from sluice_client.errors import FlushTimeoutError, RecordTooLargeError, RPCError, SluiceError
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from sluice_client.producer import DEFAULT_MAX_BUFFERED, MAX_RECORD_BYTES, check_target
from sluice_client.tasks import reap

if TYPE_CHECKING:
    from rich.console import Console

    from ingest.driver_config import DriverConfig
    from ingest.input_lines import InputLines, Lines
    from ingest.preflight import DataDirLock
    from ingest.spark.pipeline import Pipeline
    from sluice_client import Producer

log = logging.getLogger("sluice")

T = TypeVar("T")

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DENIED = 3
"""The server refused the credentials (UNAUTHENTICATED, a TLS handshake refused on certificates) or
what they may do (PERMISSION_DENIED)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (SIGINT), as a shell reports a process it ended (128 + 2)."""
DRAIN_SECONDS = 120.0
PUSH_TIMEOUT = 60.0
DEFAULT_BATCH_SIZE = 4096
"""On SIGTERM, how long Spark may take to process what was sealed before the query is stopped anyway."""


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but a flag given a bare -- as its value (`--stream=--`) is a usage error: argparse drops
    the -- (it reads it as the end of the flags) and stores an empty list, which no command expects."""

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            # --key-separator reads escapes: the one flag where -- is a value worth having
            hint = "; write it escaped: '\\x2d\\x2d'" if action.dest == "key_separator" else ""
            self.error(
                f"argument {'/'.join(action.option_strings)}: -- is not a value here (it ends the flags)"
                + hint
            )
        return super()._get_values(action, arg_strings)

    def _parse_optional(self, arg_string: str) -> Any:
        # argparse takes "-5" for a value but "-inf", "-nan" or "-1e3" for an unknown flag ("the
        # following arguments are required: RATE"): let every number through to the command's own check
        if (
            arg_string.startswith("-")
            and arg_string not in self._option_string_actions
            and not self._has_negative_number_optionals
            and _is_float(arg_string)
        ):
            return None
        return super()._parse_optional(arg_string)


class _Version(argparse.Action):
    """`sluice --version`: the installed distribution's version (its metadata, looked up only when
    asked: the parser is built for every command), printed on stdout, exit 0."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(
            option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        if sys.stdout is None:  # closed (ingest.console.open_standard_fds): print() would do nothing
            parser.exit(EXIT_FAILED, "sluice: cannot write the version: stdout is closed\n")
        try:
            print(f"sluice {installed_version()}", flush=True)
        except BrokenPipeError:  # `sluice --version | head -c1`: the reader went away, as main() takes it
            _stdout_to_devnull()
        except OSError as exc:  # a full disk under a redirect
            # what stdout holds would fail again at the exit ('Exception ignored', exit 120)
            _stdout_to_devnull()
            parser.exit(EXIT_FAILED, f"sluice: cannot write the version: {exc.strerror}\n")
        parser.exit()


def _stdout_to_devnull() -> None:
    """Point stdout's descriptor at /dev/null (logs.point_at_devnull), if it can be."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        logs.point_at_devnull(sys.stdout.fileno())


def installed_version() -> str:
    """The version of the installed `sluice` distribution ("unknown (not installed)" when this code runs
    from a checkout that pip never installed)."""
    from importlib import metadata  # noqa: PLC0415 - only --version needs it

    try:
        return metadata.version("sluice")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def main(argv: Sequence[str] | None = None, *, whole_process: bool = False) -> int:  # noqa: PLR0911
    """The `sluice` command; `whole_process`: this process is the command's (the console script,
    `python -m ingest.cli`), not a caller's (a test's), so its stderr is the command's own (logs.setup)."""
    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.origins = {}
    if getattr(args, "layered_settings", False):  # serve, config check: flags > environment > file
        try:
            _layer_settings(args, argv, os.environ)
        except ConfigError as exc:
            logs.setup(args.log_level, args.log_format, whole_process=whole_process)
            return _fail(str(exc), EXIT_USAGE)
    logs.setup(args.log_level, args.log_format, whole_process=whole_process)
    if whole_process and isinstance(sys.stdout, io.TextIOWrapper):
        # as stderr has it: a name a client chose (a producer id, a principal) that the output's encoding
        # lacks (PYTHONIOENCODING=ascii, a Latin-1 locale) is escaped, not a UnicodeEncodeError traceback
        # in `sluice sessions list` or `sluice status`
        sys.stdout.reconfigure(errors="backslashreplace")
    output = _Output(sys.stdout)
    sys.stdout = output  # a TextIO in all but name
    try:
        _take_signals(serve=args.run is _serve)
        code: int = args.run(args)
        output.flush()  # what a buffered stdout holds: its failure is the command's, not the exit's
    except _Failed as failed:
        return failed.code
    except UnicodeEncodeError:
        # an argument that is not UTF-8 text (bytes the shell passed, kept as surrogates by Python) met
        # a field that must be text: a stream name, a producer id, a setting
        bad = next((a for a in argv if not _is_utf8(a)), None)
        if bad is None:
            raise
        shown = bad.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        return _fail(f"an argument is not UTF-8 text: '{shown[:100]}'", EXIT_USAGE)
    except KeyboardInterrupt:  # Ctrl-C where the command does not say what it means itself
        logs.say("interrupted", level=logging.WARNING)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `sluice rate get | head -1`: the reader went away, nothing is wrong
        output.drop()  # what stdout still holds would fail again at the exit
        return 0
    except OSError as exc:
        if not output.failed:
            raise
        # a full disk under `> FILE` (ENOSPC, EDQUOT, EIO): a traceback from the print that met it, or,
        # with stdout buffered, 'Exception ignored' at the exit and exit 120 (`sluice token > FILE` had
        # printed the token's hash line by then: a hash without its token)
        output.drop()
        return _fail(f"cannot write the output on stdout: {exc.strerror or exc}")
    finally:
        sys.stdout = output.inner
    return code


class _Output:
    """sys.stdout while a command runs: a write or flush of it that fails is noted (`failed`), so that
    main() tells a failure of the output from one of anything else the command does."""

    def __init__(self, inner: IO[str] | None) -> None:
        self.inner = inner
        """None: stdout was closed when the process started (ingest.console.open_standard_fds)."""
        self.failed = False

    def write(self, text: str) -> int:
        if self.inner is None:  # print() to a None stdout did nothing: `sluice token >&-` lost the token
            self.failed = True
            raise OSError(errno.EBADF, "it is closed")
        try:
            return self.inner.write(text)
        except OSError:
            self.failed = True
            raise

    def flush(self) -> None:
        if self.inner is None:
            return
        try:
            self.inner.flush()
        except OSError:
            self.failed = True
            raise

    def drop(self) -> None:
        """Point stdout's descriptor at /dev/null: what it still holds would fail once more at the exit."""
        if self.inner is None:
            return
        with contextlib.suppress(OSError, ValueError, AttributeError):
            logs.point_at_devnull(self.inner.fileno())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _take_signals(*, serve: bool) -> None:
    """Take over the signals the console script held while the CLI's modules were imported
    (ingest.console), and act on one that came meanwhile as if it came now: Ctrl-C is a KeyboardInterrupt
    (exit 130); SIGTERM and SIGHUP take their default actions, except for `sluice serve`, which takes
    them over itself (_serve)."""
    if console.release(signal.SIGINT, signal.default_int_handler):
        raise KeyboardInterrupt
    if serve:
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if console.release(signum, signal.SIG_DFL):
            signal.raise_signal(signum)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _layer_settings(args: argparse.Namespace, argv: Sequence[str], environ: Mapping[str, str]) -> None:
    """Fill in `args` from the environment and the config file (ingest.config_sources) for what the
    command line did not give; args.origins: destination -> where its value came from."""
    keys = _serve_keys()
    config_file = args.config
    if config_file is None and environ.get(CONFIG_ENV):
        config_file = Path(environ[CONFIG_ENV])
    args.config = config_file
    args.shadowed = {}
    explicit = explicit_dests(_parser(), argv)
    args.origins = apply_sources(args, keys, explicit, environ, config_file, shadowed=args.shadowed)


def _serve_keys() -> dict[str, Key]:
    """The settings of `sluice serve`, by key: its flags without their dashes."""
    return keys_of(subparser(_parser(), "serve"))


NAME_MAX = 255
"""Bytes a file name (one component of a path) may have: Linux's NAME_MAX, on every common file system."""
PATH_MAX = 4096
"""Bytes a path may have, with its terminating NUL: Linux's PATH_MAX."""


def _path(text: str) -> Path:
    """A path argument. An empty one (an unset variable in a unit file: --data-dir "$DIR") is refused:
    as a Path it is the current folder, where the service would then keep its log. So are those no
    system call takes (each would end in an OSError traceback, or a message about another file): a NUL
    (possible from a config file only), a name over NAME_MAX bytes, a path over PATH_MAX."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset variable?): '.' is the current folder")
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"a path cannot hold a NUL character, got '{printable(text)}'")
    size = len(os.fsencode(text))
    if size >= PATH_MAX:
        raise argparse.ArgumentTypeError(
            f"a path of {size:,} bytes: over the {PATH_MAX - 1:,} a path may have"
        )
    name = max(text.split("/"), key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(name)) > NAME_MAX:
        raise argparse.ArgumentTypeError(
            f"a name of {len(os.fsencode(name)):,} bytes in the path ({printable(name[:20])}...): over the "
            f"{NAME_MAX} bytes a file name may have"
        )
    return Path(text)


def _file_name(text: str) -> str:
    """A file to read, or - for standard input; not an empty name (open('') says "Is a directory")."""
    _path(text)
    return text


def _parser() -> argparse.ArgumentParser:  # noqa: PLR0915 - one flat list of flags reads best
    parser = _ArgumentParser(prog="sluice", description="Backpressure-aware ingestion for Spark.")
    parser.add_argument("--version", action=_Version, help="print the installed version of sluice and exit")
    parser.add_argument("--log-level", default="info", choices=logs.LEVELS)
    parser.add_argument(
        "--log-format", default=logs.PLAIN, choices=logs.FORMATS, help="plain lines or JSON lines on stderr"
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the service until SIGINT/SIGTERM",
        description="Run the service until SIGINT/SIGTERM. Every flag can also be set in the config file "
        "(--config; key: the flag without its dashes) or the environment (SLUICE_ + the flag in upper case, "
        "dashes as underscores); flags win over the environment, the environment over the file "
        "(docs/configuration.md).",
    )
    serve.add_argument(
        "--config",
        type=_path,
        metavar="TOML",
        help=f"settings file, keys named as these flags (default: ${CONFIG_ENV}, else none)",
    )
    # here too, so that `sluice serve --log-format json` and the file and the environment can set them
    serve.add_argument("--log-level", default=argparse.SUPPRESS, choices=logs.LEVELS, help="(default: info)")
    serve.add_argument(
        "--log-format",
        default=argparse.SUPPRESS,
        choices=logs.FORMATS,
        help="plain lines, or JSON lines (Spark's too) on stderr (default: plain)",
    )
    serve.add_argument(
        "--spark-log-level",
        default=SPARK_QUIET,
        choices=SPARK_LOG_LEVELS,
        help="Spark's log4j level; quiet: warn without two known idle warnings (default: %(default)s)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="gRPC bind address (default: %(default)s)")
    serve.add_argument(
        "--port", type=ascii_int, default=DEFAULT_PORT, help="gRPC port, 0 = any (default: %(default)s)"
    )
    serve.add_argument(
        "--metrics-port",
        type=_metrics_port,
        default=DEFAULT_METRICS_PORT,
        help="Prometheus /metrics port, 0 = any, -1 = off (default: %(default)s)",
    )
    serve.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="/metrics bind address (default: %(default)s)",
    )
    _security_flags(serve)
    _cluster_flags(serve)
    serve.add_argument(
        "--data-dir",
        type=_path,
        default=Path("sluice-data"),
        help="blocks, checkpoints and the default sink (default: %(default)s)",
    )
    serve.add_argument(
        "--stream",
        action="append",
        dest="streams",
        metavar="NAME",
        help="a stream to receive; repeat for more (default: default)",
    )
    serve.add_argument(
        "--block-interval",
        type=ascii_float,
        default=0.2,
        help="seconds between sealed blocks, 0.01..3600 (default: %(default)s)",
    )
    serve.add_argument(
        "--block-linger",
        type=_seconds_or_off,
        default=ReceiverConfig.block_linger,
        metavar="SECONDS|off",
        help="seal a block early once no batch has come for this long, so a flush or a lone record is "
        "acked in about this long plus a write, not a block interval (default: %(default)s)",
    )
    serve.add_argument(
        "--buffer-records",
        type=ascii_int,
        default=500_000,
        help="records buffered + credit outstanding per stream (default: %(default)s)",
    )
    serve.add_argument(
        "--buffer-bytes",
        type=_size,
        default=ReceiverConfig.buffer_bytes,
        metavar="SIZE",
        help="per stream, bytes buffered + bytes outstanding credit may bring (estimated per record): "
        "the memory budget; e.g. 512MiB (default: 256MiB)",
    )
    serve.add_argument(
        "--memory-budget",
        type=_budget,
        default=None,
        metavar="SIZE",
        help="bytes every stream together may buffer + bring with outstanding credit, counted as "
        "--buffer-bytes counts one stream's: the server's memory budget; e.g. 1GiB, or none (default: none)",
    )
    serve.add_argument(
        "--disk-budget",
        type=_budget,
        default=None,
        metavar="SIZE",
        help="bytes the block log (all streams) may take on disk before credit pauses until Spark "
        "releases blocks; e.g. 20GiB, or none (default: none)",
    )
    serve.add_argument(
        "--segment-bytes",
        type=_size,
        default=None,
        metavar="SIZE",
        help="block log segment size (default: 64MiB, or a quarter of --disk-budget if smaller)",
    )
    serve.add_argument(
        "--prefetch",
        type=ascii_int,
        default=None,
        help="credit a session is topped up to (default: half the buffer)",
    )
    serve.add_argument(
        "--low-tide",
        type=ascii_int,
        default=None,
        help="top a session up when its credit falls to this (default: half the prefetch)",
    )
    serve.add_argument(
        "--block-records",
        type=ascii_int,
        default=None,
        help="seal a block early once this many records wait (default: a quarter of the buffer)",
    )
    serve.add_argument(
        "--estimator",
        default=None,
        help="rate estimator: model, spark-pid or fixed (default: model; fixed with --no-spark)",
    )
    serve.add_argument(
        "--estimator-params",
        type=_estimator_params,
        default={},
        metavar="NAME=VALUE,...",
        help="the estimator's own parameters, e.g. proportional=1,integral=0.2 for spark-pid",
    )
    serve.add_argument(
        "--initial-rate",
        type=ascii_float,
        default=None,
        help="records/s before the first batch is measured (default: inf with the model estimator, which "
        "bounds each batch by the receivers' memory until it has measured one, and with --no-spark; a "
        "driver: the capacity its pipeline showed in an earlier run (DATA_DIR/rate-memory.json), else 10000; "
        "else 10000)",
    )
    serve.add_argument(
        "--min-rate", type=ascii_float, default=100.0, help="lowest rate (default: %(default)s)"
    )
    serve.add_argument("--max-rate", type=ascii_float, default=math.inf, help="highest rate (default: inf)")
    for flag, what in (
        ("weight", "its weight in the split of the rate among busy streams (default: 1)"),
        ("min-rate", "records/s it keeps however little it takes, as far as the rate allows (default: 0)"),
        ("max-rate", "records/s it never exceeds (default: inf)"),
    ):
        serve.add_argument(
            f"--stream-{flag}",
            action="append",
            type=_stream_value,
            default=[],
            metavar="STREAM=VALUE",
            help=f"per stream, {what}; repeat for more streams",
        )
    serve.add_argument("--master", default="local[*]", help="Spark master (default: %(default)s)")
    serve.add_argument(
        "--pipeline",
        type=_pipeline_spec,
        metavar="MODULE:FUNCTION",
        help="function(df) -> DataStreamWriter; default: append to Parquet under DATA_DIR/sink",
    )
    serve.add_argument(
        "--reset-pipeline",
        action="store_true",
        help="run --pipeline (or the built-in sink) although a pipeline swapped in at run time "
        "(DATA_DIR/pipeline.json) would run: a new generation starts where that one committed",
    )
    serve.add_argument(
        "--trigger-interval",
        type=ascii_float,
        default=1.0,
        help="seconds between Spark micro-batches (default: %(default)s)",
    )
    durability = serve.add_mutually_exclusive_group()
    durability.add_argument(
        "--fsync",
        type=_fsync_policy,
        default=FsyncPolicy.every_block(),
        metavar="every-block|interval:MS|off",
        help="when the block log is fsynced: before every block is acked (the default); in the background "
        "at least every MS milliseconds and once 8 MiB wait, acks waiting for it (fewer fsyncs when blocks "
        "are small, up to MS ms later acks); or never (acked blocks may be lost in a power loss)",
    )
    durability.add_argument(
        "--no-fsync",
        dest="fsync",
        action="store_const",
        const=FsyncPolicy.off(),
        help="the same as --fsync off (benchmarks on throwaway data only)",
    )
    serve.add_argument(
        "--accept-wal-damage",
        action="append",
        type=_stream_names,
        default=[],
        metavar="STREAM[,STREAM]",
        help="go on past damage in these streams' block logs that a start otherwise refuses (acked "
        "blocks damaged or missing): the blocks lost are recorded (blocks/STREAM/lost.json), named in "
        "an ERROR and counted (sluice_wal_lost_blocks_total); the blocks after them are kept and served, "
        "and Spark's query takes the lost records for data loss. Needed once: later starts know the gap",
    )
    serve.add_argument("--no-spark", action="store_true", help="receive and store blocks without Spark")
    serve.set_defaults(run=_serve, layered_settings=True)

    push = commands.add_parser("push", help="push lines of a file (or - for stdin) as records")
    push.add_argument("file", type=_file_name, help="a file, or - for standard input")
    push.add_argument(
        "--target",
        type=_targets,
        default=f"127.0.0.1:{DEFAULT_PORT}",
        help="server, or receiver nodes comma-separated (HOST:PORT,HOST:PORT) to fail over between in "
        "order (default: %(default)s)",
    )
    push.add_argument("--stream", default="default", help="stream (default: %(default)s)")
    push.add_argument(
        "--batch-size",
        type=ascii_int,
        default=DEFAULT_BATCH_SIZE,
        help="records per batch (default: %(default)s)",
    )
    push.add_argument(
        "--timeout",
        type=ascii_float,
        default=PUSH_TIMEOUT,
        help="give up after this many seconds without progress: waiting for the server at start or "
        "after losing it, or for acks (default: %(default)s)",
    )
    push.add_argument(
        "--producer-id",
        default=None,
        help="the producer id the server deduplicates by (default: a new random one, printed on failure)",
    )
    push.add_argument(
        "--resume-from",
        type=ascii_int,
        default=None,
        metavar="N",
        help="skip the first N records of the input, sent and acked by an earlier push with the same "
        "--producer-id, and resend the rest (what the server has of them is dropped as duplicates; a "
        "failed push prints the command). Without it a push is a new run of its producer id, refused "
        "if the server holds records of that id",
    )
    push.add_argument(
        "--key-separator",
        metavar="SEP",
        help="each line is KEY SEP VALUE, cut at the first SEP; a line without SEP is a value without a "
        "key. SEP may hold the escapes \\t, \\\\ and \\xNN (a byte in hex), e.g. '\\t' "
        "for a tab; give a SEP that starts with - as --key-separator=SEP "
        "(default: whole lines are values, no keys)",
    )
    push.add_argument("--no-progress", action="store_true", help="no progress bar")
    _credential_flags(push)
    push.set_defaults(run=_push)

    rate = commands.add_parser("rate", help="read or set the ingest rate")
    server = _ArgumentParser(add_help=False)
    server.add_argument(
        "--target", type=_target, default=f"127.0.0.1:{DEFAULT_PORT}", help="server (default: %(default)s)"
    )
    _credential_flags(server)
    rate_commands = rate.add_subparsers(required=True, metavar="ACTION")
    get = rate_commands.add_parser("get", help="the rate, bounds, estimator, last batch", parents=[server])
    get.set_defaults(run=_rate_get)
    set_ = rate_commands.add_parser(
        "set", help="set the rate in records/s (inf = unlimited)", parents=[server]
    )
    set_.add_argument(
        "records_per_second",
        type=ascii_float,
        metavar="RATE",
        help="records/s, > 0 and at most 1e12, or inf (unlimited); held within the rate bounds",
    )
    set_.add_argument("--pin", action="store_true", help="keep it until unpinned: the estimator is ignored")
    set_.set_defaults(run=_rate_set)
    bounds = rate_commands.add_parser("bounds", help="set the min and max rate", parents=[server])
    bounds.add_argument("min_rate", type=ascii_float, metavar="MIN", help="records/s, 1e-06 to 1e12")
    bounds.add_argument(
        "max_rate", type=ascii_float, metavar="MAX", help="records/s, MIN to 1e12, or inf (no maximum)"
    )
    bounds.set_defaults(run=_rate_bounds)
    estimator = rate_commands.add_parser("estimator", help="choose the estimator", parents=[server])
    estimator.add_argument("name", metavar="NAME", help="model, spark-pid or fixed")
    estimator.set_defaults(run=_rate_estimator)

    settings = commands.add_parser(
        "config", help="check the settings offline, or read or change those of the running service"
    )
    config_commands = settings.add_subparsers(required=True, metavar="ACTION")
    config_check = config_commands.add_parser(
        "check",
        parents=[serve],
        add_help=False,
        help="check serve's settings (file, environment, flags) without starting anything",
        description="Validate the settings `sluice serve` would run with, as it does (every value, the TLS "
        "and auth files, the pipeline, Java, DATA_DIR/runtime-config.json), and print each with its "
        "source, without binding a port, locking the data dir or starting Spark. Exit 0 if valid, 2 if not.",
    )
    config_check.set_defaults(run=_config_check)
    config_get = config_commands.add_parser("get", help="settings, values and sources", parents=[server])
    config_get.add_argument("keys", nargs="*", metavar="KEY", help="settings to show (default: all)")
    config_get.set_defaults(run=_config_get)
    config_set = config_commands.add_parser(
        "set", help="change settings now (all or none); kept across restarts", parents=[server]
    )
    config_set.add_argument("changes", nargs="+", type=_key_value, metavar="KEY=VALUE")
    config_set.add_argument("--validate-only", action="store_true", help="check, change nothing")
    config_set.set_defaults(run=_config_set)
    config_reset = config_commands.add_parser(
        "reset", help="back to the command line's values", parents=[server]
    )
    config_reset.add_argument("keys", nargs="+", metavar="KEY")
    config_reset.set_defaults(run=_config_reset)

    streams = commands.add_parser("streams", help="list, add or remove streams of the running service")
    stream_commands = streams.add_subparsers(required=True, metavar="ACTION")
    streams_list = stream_commands.add_parser("list", help="streams, states, backlogs", parents=[server])
    streams_list.set_defaults(run=_streams_list)
    streams_add = stream_commands.add_parser("add", help="serve a new stream now", parents=[server])
    streams_add.add_argument("name", metavar="STREAM")
    streams_add.set_defaults(run=_streams_add)
    streams_remove = stream_commands.add_parser(
        "remove", help="stop serving a stream: its publishers are cancelled", parents=[server]
    )
    streams_remove.add_argument("name", metavar="STREAM")
    backlog = streams_remove.add_mutually_exclusive_group(required=True)
    backlog.add_argument(
        "--drain", action="store_true", help="the query processes what was acked, then the stream is gone"
    )
    backlog.add_argument(
        "--keep", action="store_true", help="the query stops reading it now; its blocks wait for an add"
    )
    streams_remove.add_argument("--reason", default="", help="told to its publishers")
    streams_remove.set_defaults(run=_streams_remove)

    pipeline = commands.add_parser("pipeline", help="show or swap the running Spark pipeline")
    pipeline_commands = pipeline.add_subparsers(required=True, metavar="ACTION")
    pipeline_get = pipeline_commands.add_parser(
        "get", help="the pipeline and the last swap", parents=[server]
    )
    pipeline_get.set_defaults(run=_pipeline_get)
    swap = pipeline_commands.add_parser(
        "swap", help="replace the query at a batch boundary; intake goes on", parents=[server]
    )
    swap.add_argument(
        "spec",
        metavar="MODULE:FUNCTION",
        type=_swap_spec,
        help="the new pipeline ('builtin': the Parquet sink)",
    )
    swap.add_argument(
        "--keep-state", action="store_true", help="continue the old checkpoint (offsets and operator state)"
    )
    swap.add_argument(
        "--first-batch-timeout",
        type=_float_in(1, 3600, "seconds"),
        default=120.0,
        metavar="S",
        help="seconds the new query has to complete its first batch before it is rolled back (120)",
    )
    swap.set_defaults(run=_pipeline_swap)

    status = commands.add_parser(
        "status",
        help="a live view of rates, batches, streams, sessions and the pipeline",
        parents=[server],
        description="The status page's numbers in the terminal, redrawn every second (Ctrl-C ends it). "
        "Read over gRPC with the usual credentials; with --metrics, from the metrics port's /status.json, "
        "which adds record counts, buffered bytes and the block log on disk.",
    )
    status.add_argument("--once", action="store_true", help="print one frame and exit")
    status.add_argument(
        "--metrics",
        metavar="URL",
        help="read /status.json from the metrics port instead, e.g. http://127.0.0.1:9464 (the token and, "
        "for https, the CA and client certificate of the credentials are used; --ca-file, --cert-file or "
        "--key-file with an http:// URL, or a token over http:// to a host that is not a loopback one, "
        "is refused)",
    )
    status.add_argument(
        "--insecure",
        action="store_true",
        help="with --metrics http://: send the token in cleartext to a host that is not a loopback one "
        "(anyone on the network can read it)",
    )
    status.set_defaults(run=_status)

    sessions = commands.add_parser("sessions", help="list or cancel publisher sessions")
    session_commands = sessions.add_subparsers(required=True, metavar="ACTION")
    listing = session_commands.add_parser("list", help="the open sessions", parents=[server])
    listing.add_argument("--stream", default="", help="one stream (default: all)")
    listing.set_defaults(run=_sessions_list)
    cancel = session_commands.add_parser("cancel", help="cancel a session", parents=[server])
    cancel.add_argument("session_id", type=_int_in(1, 2**64 - 1, "a session id"), metavar="ID")
    cancel.add_argument("--reason", default="", help="told to the client")
    cancel.add_argument(
        "--code",
        # an error status: 0 (OK) would go as the proto's "unset" and end the session CANCELLED anyway
        type=_int_in(1, 16, "a status code"),
        default=1,
        help="gRPC status code the session ends with, 1-16 (default: 1, CANCELLED)",
    )
    cancel.set_defaults(run=_sessions_cancel)

    token = commands.add_parser(
        "token",
        help="make a random bearer token and print the auth file line with its hash",
        description="Make a random token (256 bits) and write it to FILE (mode 0600) or standard output; "
        'print the auth-file line token_sha256 = "<hash>" for its principal (to standard error when '
        "the token goes to standard output). The server keeps only the hash.",
    )
    token.add_argument("--out", type=_path, metavar="FILE", help="write the token here (mode 0600)")
    token.set_defaults(run=_token)

    certs = commands.add_parser(
        "dev-certs",
        help="write a throwaway CA, server and client certificates for TLS trials (not for production)",
        description="Write DIR/ca.crt, DIR/server.crt + server.key (SANs localhost, 127.0.0.1, ::1 and "
        "each --host) and DIR/NAME.crt + NAME.key per --client (keys mode 0600), valid for 90 days. For "
        "trials only, not for production: the CA's key is not kept, so nothing more can be issued under "
        "it (run again for a new set); use your organisation's CA for real deployments.",
    )
    certs.add_argument("dir", type=_path, metavar="DIR", help="where to write them (created if missing)")
    certs.add_argument(
        "--host", action="append", default=[], metavar="NAME", help="another server name or IP; repeat"
    )
    certs.add_argument(
        "--client",
        action="append",
        default=[],
        metavar="NAME",
        help="a client certificate with this CN (the principal name in the auth file); repeat",
    )
    certs.add_argument("--force", action="store_true", help="replace files that exist")
    certs.set_defaults(run=_dev_certs)
    return parser


def _cluster_flags(serve: argparse.ArgumentParser) -> None:
    """`sluice serve`'s flags for a cluster's receiver node (docs/scaling.md)."""
    group = serve.add_argument_group(
        "cluster", "run as one receiver node of several; blocks replicated to followers before acks"
    )
    group.add_argument(
        "--role",
        choices=["single", "receiver", "driver"],
        default="single",
        help="single: ingest and Spark in this process (the default); receiver: a cluster's receiver node "
        "(ingest, its block log, copies of other nodes' blocks; no Spark); driver: the Spark query over "
        "the receiver nodes and the rate they share (its RateControl on --host/--port)",
    )
    group.add_argument(
        "--nodes", type=_path, metavar="FILE", help="the receiver nodes, one 'ID HOST:PORT' per line"
    )
    group.add_argument(
        "--node-id",
        type=_int_in(0, 999_999_999, "a node id"),
        default=None,
        metavar="ID",
        help="this node's id in --nodes (default: $SLUICE_NODE_ID)",
    )
    group.add_argument(
        "--replication",
        type=_int_in(1, 1000, "a replication"),
        default=1,
        metavar="N",
        help="copies of each block on distinct nodes before it is acked (default: %(default)s)",
    )
    group.add_argument(
        "--min-insync",
        type=_int_in(1, 1000, "a copy count"),
        default=None,
        metavar="N",
        help="copies needed to ack: with fewer followers in sync credit pauses (default: 1, keep acking)",
    )
    group.add_argument(
        "--peer-token-file",
        type=_path,
        metavar="FILE",
        help="bearer token sent to the other nodes: a principal with the peer role (receiver), or with "
        "consumer and operator (driver)",
    )
    group.add_argument(
        "--fail-on-data-loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop the query when a stream's log was lost under its checkpoint (a single server's data "
        "dir started afresh while the checkpoint survived elsewhere; a cluster node's data dir lost "
        "while its followers were down; the default) or lost records in its middle (under --fsync "
        "off), or, with --no-fail-on-data-loss, log a WARNING and read the new log from its start, or "
        "the records still there (the source option failOnDataLoss)",
    )
    group.add_argument(
        "--health-port",
        type=_int_in(0, 65535, "a port"),
        default=None,
        metavar="PORT",
        help="also serve grpc.health.v1 alone, in plaintext, on this port of every interface (for "
        "Kubernetes probes; it tells only SERVING or NOT_SERVING)",
    )


def _cluster(args: argparse.Namespace) -> Cluster | None:
    if args.role == "single":
        if args.nodes is not None:
            raise ValueError("--nodes needs --role receiver")
        return None
    if args.nodes is None:
        raise ValueError(f"--role {args.role} needs --nodes FILE (one 'ID HOST:PORT' per line)")
    node_id = args.node_id
    if node_id is None:
        env = os.environ.get("SLUICE_NODE_ID", "")
        if not (env.isascii() and env.isdigit()):
            raise ValueError("--role receiver needs --node-id ID (or $SLUICE_NODE_ID)")
        node_id = int(env)
    cluster = Cluster(load_nodes(args.nodes), node_id, args.replication, args.min_insync or 1)
    listed = int(cluster.me.target.rsplit(":", 1)[1])
    if args.role == "receiver" and listed != args.port:
        # peers would reach another process there (or none): a wrong --node-id or a second node by mistake
        raise ValueError(
            f"node {node_id} is listed at {cluster.me.target} in {args.nodes}, but --port is {args.port}: "
            "give its own --node-id, or the port its entry names"
        )
    if args.role == "receiver":
        _check_listed_host(cluster.me, args.host, args.nodes)
    return cluster


def _check_listed_host(me: Node, host: str, nodes: Path) -> None:
    """A node listed at an address of the network (an IP address that is not a loopback one) that serves
    on a loopback --host (the default, 127.0.0.1) listens where no other machine, nor that address on
    this one, reaches it: its peers, the driver and Spark's executors found it down ("did not answer")
    while it started and served without a word. ValueError (exit 2) naming both."""
    listed = me.target.rsplit(":", 1)[0].strip("[]")
    try:
        address = ipaddress.ip_address(listed)
    except ValueError:
        return  # a name: it may resolve to this machine's loopback address, as localhost does
    if address.is_loopback or address.is_unspecified or not is_loopback(host):
        return
    raise ValueError(
        f"node {me.id} is listed at {me.target} in {nodes}, but serves on {host} (--host), where the other "
        f"nodes, the driver and Spark's executors cannot reach it at {listed}: give --host {listed} "
        "(or 0.0.0.0, every address; with --tls-cert/--tls-key, or --insecure), or list it at its "
        "loopback address"
    )


def _security_flags(serve: argparse.ArgumentParser) -> None:
    """`sluice serve`'s flags for TLS, authentication and per-principal limits."""
    group = serve.add_argument_group(
        "security", "TLS, tokens and per-principal limits; SIGHUP re-reads the TLS files and the auth file"
    )
    group.add_argument("--tls-cert", type=_path, metavar="PEM", help="server certificate chain: serve TLS")
    group.add_argument("--tls-key", type=_path, metavar="PEM", help="the certificate's private key")
    group.add_argument(
        "--client-ca",
        type=_path,
        metavar="PEM",
        help="mutual TLS: every client must present a certificate signed by a CA in this file",
    )
    group.add_argument(
        "--auth-file",
        type=_path,
        metavar="TOML",
        help="principals, roles, streams, limits and token hashes (see `sluice token`); without it "
        "every caller may do everything (or, under mutual TLS, every certified client)",
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="allow plaintext gRPC or /metrics on a non-loopback address: anyone on the network can "
        "then read the traffic, tokens included, and send",
    )
    group.add_argument(
        "--metrics-tls",
        action="store_true",
        help="serve /metrics over HTTPS with --tls-cert/--tls-key (and, with --client-ca, verify the "
        "scraper's certificate)",
    )
    group.add_argument(
        "--metrics-auth",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="require a reader's or operator's bearer token (or client certificate) on /metrics "
        "(default: whenever there is an --auth-file)",
    )
    group.add_argument(
        "--max-message-bytes",
        type=_size,
        default=ServeConfig.max_message_bytes,
        metavar="SIZE",
        help="largest gRPC message the server takes or sends (default: 32MiB); a Publish message over it "
        "ends its call with RESOURCE_EXHAUSTED",
    )
    group.add_argument(
        "--handshake-timeout",
        type=_float_in(0.1, 3600.0, "a handshake timeout"),
        default=SecurityConfig.handshake_timeout,
        metavar="SECONDS",
        help="a connection that has not finished its TLS and HTTP/2 handshake by then, or a Publish "
        "call that has not sent its Open, is dropped (default: %(default)s)",
    )
    group.add_argument(
        "--connection-idle-timeout",
        type=_float_in(0.1, 2_000_000.0, "a connection idle timeout"),
        default=SecurityConfig.connection_idle_timeout,
        metavar="SECONDS",
        help="a connection with no call in progress (one that handshook and opened none, or a client "
        "between calls) is closed after this (GOAWAY; gRPC clients reconnect at their next call); an "
        "open Publish stream keeps its connection (default: %(default)s)",
    )
    group.add_argument(
        "--max-connections",
        type=_auto(_int_in(1, 2**31 - 1, "a connection count")),
        default=None,
        metavar="N",
        help="connections each gRPC port holds at once, from every client together; one over it is "
        "closed as it is accepted (default: auto, 3/4 of the open-file limit, `ulimit -n`)",
    )
    defaults = Limits()
    for flag, attr, kind, what in (
        ("max-sessions-per-principal", "max_sessions", "count", "Publish sessions one principal holds open"),
        ("max-streams-per-principal", "max_streams", "count", "streams one principal may publish to at once"),
        ("max-message-bytes-per-principal", "max_message_bytes", "size", "largest Publish message"),
        ("max-record-bytes", "max_record_bytes", "size", "largest record (key + value + headers)"),
        ("idle-timeout", "idle_timeout", "seconds", "seconds a session may hold credit and send nothing"),
    ):
        default = getattr(defaults, attr)
        parse: Callable[[str], float | int | None]
        if kind == "count":
            parse = _limit(_int_in(1, 2**31 - 1, "a count"))
        elif kind == "size":
            parse = _limit(_size)
        else:
            parse = _limit(_float_in(MIN_IDLE_TIMEOUT, MAX_IDLE_TIMEOUT, "a timeout"))
        group.add_argument(
            f"--{flag}",
            dest=f"limit_{attr}",
            type=parse,
            default=default,
            metavar="N|none" if kind == "count" else "SIZE|none" if kind == "size" else "SECONDS|none",
            help=f"{what}, for principals the auth file gives no limit of their own "
            f"(default: {'none' if default is None else f'{default:g}'})",
        )


def _limit(parse: Callable[[str], T]) -> Callable[[str], T | None]:
    """An argparse type for a limit: `parse`, or "none" (no limit)."""

    def parse_limit(text: str) -> T | None:
        return None if text.strip().lower() in ("none", "unlimited") else parse(text)

    return parse_limit


def _auto(parse: Callable[[str], T]) -> Callable[[str], T | None]:
    """An argparse type: `parse`, or "auto" (None: the server works it out)."""

    def parse_auto(text: str) -> T | None:
        return None if text.strip().lower() == "auto" else parse(text)

    return parse_auto


def _seconds_or_off(text: str) -> float | None:
    """An argparse type: seconds (>= 0, finite), or "off" (None)."""
    if text.strip().lower() == "off":
        return None
    try:
        value = ascii_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither seconds nor off") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 (finite) or off, got {text}")
    return value


def _float_in(low: float, high: float, what: str) -> Callable[[str], float]:
    """An argparse type: a number in [low, high] (so not nan or inf), else a usage error."""

    def parse(text: str) -> float:
        try:
            value = ascii_float(text)
        except OutOfRange:
            raise
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} is in {low:g}..{high:g}, got {text}")
        return value

    return parse


def _int_in(low: int, high: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high], else a usage error naming the range (a value
    the wire cannot carry would otherwise fail with a protobuf stack trace)."""

    def parse(text: str) -> int:
        try:
            value = ascii_int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} is in {low}..{high}, got {value}")
        return value

    return parse


def _estimator_params(text: str) -> dict[str, float]:
    try:
        return parse_estimator_params(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _budget(text: str) -> int | None:
    """An argparse type: a size, or "none" for no budget (as `config set` takes it)."""
    return None if text.strip().lower() == "none" else _size(text)


def _size(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return size


def _stream_names(text: str) -> list[str]:
    """STREAM[,STREAM...]: stream names, each checked as a stream's name is."""
    names = [name.strip() for name in text.split(",")]
    for name in names:
        try:
            check_stream_name(name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def _stream_value(text: str) -> tuple[str, float]:
    name, sep, value = text.rpartition("=")
    try:
        number = ascii_float(value)
    except OutOfRange as exc:
        raise argparse.ArgumentTypeError(f"{name or text!r}: {exc}") from None
    except ValueError:
        number = math.nan
    if not sep or not name or math.isnan(number):
        raise argparse.ArgumentTypeError(f"expected STREAM=NUMBER, e.g. a=3, got {text!r}")
    return name, number


def _stream_policies(args: argparse.Namespace) -> dict[str, StreamPolicy]:
    """--stream-weight/--stream-min-rate/--stream-max-rate as policies (ValueError if one is invalid
    or a stream is named twice in one flag)."""
    fields: dict[str, dict[str, float]] = {}
    for field in ("weight", "min_rate", "max_rate"):
        flag = f"stream_{field}"
        for name, value in getattr(args, flag):
            if field in fields.setdefault(name, {}):
                raise ValueError(f"--{flag.replace('_', '-')} names stream {name!r} twice")
            fields[name][field] = value
    policies = {}
    for name, given in fields.items():
        try:
            policies[name] = StreamPolicy(**given)
        except ValueError as exc:
            raise ValueError(f"{_spelled_policy(args, name, given)}: stream {name!r}: {exc}") from None
    return policies


def _spelled_policy(args: argparse.Namespace, name: str, given: dict[str, float]) -> str:
    """The key as the user wrote it (--stream-weight, SLUICE_STREAM_WEIGHT, stream-weight in FILE) of
    the value of stream `name` that StreamPolicy refuses (the first, when only together they fail)."""
    origins = getattr(args, "origins", {})
    bad = [field for field, value in given.items() if not _valid_policy(field, value)] or list(given)
    origin = origins.get(f"stream_{bad[0]}")
    return origin.spelled if origin is not None else f"--stream-{bad[0].replace('_', '-')}"


def _valid_policy(field: str, value: float) -> bool:
    try:
        StreamPolicy(**{field: value})
    except ValueError:
        return False
    return True


def _ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def _target(text: str) -> str:
    """HOST:PORT (an IPv6 host in brackets), or a gRPC URI (unix:PATH, dns:///...) as it is; not a URL
    (http://, https://, grpc://) nor a name with whitespace, which gRPC retried for the whole timeout."""
    try:
        check_target(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if ":/" in text or text.startswith(("unix:", "unix-abstract:")):
        return text
    host, _, port = text.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        # gRPC takes a port over 65535 modulo 2^16: another port, not an error
        raise argparse.ArgumentTypeError(f"invalid target {text!r}: use HOST:PORT with a port of 1-65535")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        # the hint brackets what reads as an address: "::1" split into host ":" and port 1 was told "[:]"
        hint, bare = "[HOST]:PORT", text.strip("[]")
        if _ipv6(host):
            hint = f"[{host}]:{port}"
        elif _ipv6(bare):  # an address without a port
            hint = f"[{bare}]:PORT"
        raise argparse.ArgumentTypeError(f"invalid target {text!r}: an IPv6 host goes in brackets, {hint}")
    return text


def _targets(text: str) -> str:
    """One target or several, comma-separated (push fails over between them), each as _target."""
    from sluice_client.producer import parse_targets  # noqa: PLC0415

    try:
        return ",".join(_target(name) for name in parse_targets(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fsync_policy(text: str) -> FsyncPolicy:
    try:
        return FsyncPolicy.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _credential_flags(parser: argparse.ArgumentParser) -> None:
    for flag, variable, what in (
        ("--ca-file", "SLUICE_CA_FILE", "PEM CA certificates the server's certificate must chain to (TLS)"),
        ("--cert-file", "SLUICE_CERT_FILE", "PEM client certificate for mutual TLS (with --key-file)"),
        ("--key-file", "SLUICE_KEY_FILE", "PEM private key of --cert-file"),
        ("--token-file", "SLUICE_TOKEN_FILE", "a file holding the bearer token (or SLUICE_TOKEN)"),
    ):
        parser.add_argument(flag, type=_path, metavar="FILE", help=f"{what} (default: ${variable})")


def _credentials(args: argparse.Namespace) -> Credentials:
    """The client's credentials from the flags, else the environment; _Failed (usage) if unusable."""
    try:
        return Credentials.from_env(
            ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file, token_file=args.token_file
        )
    except CredentialsError as exc:
        raise _Failed(_fail(str(exc), EXIT_USAGE)) from None


class _Failed(Exception):
    """A command failed and said why; main() exits with `code`."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _wal_error() -> type[Exception]:
    from receivers.wal import WalError  # noqa: PLC0415 - pyarrow: the server extra's, only for serve

    return WalError


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    logs.say(message, level=logging.ERROR)
    return code


def _need_server_extra(command: str, *, spark: bool) -> None:
    """The light install (no server extra) has the client commands only: say how to get the rest."""
    problem = server_extra_problem(command, spark=spark)
    if problem is not None:
        logs.write_stderr(problem)  # it starts with "sluice COMMAND": no prefix
        raise _Failed(EXIT_USAGE)


# ---- serve ---------------------------------------------------------------------------------------


def _security(args: argparse.Namespace) -> SecurityConfig:
    """The security flags as a SecurityConfig; ValueError for a combination that cannot work."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    if args.client_ca is not None and args.tls_cert is None:
        raise ValueError("--client-ca (mutual TLS) needs TLS: give --tls-cert and --tls-key too")
    tls = None if args.tls_cert is None else TlsConfig(args.tls_cert, args.tls_key, args.client_ca)
    return SecurityConfig(
        tls=tls,
        auth_file=args.auth_file,
        insecure=args.insecure,
        limits=Limits(
            max_sessions=args.limit_max_sessions,
            max_streams=args.limit_max_streams,
            max_message_bytes=args.limit_max_message_bytes,
            max_record_bytes=args.limit_max_record_bytes,
            idle_timeout=args.limit_idle_timeout,
        ),
        handshake_timeout=args.handshake_timeout,
        connection_idle_timeout=args.connection_idle_timeout,
        max_connections=args.max_connections,
        metrics_tls=args.metrics_tls,
        metrics_auth=args.metrics_auth,
    )


def _checked(args: argparse.Namespace, build: Callable[[], T], fallback: Sequence[str] = ()) -> T:
    """build(); its ValueError as a ConfigError naming the user's keys as they wrote them (a message
    naming none is said to be about the `fallback` keys)."""
    try:
        return build()
    except ClusterConfigError as exc:  # about the node list's lines: its words ("port") are not keys
        raise ConfigError(str(exc)) from None
    except AuthFileError as exc:  # names the auth file's own keys (max_sessions), not serve's flags
        raise ConfigError(str(exc)) from None
    except ValueError as exc:
        raise ConfigError(name_keys(str(exc), args.origins, _serve_keys(), fallback)) from None


DRIVER_KEYS = frozenset(
    {
        *("log-level", "log-format", "spark-log-level", "role", "nodes", "data-dir", "stream"),
        *("host", "port", "metrics-host", "metrics-port", "metrics-tls", "health-port"),
        *("tls-cert", "tls-key", "client-ca", "auth-file", "peer-token-file", "insecure"),
        *("estimator", "estimator-params", "initial-rate", "min-rate", "max-rate"),
        *("master", "pipeline", "reset-pipeline", "trigger-interval", "fail-on-data-loss"),
    }
)
"""The settings of `sluice serve` a cluster's driver takes; the others (a receiver node's: its id, the
replication, the block log, the buffers and budgets, the intake's limits and per-stream rates) are
refused when given to one, which would run without them."""


RECEIVER_IGNORES = frozenset({"master", "pipeline", "reset-pipeline", "fail-on-data-loss"})
"""The settings of `sluice serve` a receiver node runs without (the query's: the driver runs it)."""


def _refuse_unused(args: argparse.Namespace, role: str, unused: Callable[[str], bool], why: str) -> None:
    """ConfigError naming the settings given to `sluice serve --role ROLE` (flag, environment or config
    file, as the user wrote them) whose key `unused` says the role runs without; `why` ends the message,
    with {them} for "it" or "them"."""
    keys = _serve_keys()
    given: dict[str, str] = {}
    for key in keys.values():  # in the order of serve's flags
        origin = getattr(args, "origins", {}).get(key.dest)
        if origin is None or origin.source not in (FLAG, ENV, FILE) or not unused(origin.key.name):
            continue
        flags = [k.flag for k in keys.values() if k.dest == key.dest]
        given.setdefault(key.dest, "/".join(flags) if origin.source == FLAG else origin.spelled)
    if given:
        them = "them" if len(given) > 1 else "it"
        named = ", ".join(given.values())
        raise ConfigError(f"--role {role} does not use {named}: {why.format(them=them)}")


def _refuse_driver_settings(args: argparse.Namespace) -> None:
    """ConfigError naming the settings of the cluster's driver (DRIVER_ONLY_SETTINGS: the rate's bounds,
    estimator and its parameters, the trigger interval) given to `sluice serve --role receiver`, each as
    the user wrote it and where (a flag, the environment, the config file), and the driver's command for
    each. A node's own bounds clamped the share the driver pins it: `--max-rate 1000` on one node
    silently capped the whole cluster."""
    keys = _serve_keys()
    given: dict[str, str] = {}
    flags_given: list[str] = []
    envs_given: list[str] = []
    files_given: dict[str, list[str]] = {}  # config file -> its keys
    shadowed: Mapping[str, list[Origin]] = getattr(args, "shadowed", {})
    for name in DRIVER_ONLY_SETTINGS:
        origin = args.origins.get(keys[name].dest)
        if origin is None or origin.source not in (FLAG, ENV, FILE):
            continue
        # the one in force, and those it hides (SLUICE_MAX_RATE under --max-rate, a file's key under
        # the environment's): each named, or the next start stops at the one left
        places = []
        for each in [origin, *reversed(shadowed.get(keys[name].dest, []))]:
            if each.source == FLAG:
                places.append(f"the flag {each.key.flag}")
                flags_given.append(each.key.flag)
            elif each.source == ENV:
                places.append(f"{each.key.env} in the environment")
                envs_given.append(each.key.env)
            else:
                places.append(f"{each.key.name} in the config file {each.where}")
                files_given.setdefault(each.where, []).append(each.key.name)
        given[name] = " over ".join(places)
    if not given:
        return
    # what to do here, by where each came from: an environment or a config file shared with the
    # driver (which takes them) stops the nodes until they are the driver's alone
    here = []
    if flags_given:
        here.append(f"drop {', '.join(flags_given)} from the node's command line")
    if envs_given:
        one = "them" if len(envs_given) > 1 else "it"
        shared = f"an environment shared with the driver: set {one} for the driver alone"
        here.append(f"unset {', '.join(envs_given)} in the node's environment ({shared})")
    for path, names in files_given.items():
        one = "them" if len(names) > 1 else "it"
        shared = f"a file shared with the driver: give the nodes one without {one}"
        here.append(f"take {', '.join(names)} out of the config file {path} ({shared})")
    there = "--target DRIVER_HOST:PORT"
    word = re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", args.estimator or "", re.ASCII)  # not a caller's bytes
    estimator = args.estimator if word else "NAME"
    values = {
        "min-rate": f"{args.min_rate:g}",
        "max-rate": f"{args.max_rate:g}",
        "estimator": estimator,
        "estimator-params": format_estimator_params(args.estimator_params or {}) or "NAME=VALUE",
        "trigger-interval": f"{args.trigger_interval:g}",
    }
    flags = [f"{keys[name].flag} {values[name]}" for name in DRIVER_ONLY_SETTINGS if name in given]
    running = []
    if "min-rate" in given or "max-rate" in given:
        low = values["min-rate"] if "min-rate" in given else "MIN"
        high = values["max-rate"] if "max-rate" in given else "MAX"
        running.append(f"`sluice rate bounds {low} {high} {there}`")
    if "estimator" in given:
        running.append(f"`sluice rate estimator {estimator} {there}`")
    them = "them" if len(given) > 1 else "it"
    later = f"; while it runs, {' and '.join(running)}" if running else ""
    raise ConfigError(
        f"--role receiver does not take {', '.join(given.values())}: the cluster's driver runs the rate "
        "control and the query and pins each node's share of the cluster's rate, which a node's own "
        f"bounds would clamp; on this node, {'; '.join(here)}; and give {them} to the driver: at its "
        f"start, `sluice serve --role driver {' '.join(flags)} ...` (or the same in its environment or "
        f"config file){later}"
    )


def _driver_config(args: argparse.Namespace) -> DriverConfig:
    """`sluice serve --role driver`'s DriverConfig; ValueError (ConfigError) for anything wrong."""
    from ingest.driver_config import DriverConfig, check_files  # noqa: PLC0415 - only the driver needs it

    _refuse_unused(
        args,
        "driver",
        lambda key: key not in DRIVER_KEYS,
        "a driver would run without {them} (a receiver node's or a single server's settings: give {them} "
        "to the nodes)",
    )
    if args.nodes is None:
        raise ConfigError(
            name_keys(
                "--role driver needs --nodes FILE (one 'ID HOST:PORT' per line)", args.origins, _serve_keys()
            )
        )
    security = _checked(args, lambda: _security(args))

    def build_rate() -> RateConfig:
        return RateConfig(
            estimator=args.estimator or "model",
            initial_rate=10_000.0 if args.initial_rate is None else args.initial_rate,
            min_rate=args.min_rate,
            max_rate=args.max_rate,
            estimator_params=args.estimator_params,  # checked by the estimator, as a single server's
        )

    try:
        rate = build_rate()
    except UnknownEstimatorError:
        rate = _checked(args, build_rate, ("estimator",))
    except InvalidRateError:
        rate = _checked(args, build_rate, ("initial-rate",))
    except ValueError:  # RateBounds names min_rate/max_rate; anything else is the estimator's parameter
        rate = _checked(args, build_rate, ("estimator-params",))
    config = _checked(
        args,
        lambda: DriverConfig(
            # checked as a node checks it (an id or address twice): as a mapping, the last entry won
            nodes={node.id: node.target for node in Cluster(load_nodes(args.nodes)).nodes},
            streams=tuple(args.streams or ("default",)),
            data_dir=args.data_dir,
            master=args.master,
            pipeline=args.pipeline,
            reset_pipeline=args.reset_pipeline,
            trigger_interval=args.trigger_interval,
            fail_on_data_loss=args.fail_on_data_loss,
            rate=rate,
            recall_capacity=args.initial_rate is None,
            rate_host=args.host,
            rate_port=args.port,
            ca_file=args.client_ca,
            cert_file=args.tls_cert,
            key_file=args.tls_key,
            token_file=args.peer_token_file,
            auth_file=args.auth_file,
            tls=security.tls,
            metrics_host=args.metrics_host,
            metrics_port=None if args.metrics_port < 0 else args.metrics_port,
            metrics_tls=args.metrics_tls,
            health_port=args.health_port,
            insecure=args.insecure,
            handshake_timeout=security.handshake_timeout,
            connection_idle_timeout=security.connection_idle_timeout,
            max_connections=security.max_connections,
        ),
    )
    # the TLS files, the auth file and the peer token, read as the driver reads them at its start (as
    # _serve_config's check_security): `config check --role driver` read none of them
    _checked(args, lambda: check_files(config))
    return config


def _drive(args: argparse.Namespace) -> int:
    """`sluice serve --role driver`: ingest.cluster_driver."""
    try:
        config = _driver_config(args)
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)  # before pyspark is imported: a typo is refused at once
    from ingest.cluster_driver import run_driver  # noqa: PLC0415 - only the driver needs Spark

    return _stopped_already(asyncio.run(run_driver(config, spark_log_level=args.spark_log_level)), None)


def _default_rate(receive_only: bool) -> RateConfig:
    """The rate settings of a serve given no rate flag."""
    estimator = "fixed" if receive_only else "model"
    return RateConfig(estimator=estimator, initial_rate=math.inf)


def _rate_config(args: argparse.Namespace, receive_only: bool) -> RateConfig:
    """The rate flags as a RateConfig; ConfigError naming the flag at fault."""
    policies = _checked(args, lambda: _stream_policies(args))

    # a receiver node without Spark here takes its rate from operators (or the driver)
    estimator = args.estimator or ("fixed" if receive_only else "model")

    def build() -> RateConfig:
        return RateConfig(
            # a receiver node without Spark here takes its rate from operators (or the driver)
            estimator=estimator,
            # full speed from the first record: the model estimator's batches are bounded by the
            # receivers' memory until it has measured one (RateStatus.unmeasured_batch_records)
            initial_rate=(math.inf if receive_only or estimator == "model" else 10_000.0)
            if args.initial_rate is None
            else args.initial_rate,
            min_rate=args.min_rate,
            max_rate=args.max_rate,
            stream_policies=policies,
            estimator_params=args.estimator_params,
        )

    try:
        return build()
    except UnknownEstimatorError:
        return _checked(args, build, ("estimator",))
    except InvalidRateError:
        return _checked(args, build, ("initial-rate",))
    except ValueError:  # RateBounds names min_rate/max_rate; anything else is the estimator's parameter
        return _checked(args, build, ("estimator-params",))


def _serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of serve's settings, checked as `sluice serve` checks them before it starts
    anything (the TLS files and the auth file too); ValueError (ConfigError) naming the user's keys."""
    if args.role == "receiver":
        _refuse_unused(
            args,
            "receiver",
            RECEIVER_IGNORES.__contains__,
            "the cluster's driver runs the Spark query (give {them} to `sluice serve --role driver`)",
        )
        _refuse_driver_settings(args)
    receive_only = args.no_spark or args.role != "single"
    receiver = _checked(
        args,
        lambda: ReceiverConfig(
            block_interval=args.block_interval,
            block_linger=args.block_linger,
            buffer_records=args.buffer_records,
            prefetch=args.prefetch,
            low_tide=args.low_tide,
            block_records=args.block_records,
            buffer_bytes=args.buffer_bytes,
            memory_budget_bytes=args.memory_budget,
            disk_budget_bytes=args.disk_budget,
        ),
    )
    rate = _rate_config(args, receive_only)
    security = _checked(args, lambda: _security(args))
    cluster = _checked(args, lambda: _cluster(args))
    config = _checked(
        args,
        lambda: ServeConfig(
            host=args.host,
            port=args.port,
            metrics_host=args.metrics_host,
            metrics_port=None if args.metrics_port < 0 else args.metrics_port,
            data_dir=args.data_dir,
            streams=tuple(args.streams or ("default",)),
            receiver=receiver,
            rate=rate,
            fsync=args.fsync,
            accept_wal_damage=tuple(dict.fromkeys(n for names in args.accept_wal_damage for n in names)),
            segment_bytes=args.segment_bytes,
            master=args.master,
            pipeline=args.pipeline,
            reset_pipeline=args.reset_pipeline,
            trigger_interval=args.trigger_interval,
            fail_on_data_loss=args.fail_on_data_loss,
            spark=not args.no_spark and args.role == "single",
            security=security,
            cluster=cluster,
            peer_token_file=args.peer_token_file,
            health_port=args.health_port,
            max_message_bytes=args.max_message_bytes,
        ),
    )
    # the TLS files and the auth file, before Spark's JVM (seconds): a bad file fails at once
    from ingest.preflight import check_security  # noqa: PLC0415 - cryptography: the server extra

    _checked(args, lambda: check_security(config))
    return config


def _spark_prerequisites(config: ServeConfig | DriverConfig) -> dict[str, Pipeline]:
    """Java, and the pipeline's module and function: ValueError unless Spark can run the query. The
    pipeline loaded, by its spec ({} for the built-in one): the start runs it rather than import its
    module again (attach_spark's preloaded)."""
    if isinstance(config, ServeConfig) and not config.spark:
        return {}
    from ingest.spark.java import java_problem  # noqa: PLC0415 - only serve needs Java

    problem = java_problem()
    if problem is not None:
        raise ValueError(problem)
    if not config.pipeline:
        return {}
    from ingest.spark.pipeline import load_pipeline  # noqa: PLC0415

    return {config.pipeline: load_pipeline(config.pipeline)}


class _StoppedWhileStarting(BaseException):
    """SIGTERM before the server's own handlers are in place (raised from the signal handler)."""


def _until_serving(signum: int, frame: object) -> None:
    raise _StoppedWhileStarting


def _serve(args: argparse.Namespace) -> int:
    # until the event loop takes the signals over (_serve_async, run_driver): SIGHUP's default would end
    # a starting server without a word, SIGTERM's without its cleanup (the data dir's lock file). The
    # console script held both while the CLI was imported (ingest.console): one that came then counts now
    try:
        console.release(signal.SIGHUP, signal.SIG_IGN)
        terminated = console.release(signal.SIGTERM, _until_serving)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _until_serving)
        return _stopped_while_starting() if terminated else _serve_command(args)
    except _StoppedWhileStarting:
        return _stopped_while_starting()


def _stopped_while_starting() -> int:
    logs.say("stopped (SIGTERM) before the server was up", event="stopped")
    return 0


def _serve_command(args: argparse.Namespace) -> int:
    _need_server_extra("serve", spark=args.role == "driver" or (args.role == "single" and not args.no_spark))
    # cryptography (TLS) and the rest of the server's modules: only once they are known to be there
    from ingest.preflight import prepare  # noqa: PLC0415

    if args.role == "driver":
        return _drive(args)
    from ingest.runtime_config import RuntimeConfig  # noqa: PLC0415

    try:
        config = _serve_config(args)
        _check_not_nested(config)  # before the lock: nothing is written inside the other data dir
        RuntimeConfig(config, announce=False)  # DATA_DIR/runtime-config.json against these flags
        preloaded = _spark_prerequisites(config)
    except DataDirStateError as exc:  # a file the data dir holds is damaged: a failure, not a usage error
        return _fail(str(exc))
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    try:
        # before Spark's JVM, which takes seconds: a taken port or data dir fails at once. The lock is
        # held until this process ends (Spark drains into the data dir after the server stops).
        lock = prepare(config)
    except OSError as exc:
        return _fail(f"cannot start the server: {exc}")
    try:  # under the lock, before Spark: another node's data dir is a usage error (SluiceServer checks too)
        _claim_data_dir(config)
        _check_new_streams(config)
    except (OSError, ValueError) as exc:
        lock.abandon()
        damaged = isinstance(exc, DataDirStateError)  # node.json damaged, not another node's data dir
        return _fail(f"cannot start the server: {exc}", EXIT_FAILED if damaged else EXIT_USAGE)
    settings = f"; settings from {args.config}" if args.config is not None else ""
    logs.say(f"starting: data dir {config.data_dir}{settings}", event="start")
    try:
        origins = _outside_origins(args)
        return _stopped_already(
            asyncio.run(_serve_async(config, lock, args.spark_log_level, origins, preloaded)), lock
        )
    finally:
        lock.release()


def _stopped_already(code: int, lock: DataDirLock | None) -> int:
    """`code`, with a SIGTERM from now on ending the process with it: asyncio.run put SIGTERM's default
    back as it closed its loop, and the interpreter's exit does again (for a handler in Python), so a
    SIGTERM between the clean stop and the exit (the second of a pair sent to the process and to its
    group, as GNU `timeout` sends) killed a server that had stopped, exit -15 after its "stopped" line.
    There is nothing left to stop by then: until the exit handlers run (threads still joined) a SIGTERM
    exits with `code` at once, and from them on it is ignored (SIG_IGN outlasts the interpreter's exit)."""
    from ingest.spark.starting import exit_quietly  # noqa: PLC0415 - no Spark in it: only serve's

    signal.signal(signal.SIGTERM, lambda signum, frame: exit_quietly(code, lock))
    atexit.register(signal.signal, signal.SIGTERM, signal.SIG_IGN)
    return code


def _check_new_streams(config: ServeConfig) -> None:
    """The streams to serve against those of the data dir, as the server's start reads them: a new one
    whose name differs from another's only in letter case is a usage error (StreamNameClashError),
    before Spark starts; streams.json damaged is DataDirStateError."""
    from ingest.streams import StreamRegistry  # noqa: PLC0415 - the server extra's, as prepare
    from receivers.names import stream_folders  # noqa: PLC0415

    StreamRegistry(config.data_dir, config.streams, stream_folders(config.blocks_dir))


def _check_data_dir(config: ServeConfig) -> None:
    """What _claim_data_dir checks (node.json damaged: NodeFileError, a DataDirStateError; another node's
    data dir: DataDirOwnerError, a ValueError), writing nothing: `config check`."""
    from receivers.node_identity import check_data_dir  # noqa: PLC0415 - the server extra's, as prepare

    check_data_dir(config.data_dir, config.cluster)


def _check_not_nested(config: ServeConfig) -> None:
    from receivers.node_identity import check_not_nested  # noqa: PLC0415 - the server extra's, as prepare

    check_not_nested(config.data_dir)


def _claim_data_dir(config: ServeConfig) -> None:
    from receivers.node_identity import claim_data_dir  # noqa: PLC0415 - the server extra's, as prepare

    claim_data_dir(config.data_dir, config.cluster)


def _outside_origins(args: argparse.Namespace) -> dict[str, str]:
    """Setting key -> "file PATH" or "env VAR", for the values taken from a config file or the
    environment (the server tells flags and defaults apart itself)."""
    names = keys_by_dest(_serve_keys())
    return {
        names[dest].name: origin.described
        for dest, origin in args.origins.items()
        if origin.source in (FILE, ENV) and dest in names
    }


async def _serve_async(  # noqa: PLR0911, PLR0912, PLR0915 - one lifecycle
    config: ServeConfig,
    lock: DataDirLock,
    spark_log_level: str = SPARK_QUIET,
    origins: dict[str, str] | None = None,
    preloaded: dict[str, Pipeline] | None = None,
) -> int:
    """`sluice serve` until SIGINT/SIGTERM; `preloaded`: the pipeline _spark_prerequisites loaded."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # first: a signal during the imports below reached asyncio.run's own SIGINT handler, which cancelled
    # this task half-way into gRPC's start (a CancelledError and an InvalidStateError traceback)
    signals = _take_stop_signals(loop, stop, lock)
    from ingest.server import SluiceServer  # noqa: PLC0415

    driver = None
    spark = None
    serving: list[SluiceServer] = []

    def reload() -> None:
        # SIGHUP's default would end the process; before the server is up its files are read anyway
        if serving:
            serving[0].reload_security_soon()  # read in a thread: the server answers meanwhile
        else:
            log.info("SIGHUP: the server is starting; it reads the TLS files and the auth file as it starts")

    loop.add_signal_handler(signal.SIGHUP, reload)
    if config.spark:
        from ingest.spark.session import build_session  # noqa: PLC0415
        from ingest.spark.starting import start_session, stopped_starting  # noqa: PLC0415

        # launch Spark's JVM (a fork + exec of this process) before gRPC runs any thread: a fork while
        # gRPC's pollers run can break both the child and the server's event engine. A minute or two on
        # a slow machine: a stop signal meanwhile ends it (start_session)
        try:
            spark = await start_session(
                functools.partial(
                    build_session,
                    config.master,
                    log_level=spark_log_level,
                    log_json=logs.log_format() == logs.JSON,
                ),
                stop,
            )
        except Exception as exc:  # noqa: BLE001 - py4j and PySpark raise many kinds; the JVM said why above
            lock.abandon()  # a new data dir is left as it was found (DataDirLock.abandon)
            return _fail(f"cannot start Spark on {config.master}: {exc}")
        if spark is None:
            lock.abandon()
            return stopped_starting(signals, "before the server was up")
    try:
        server = SluiceServer(
            config,
            batches_completed=lambda: driver.batches_completed if driver else 0,
            data_dir_lock=lock,
            # what no flag gives, as _rate_config makes it (--no-spark implies the fixed estimator)
            defaults=dataclasses.replace(
                config, receiver=ReceiverConfig(), rate=_default_rate(not config.spark)
            ),
            origins=origins,
        )
        await server.start()
    # ValueError: a TLS or auth file changed since it was checked; WalError: a damaged log; OSError: a
    # port taken since prepare() checked it (another server started meanwhile, Spark's start is seconds)
    except (OSError, ValueError, _wal_error()) as exc:
        if spark is not None:
            await asyncio.to_thread(spark.stop)
        # served nothing: a new data dir is left as it was found, not with the node.json of a start
        # that never ran (DataDirLock.abandon)
        lock.abandon()
        return _fail(f"cannot start the server: {exc}")
    serving.append(server)
    from ingest.preflight import bind_address  # noqa: PLC0415 - the server extra, as prepare

    metrics = ""
    if server.metrics_port is not None:
        metrics = f", metrics on {bind_address(config.metrics_host, server.metrics_port)}/metrics"
    if server.metrics_port is not None and config.security.metrics_tls:
        metrics += " (https)"
    if server.health_port is not None:  # --health-port 0 took any port: say which
        metrics += f", health on {bind_address('0.0.0.0', server.health_port)} (plaintext)"  # noqa: S104
    logs.say(
        f"serving streams {', '.join(server.streams.serving)} on {server.target}{metrics}; "
        f"{server.transport}{', tokens required' if server.auth.table is not None else ''}",
        event="serving",
    )
    manager = None
    try:
        if spark is not None:
            from ingest.spark.starting import (  # noqa: PLC0415
                exit_quietly,
                stop_spark,
                stopped_first,
                stopped_starting,
            )
            from ingest.spark_side import attach_spark  # noqa: PLC0415

            # the query's start and warm-up: seconds, tens of them on a slow machine; a stop signal
            # meanwhile ends them (the server stops first: what it acked is in the block log already)
            attach = asyncio.ensure_future(attach_spark(spark, server, warm=True, preloaded=preloaded))
            if await stopped_first(attach, stop):
                attach.cancel()
                await server.stop()
                stopped = await stop_spark(spark)
                spark = None  # stopped, or left behind
                code = stopped_starting(signals, "before the Spark query was up", spark_stopped=stopped)
                if not stopped:  # asyncio.run would wait for the query's start threads: not beyond the bound
                    exit_quietly(code, lock)
                return code
            try:
                driver, manager = attach.result()
            except PipelineStateError as exc:
                await server.stop()
                return _fail(f"cannot start the Spark query: {exc}")
            sink = manager.current.spec or config.data_dir / manager.current.sink
            logs.say(f"Spark query running on {config.master}; sink: {sink}", event="query-started")
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            failure = manager.failure() if manager is not None else None
            if failure is not None:
                await server.stop()
                return _fail(f"the Spark query failed: {failure}")
            if server.failure is not None:  # it stopped itself, and logged why
                await server.stop()
                return EXIT_FAILED
        logs.say("stopping: sealing and acking what was received", event="stopping")
        if manager is not None:  # a swap goes on when its call ends: let it end while the server runs
            await manager.settled(DRAIN_SECONDS)
        await server.stop()
        if driver is not None:
            log.info("letting Spark process the sealed blocks (at most %g s)", DRAIN_SECONDS)
            try:
                await asyncio.wait_for(asyncio.to_thread(driver.drain), DRAIN_SECONDS)
            except TimeoutError:
                log.warning("Spark did not drain within %g s; stopping the query", DRAIN_SECONDS)
    finally:
        if manager is not None:  # a failure's exit too: not a swap's threads under driver.stop
            await manager.settled(DRAIN_SECONDS)
        await server.stop()
        if driver is not None:
            await asyncio.to_thread(driver.stop)
        if spark is not None:
            await asyncio.to_thread(spark.stop)
    logs.say("stopped", event="stopped")
    return 0


def _take_stop_signals(
    loop: asyncio.AbstractEventLoop, stop: asyncio.Event, lock: DataDirLock | None
) -> list[int]:
    """SIGINT and SIGTERM set `stop`: the server stops cleanly, or its start ends (stopped_starting).
    A second one while that stop is under way ends the process at once (exit_now), but for a SIGTERM
    within ECHO_SECONDS of the first (is_echo). The signals that came, in order."""
    from ingest.spark.starting import exit_now, is_echo  # noqa: PLC0415 - no Spark in it: only serve's

    came: list[int] = []
    first_at = [0.0]

    def on_signal(signum: int) -> None:
        if came:
            if is_echo(came[0], first_at[0], signum):
                return  # the same SIGTERM to the process and to its group (GNU timeout)
            exit_now(signum, lock)
        came.append(signum)
        first_at[0] = time.monotonic()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    return came


def _dev_certs(args: argparse.Namespace) -> int:
    _need_server_extra("dev-certs", spark=False)
    from ingest.dev_certs import write_dev_certs  # noqa: PLC0415 - cryptography only for this command

    try:
        written = write_dev_certs(args.dir, args.host, args.client, overwrite=args.force)
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except OSError as exc:
        return _fail(f"cannot write the certificates: {exc}")
    out = written.ca_file.parent
    print(f"CA (clients trust it):       {written.ca_file}")
    print(f"server certificate and key:  {written.server_cert} {written.server_key}")
    for name, (cert, key) in written.clients.items():
        print(f"client {name!r}:{' ' * max(1, 20 - len(name))}{cert} {key}")
    print(
        f"for trials only. serve: sluice serve --tls-cert {out / 'server.crt'} --tls-key "
        f"{out / 'server.key'}" + (f" --client-ca {written.ca_file}" if written.clients else "")
    )
    return 0


# ---- push ----------------------------------------------------------------------------------------


class _Progress:
    """A progress bar on stderr, redrawn at most 5 times a second; under `--log-format json` a JSON
    line (event "push-progress", with the figures as fields) at most once a JSON_EVERY seconds instead,
    so that a log shipper reading stderr gets one format."""

    JSON_EVERY = 1.0

    def __init__(
        self, out: IO[str], total_bytes: int | None, enabled: bool, *, json_lines: bool = False
    ) -> None:
        self.out, self.total, self.enabled, self.json_lines = out, total_bytes, enabled, json_lines
        self.start = self.last = time.monotonic()
        self.drawn = False

    def show(self, done_bytes: int, records: int, acked: int, final: bool = False) -> None:
        now = time.monotonic()
        every = self.JSON_EVERY if self.json_lines else 0.2
        if not self.enabled or (not final and now - self.last < every):
            return
        self.last = now
        rate = records / max(now - self.start, 1e-9)
        if self.json_lines:
            fields = {
                "bytes_read": done_bytes,
                "total_bytes": self.total,
                "records": records,
                "acked": acked,
                "records_per_second": round(rate, 1),
                "final": final,
            }
            message = f"{records:,} records read, {acked:,} acked, {rate:,.0f} rec/s"
            logs.say(message, event="push-progress", fields=fields)
            return
        if self.total:
            frac = min(1.0, done_bytes / self.total)
            bar = "#" * int(frac * 30)
            head = f"[{bar:<30}] {frac:6.1%}"
        else:
            head = f"{done_bytes / 1e6:9.1f} MB"
        line = f"\r{head} {records:,} records, {acked:,} acked, {rate:,.0f} rec/s"
        self._write(line + ("\n" if final else ""))
        self.drawn = not final and self.enabled

    def _write(self, text: str) -> None:
        """A stderr that cannot take the progress (its reader gone, a full disk) ends the progress, not
        the push: a BrokenPipeError here stopped a push of 2,000,000 lines `2>&1 | head -c 1` after
        1,482,752 of them with exit 0, an ENOSPC with a traceback."""
        try:
            self.out.write(text)
            self.out.flush()
        except OSError as exc:
            self.enabled = False
            if exc.errno == errno.EPIPE:
                logs.stderr_gone()

    @property
    def follows(self) -> bool:
        """Whether to `follow` the push: JSON lines come every JSON_EVERY seconds, also while it waits."""
        return self.enabled and self.json_lines

    async def follow(self, state: Callable[[], tuple[int, int, int, bool]]) -> None:
        """Show `state()` (bytes read, records read, records acked, input ended) until cancelled."""
        while True:
            await asyncio.sleep(self.JSON_EVERY)
            done_bytes, records, acked, _ = state()
            self.show(done_bytes, records, acked)

    def stop(self) -> None:
        """End a bar left mid-line, so that messages start on a line of their own."""
        if self.drawn:
            self._write("\n")
            self.drawn = False


class _LiveProgress:
    """On a terminal: a rich progress bar on stderr counting ACKED records (durable, what a resumed push
    would skip), redrawn every REDRAW seconds from the start, also while the push waits for credit or
    acks. Its total is the input's records once read to the end, estimated from the bytes before."""

    REDRAW = 0.25

    def __init__(self, console: Console, total_bytes: int | None) -> None:
        from rich.progress import (  # noqa: PLC0415 - only on a terminal
            BarColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.total_bytes = total_bytes
        self.progress = Progress(
            TextColumn("[bold]push"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[acked]} acked{task.fields[of]}"),
            TextColumn("[cyan]{task.fields[rate]} acked/s"),
            TimeElapsedColumn(),
            console=console,
            auto_refresh=False,  # redrawn by `follow`, at its pace, with fresh numbers
        )
        self.task = self.progress.add_task("push", total=None, acked="0", of="", rate="0")
        self.start = time.monotonic()
        self.progress.start()

    def update(self, done_bytes: int, records: int, acked: int, *, ended: bool) -> None:
        total: float | None = None
        if ended:
            total = records
        elif self.total_bytes and done_bytes:
            total = records * self.total_bytes / done_bytes
        rate = acked / max(time.monotonic() - self.start, 1e-9)
        of = "" if total is None else f" of {'' if ended else '~'}{total:,.0f}"
        shown = max(total, acked) if total is not None else None
        self.progress.update(
            self.task, completed=acked, total=shown, acked=f"{acked:,}", of=of, rate=f"{rate:,.0f}"
        )
        self.progress.refresh()

    async def follow(self, state: Callable[[], tuple[int, int, int, bool]]) -> None:
        """Redraw from `state()` (bytes read, records read, records acked, input ended) until cancelled."""
        while True:
            done_bytes, records, acked, ended = state()
            self.update(done_bytes, records, acked, ended=ended)
            await asyncio.sleep(self.REDRAW)

    def show(self, done_bytes: int, records: int, acked: int, final: bool = False) -> None:
        if final:
            self.update(done_bytes, records, acked, ended=True)
            self.stop()

    def stop(self) -> None:
        self.progress.stop()


_ESCAPES = {ord("t"): b"\t", ord("\\"): b"\\"}


def key_separator(text: str) -> bytes:
    """The bytes of `sluice push --key-separator`: the argument's bytes, with the escapes \\t, \\\\ and
    \\xNN; ValueError for an unknown escape, an empty separator or one holding a newline."""
    raw, out, i = os.fsencode(text), bytearray(), 0
    while i < len(raw):
        if raw[i] != ord("\\"):
            out.append(raw[i])
            i += 1
            continue
        escape = raw[i + 1 : i + 2]
        if escape == b"x":
            digits = raw[i + 2 : i + 4]
            if len(digits) != 2 or not all(chr(d) in "0123456789abcdefABCDEF" for d in digits):
                raise ValueError("\\x takes two hex digits (\\x2d is -)")
            out.append(int(digits, 16))
            i += 4
        elif escape and escape[0] in _ESCAPES:
            out += _ESCAPES[escape[0]]
            i += 2
        else:
            raise ValueError("a backslash starts \\t, \\\\ or \\xNN; write \\\\ for a backslash")
    if not out or b"\n" in out:
        raise ValueError("a separator is one or more bytes, without a newline (lines end there)")
    return bytes(out)


def _push_flags_error(args: argparse.Namespace) -> str | None:
    """What is wrong with `sluice push`'s flags, if anything."""
    if not 1 <= args.batch_size <= DEFAULT_MAX_BUFFERED:
        # a batch is at most what the push keeps unacked
        held, given = f"{DEFAULT_MAX_BUFFERED:,}", f"{args.batch_size:,}"
        return f"--batch-size must be 1..{held} (the records a push holds until acked), got {given}"
    if not args.timeout > 0:
        return "--timeout must be > 0 seconds"
    if args.resume_from < 0:
        return "--resume-from must be >= 0"
    if args.key_separator is not None:
        try:
            key_separator(args.key_separator)
        except ValueError as exc:
            return f"--key-separator {args.key_separator!r}: {exc}"
    if args.resume_from and not args.producer_id:
        # under another id the server could not tell which of the records after N it already holds
        return "--resume-from needs the --producer-id of the push it resumes"
    return None


def _push(args: argparse.Namespace) -> int:
    # given (0 too: the command a push that had nothing acked prints), the push continues an earlier
    # one and resends what that one may have sent; else it is a new run of its producer id
    args.resumes = args.resume_from is not None
    if args.resume_from is None:
        args.resume_from = 0
    error = _push_flags_error(args)
    if error is not None:
        return _fail(error, EXIT_USAGE)
    if args.file == "-":
        if sys.stdin is None:  # fd 0 closed (`<&-`): Python has no sys.stdin
            return _fail("cannot read standard input: it is closed", EXIT_USAGE)
        source, total = sys.stdin.buffer, None
    else:
        path = Path(args.file)
        try:
            source, total = path.open("rb"), path.stat().st_size
        except OSError as exc:
            return _fail(f"cannot read {args.file}: {exc.strerror}", EXIT_USAGE)
    progress: _Progress | _LiveProgress
    json_lines = logs.log_format() == logs.JSON  # JSON lines only, on a terminal too: no bar among them
    if not args.no_progress and sys.stderr.isatty() and not json_lines:
        from rich.console import Console  # noqa: PLC0415 - only on a terminal

        progress = _LiveProgress(Console(stderr=True), total)
    else:
        progress = _Progress(sys.stderr, total, enabled=not args.no_progress, json_lines=json_lines)
    said: list[bool] = []  # how far it got and how to resume: said on a Ctrl-C too
    try:
        return asyncio.run(_push_async(args, source, progress, said))
    except KeyboardInterrupt:
        if not said:
            raise
        return EXIT_INTERRUPTED
    finally:
        progress.stop()
        if source is not sys.stdin.buffer:
            source.close()


def _refused_push_flags(args: argparse.Namespace, exc: ValueError) -> int:
    if not all(map(_is_utf8, (args.stream, args.producer_id or ""))):
        # said as main says it of every other argument that is not UTF-8 text
        raise UnicodeEncodeError("utf-8", "", 0, 0, "not UTF-8 text") from exc
    return _fail(f"cannot push with these flags: {exc}", EXIT_USAGE)


async def _push_async(
    args: argparse.Namespace, source: IO[bytes], progress: _Progress | _LiveProgress, said: list[bool]
) -> int:
    from ingest.input_lines import InputLines  # noqa: PLC0415 - numpy: only for a push
    from sluice_client import Producer  # noqa: PLC0415

    try:
        producer = Producer(
            args.target,
            args.stream,
            producer_id=args.producer_id,
            batch_size=args.batch_size,
            first_seq=args.resume_from,
            # a mistyped --producer-id is refused, not taken from there on; without --resume-from a
            # push whose producer id has records on the server is refused, not dropped as duplicates
            resume=args.resumes,
            start_timeout=args.timeout,
            reconnect_timeout=args.timeout,
            credentials=_credentials(args),
        )
    except ValueError as exc:  # a flag the SDK refuses (a batch size over its buffer, a seq past 2^64-2)
        return _refused_push_flags(args, exc)
    read = InputLines(source)
    # before the session opens: its Open tells the server that the records below are this producer's
    if (unskipped := await _skip_resumed(args, read)) is not None:
        return _fail(unskipped)
    follow = None
    if isinstance(progress, _LiveProgress) or progress.follows:  # from the first second on, acks or not
        follow = asyncio.create_task(
            progress.follow(
                lambda: (read.done_bytes, read.records, producer.acked - args.resume_from, read.ended)
            ),
            name="sluice-push-progress",
        )
    separator = key_separator(args.key_separator) if args.key_separator is not None else None
    keyless = 0  # lines without the separator
    # SIGTERM (systemd, Kubernetes, `timeout`) as Ctrl-C: say how far the push got and how to resume
    terminated: list[bool] = []
    handling: list[bool] = []  # the push is ending: a SIGTERM now must not cut its report short
    main = asyncio.current_task()
    assert main is not None

    def terminate() -> None:
        if not terminated and not handling:
            main.cancel()
        terminated.append(True)

    with contextlib.suppress(ValueError, RuntimeError):  # not the main thread (a test's): no handler
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminate)
    try:
        await producer.start()
        while (lines := await _next_lines(producer, read, separator, args)) is not None:
            first = args.resume_from + read.records - len(lines)  # the chunk's first record in the input
            keyless += await _send_lines(producer, lines, separator, first, args.timeout)
            progress.show(read.done_bytes, read.records, producer.acked - args.resume_from)
        await _flush_while_acking(producer, args.timeout)
        await _stopped(follow)
        progress.show(read.done_bytes, read.records, producer.acked - args.resume_from, final=True)
        await producer.close(args.timeout)
    except (SluiceError, asyncio.CancelledError) as exc:
        handling.append(True)
        await _stopped(follow)
        await producer.abort()
        progress.stop()
        denied = _denial(exc)
        if denied is not None:  # nothing to resume: the same command fails the same way
            why = printable(str(denied)) + tls_to_plaintext_hint(str(denied))  # the server's words, a hint
            return _fail(f"push to {args.target} stream {args.stream!r} refused: {why}", EXIT_DENIED)
        unacked = await _why_unacked(args, producer) if isinstance(exc, FlushTimeoutError) else ""
        _push_failed(args, producer, read.records, exc, unacked)
        said.append(True)
        if terminated:
            return 128 + signal.SIGTERM  # as a shell reports a process SIGTERM ended
        if isinstance(exc, asyncio.CancelledError):
            raise  # Ctrl-C: asyncio.run raises KeyboardInterrupt (exit 130)
        return EXIT_FAILED
    skipped = f" (after the {args.resume_from:,} records of --resume-from)" if args.resume_from else ""
    # said (JSON under --log-format json), as the push's failures are
    logs.say(f"pushed {read.records:,} records to stream {args.stream!r}{skipped}; all acked", event="pushed")
    if keyless and separator is not None:  # a wrong separator would otherwise pass unnoticed
        logs.say(
            f"{keyless:,} of them had no {separator.decode(errors='backslashreplace')!r} and went "
            "without a key",
            level=logging.WARNING,
        )
    return 0


async def _skip_resumed(args: argparse.Namespace, read: InputLines) -> str | None:
    """Pass over the input's first --resume-from records; what is wrong if that cannot be done."""
    try:
        if await read.skip(args.resume_from):
            return None
    except OSError as exc:
        return f"{_input_name(args)}: {exc.strerror or exc}"
    return (
        f"the input has {read.skipped:,} records, fewer than --resume-from {args.resume_from:,}: "
        "not the input of the push to resume?"
    )


class InputReadError(SluiceError):
    """`sluice push` could not read its input (a read error, not its end): the push fails as when its
    server does, saying how far it got and how to resume."""


def _input_name(args: argparse.Namespace) -> str:
    return "cannot read " + ("standard input" if args.file == "-" else args.file)


async def _next_lines(
    producer: Producer, read: InputLines, separator: bytes | None, args: argparse.Namespace
) -> Lines | None:
    """read.next_lines(), its lines bounded to what a record can carry (from the first line sent on:
    skipped ones were an earlier push's); a longer line, found before its end: the lines before it are
    acked, then a RecordTooLargeError names it, as _send_lines does for a shorter one."""
    from ingest.input_lines import LineTooLongError  # noqa: PLC0415 - numpy: only for a push

    read.max_line = MAX_RECORD_BYTES + (len(separator) if separator is not None else 0)
    try:
        return await read.next_lines()
    except OSError as exc:  # EIO of a failing disk, a socket on stdin reset: the lines before are acked
        await _flush_while_acking(producer, args.timeout)
        after = args.resume_from + read.records
        raise InputReadError(
            f"{_input_name(args)}{f' after line {after:,}' if after else ''}: {exc.strerror or exc}"
        ) from None
    except LineTooLongError as exc:
        await _flush_while_acking(producer, args.timeout)
        raise RecordTooLargeError(
            f"line {args.resume_from + read.records + 1:,} of the input has over {exc.size:,} bytes "
            f"(read so far): over the {MAX_RECORD_BYTES:,}-byte limit of a record; the lines before "
            "it are acked",
            0,
            exc.size,
        ) from None


async def _send_lines(
    producer: Producer, lines: Lines, separator: bytes | None, first: int, timeout: float
) -> int:
    """Queue a chunk of lines, the first being record `first` of the input; return how many had no
    separator. A line no message can carry: the lines before it are sent and acked, then a
    RecordTooLargeError names it (the push's resume command then starts at it)."""
    keyless, end = 0, len(lines)
    if separator is None:
        parts: tuple[Any, ...] = (lines.data, lines.offsets)
    else:
        cut = lines.keyed(separator)
        keyless = len(lines) - int(cut.key_validity.sum())
        parts = (cut.values, cut.value_offsets, cut.keys, cut.key_offsets, cut.key_validity)
    try:
        await producer.send_packed(*parts)
    except RecordTooLargeError as exc:
        if exc.index is None:  # pragma: no cover - only a record changed after it was given
            raise
        end = exc.index
        if end:
            await producer.send_packed(*_first_lines(parts, end))
        await _flush_while_acking(producer, timeout)
        line = first + end + 1
        raise RecordTooLargeError(
            f"line {line:,} of the input has {exc.size:,} bytes of key and value: over the "
            f"{exc.limit or MAX_RECORD_BYTES:,}-byte limit of a record; the lines before it are acked",
            end,
            exc.size,
        ) from None
    return keyless


def _first_lines(parts: tuple[Any, ...], n: int) -> tuple[Any, ...]:
    """send_packed's arguments `parts` cut to their first `n` records."""
    if len(parts) == 2:
        return parts[0], parts[1][: n + 1]
    values, value_offsets, keys, key_offsets, validity = parts
    return values, value_offsets[: n + 1], keys, key_offsets[: n + 1], validity[:n]


async def _stopped(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        await reap(task)  # a SIGTERM meanwhile still ends the push


async def _flush_while_acking(producer: Producer, timeout: float) -> None:
    """Wait for every ack, giving up only after `timeout` seconds without one: a throttled server may
    take minutes to ack what a large input left in the producer's buffer."""
    while True:
        before = producer.acked
        try:
            await producer.flush(timeout)
        except FlushTimeoutError:
            if producer.acked == before:
                raise
        else:
            return


def _denial(error: BaseException) -> RPCError | None:
    """The UNAUTHENTICATED or PERMISSION_DENIED error, or the TLS handshake refused on certificates,
    behind `error`, if that is what failed the push."""
    for cause in (error, error.__cause__):
        if isinstance(cause, RPCError) and refused(cause.status, cause.message):
            return cause
    return None


def _token(args: argparse.Namespace) -> int:
    token = new_token()
    line = f'token_sha256 = "{token_hash(token)}"'
    if args.out is None:
        print(token, flush=True)  # before the hash line: a token that did not get out has no hash shown
        logs.write_stderr(f"sluice: the token is on stdout; its principal's auth file line: {line}")
        return 0
    try:
        # 0600 from the start: never readable by others, not even for a moment
        descriptor = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        why = "it exists (never overwritten)" if isinstance(exc, FileExistsError) else exc.strerror
        return _fail(f"cannot write the token to {args.out}: {why}")
    with os.fdopen(descriptor, "w") as out:
        out.write(token + "\n")
    print(line)
    return 0


def _permanent(error: BaseException) -> bool:
    """Whether a push failed for a cause that running it again does not change (a record the server
    refuses, a producer id it does not know), not for a server away or stopping."""
    from sluice_client.errors import (  # noqa: PLC0415 - the push's own imports
        RecordTooLargeError,
        RecordTypeError,
        RPCError,
        SequenceRangeError,
    )

    for candidate in (error, error.__cause__):  # the cause of close()'s UnackedRecordsError too
        if isinstance(candidate, RPCError):
            return not candidate.retriable
        if isinstance(candidate, RecordTooLargeError | RecordTypeError | SequenceRangeError):
            return True
    return False


def _new_run_refused(error: RPCError, producer_id: str, stream: str) -> str:
    """The server's refusal of a new run of a producer id (Open.fresh), its advice put in the push's
    terms: the SDK's first_seq / resume=True mean nothing here, and --resume-from N skips the input's
    first N lines, right for the same input only (a new file under a reused id would lose them). The
    number is the one the server sent as such (RPCError.next_seq); an older server's refusal, without
    it, is shown in its own words."""
    n = error.next_seq
    if n is None:
        return printable(str(error))
    said = printable(f"producer {shown(producer_id)} already has records on stream {shown(stream)}")
    return (
        f"{error.status.name}: {said}: the server expects its sequence number {n:,} next, so this push's "
        f"records would be dropped as duplicates of an earlier push's. To resume that same input after "
        f"what the earlier push got through, run it again with --resume-from {n} (it skips the input's "
        f"first {n:,} lines); for a new input, use another --producer-id"
    )


WHY_UNACKED_TIMEOUT = 3.0
"""Seconds a push whose acks stopped gives the server's rate API to say why (a full disk)."""


async def _why_unacked(args: argparse.Namespace, producer: Producer) -> str:
    """After "N records not acked within T s": the reasons the server paused the stream's credit, from
    its rate API (`sluice rate get`; a disk_error when its disk is full), else where to look. One call,
    at most WHY_UNACKED_TIMEOUT seconds: never a hang, and a refusal or no answer just gives the hint."""
    look = f"`sluice status --target {args.target}` shows why"
    credentials = producer.credentials
    try:
        async with credentials.channel(args.target) as channel:
            call = pb_grpc.RateControlStub(channel).GetRate(
                pb.GetRateRequest(), metadata=credentials.metadata
            )
            status = await asyncio.wait_for(call, WHY_UNACKED_TIMEOUT)
    except (grpc.RpcError, TimeoutError, OSError, ValueError):
        return f"; {look}"
    for stream in status.streams:
        if stream.stream == args.stream and stream.credit_paused:
            reasons = ", ".join(map(printable, stream.credit_paused))
            return f"; the server has paused intake on stream {args.stream!r}: {reasons} ({look})"
    return f"; {look}"


def _push_failed(
    args: argparse.Namespace, producer: Producer, read: int, error: BaseException, unacked: str = ""
) -> None:
    """Say how far the push got and how to resume it without sending anything twice; `unacked`: why
    the server holds acks back (_why_unacked), after a flush that timed out."""
    acked, sent = producer.acked, producer.ever_sent
    why = "interrupted" if isinstance(error, asyncio.CancelledError) else printable(str(error)) + unacked
    if isinstance(error, RPCError) and error.status is grpc.StatusCode.ALREADY_EXISTS:
        why = _new_run_refused(error, producer.producer_id, args.stream)
    if isinstance(error, RPCError) and not producer.credentials.secure:  # over TLS the SDK says it
        why += connect_hint(error.status, error.message, secure=False)
    _fail(f"push to {args.target} stream {args.stream!r} failed: {why}")
    # counted from the start of the input, as --resume-from is
    permanent = _permanent(error)  # the same command would fail the same way
    if sent == args.resume_from:
        _fail(
            f"no record was sent: {'fix the cause first' if permanent else 'the same command can run again'}"
        )
        return
    if permanent and acked == args.resume_from:  # a --resume-from past the server's mark (a gap), say
        _fail(f"no record of this run was acked: fix the cause first ({sent - acked:,} sent were refused)")
        return
    read += args.resume_from
    _fail(f"of the input's records {acked:,} are acked (durable), {sent:,} sent, {read:,} read")
    command = [
        "sluice",
        "push",
        args.file,
        "--target",
        args.target,
        "--stream",
        args.stream,
        "--producer-id",
        producer.producer_id,
        "--resume-from",
        str(acked),
    ]
    if args.batch_size != DEFAULT_BATCH_SIZE:
        command += ["--batch-size", str(args.batch_size)]
    if args.timeout != PUSH_TIMEOUT:  # the shortest text that reads back as it (%g cut 1234567 short)
        command += ["--timeout", repr(float(args.timeout)).removesuffix(".0")]
    for flag in ("ca_file", "cert_file", "key_file", "token_file"):  # the server needs them again
        if getattr(args, flag) is not None:
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.key_separator is not None:  # one token: a separator such as "--" must not read as a flag
        command.append(f"--key-separator={args.key_separator}")
    if args.no_progress:
        command.append("--no-progress")
    same_input = " (with the same input on stdin)" if args.file == "-" else ""
    if permanent:
        same_input += ", once the cause is fixed"
    _fail(f"to resume without duplicates{same_input}, run: {shlex.join(command)}")


# ---- config --------------------------------------------------------------------------------------


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, e.g. block-interval=0.1, got {text!r}")
    return key.strip(), value.strip()


def _show_config(view: pb.ConfigView) -> int:
    # every string the server sent goes through printable(): a hostile or broken endpoint must not
    # clear, retitle or recolour the operator's terminal, nor forge a line of the listing
    keys = [printable(s.key) for s in view.settings]
    width = max((len(k) for k in keys), default=3)
    values = [
        printable(s.value or (f"(none: {s.effective})" if s.effective else "(none)")) for s in view.settings
    ]
    value_width = max((len(v) for v in values), default=0)
    for setting, key, value in zip(view.settings, keys, values, strict=True):
        print(f"{key:<{width}}  {value:<{max(value_width, 12)}}  {printable(setting.source)}")
    print(f"(version {view.version})")
    return 0


def _config_get(args: argparse.Namespace) -> int:
    request = pb.GetConfigRequest(keys=args.keys)
    return _show_config(
        _unary(args, "config get", lambda ch, md: pb_grpc.AdminStub(ch).GetConfig(request, metadata=md))
    )


def _config_goes_on(args: argparse.Namespace) -> str:
    """What `config set` and `config reset` say when their wait ends before the server's answer."""
    return (
        "; the change goes on on the server to its end (a new trigger interval restarts the query, or "
        f"rolls back): `sluice config get --target {args.target}` shows what is in force"
    )


def _config_dropped(args: argparse.Namespace) -> str:
    """What `config set` and `config reset` say when the connection dropped under the call."""
    return (
        f": the change may have been applied; `sluice config get --target {args.target}` shows what is "
        "in force"
    )


def _config_set(args: argparse.Namespace) -> int:
    # the request's map keeps one value a key: a setting given twice was sent with its last value, and
    # saved so, without a word (also with --validate-only, which then "validated" one of the two)
    seen: set[str] = set()
    for key, _ in args.changes:
        if key in seen:
            return _fail(f"config set names setting {key!r} twice: give it once", EXIT_USAGE)
        seen.add(key)
    request = pb.SetConfigRequest(set=dict(args.changes), validate_only=args.validate_only)
    view = _unary(
        args,
        "config set",
        lambda ch, md: pb_grpc.AdminStub(ch).SetConfig(request, metadata=md),
        timeout=config_change_deadline(),  # a new trigger interval restarts the query
        late=_config_goes_on(args),
        dropped=_config_dropped(args),
    )
    if args.validate_only:
        print("valid: nothing was changed")
    return _show_config(view)


def _config_reset(args: argparse.Namespace) -> int:
    request = pb.SetConfigRequest(reset=args.keys)
    view = _unary(
        args,
        "config reset",
        lambda ch, md: pb_grpc.AdminStub(ch).SetConfig(request, metadata=md),
        timeout=config_change_deadline(),  # as config set: resetting the trigger interval restarts the query
        late=_config_goes_on(args),
        dropped=_config_dropped(args),
    )
    if view.not_set:
        logs.write_stderr(f"nothing to reset for {', '.join(view.not_set)}: not set at run time")
    return _show_config(view)


def _config_check(args: argparse.Namespace) -> int:
    """`sluice config check`: serve's checks, offline; the settings with their sources, or the problem."""
    _need_server_extra("config check", spark=False)
    from ingest.runtime_config import SETTINGS, RuntimeConfig  # noqa: PLC0415

    overrides: dict[str, str] = {}
    runtime_file = ""
    try:
        config: ServeConfig | DriverConfig
        if args.role == "driver":
            from ingest.driver_config import read_runtime_config  # noqa: PLC0415 - only the driver's

            config = _driver_config(args)
            # DATA_DIR/runtime-config.json (the rate's settings and pin kept there), read as the
            # driver's start reads it; its settings override the command line's, as on a node
            runtime = read_runtime_config(config)
            overrides, runtime_file = runtime.overrides, str(runtime.path)
        else:
            config = _serve_config(args)
            # DATA_DIR/runtime-config.json, read (never written) and checked as the server will
            runtime = RuntimeConfig(config, announce=False)
            overrides, runtime_file = runtime.overrides, str(runtime.path)
            # node.json and streams.json, read (never written) as serve's start reads them: damaged,
            # or the data dir another node's, serve stops on them
            _check_data_dir(config)
            _check_new_streams(config)  # a new stream whose name only the case tells from another's
            # what serve runs: the file's settings over the flags', and what rules derive from them (a
            # prefetch left to its rule follows the file's buffer-records)
            config = runtime.current
            if runtime.ignored:  # a receiver node's start takes them out of the file, with a WARNING
                logs.say(
                    f"{runtime.path} holds {', '.join(runtime.ignored)}, kept by an earlier version: a "
                    "receiver node takes them from the driver; its start ignores them and removes them "
                    "from the file",
                    level=logging.WARNING,
                )
        _spark_prerequisites(config)
        swapped = _swapped_pipeline(config)
    except DataDirStateError as exc:  # as serve: a damaged file under the data dir
        return _fail(str(exc))
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    keys = _serve_keys()
    effective = _effective(config) if isinstance(config, ServeConfig) else _driver_effective(config)
    effective["stream"] = list(config.streams)  # none given: "default"
    rows = [("key", "value", "source")]
    names = keys_by_dest(keys)
    for dest, origin in args.origins.items():
        name = names[dest].name
        if not isinstance(config, ServeConfig) and name not in DRIVER_KEYS:
            continue  # a driver runs without it (given, it was refused above): its default would mislead
        if name in overrides and name in SETTINGS:
            changed = Origin(RUNTIME, origin.key, runtime_file)
            rows.append((name, overrides[name] or "(none)", changed.described))
            continue
        value = effective.get(name, getattr(args, dest, None))
        rows.append((name, _shown(value), origin.described))
    if swapped is not None:  # what serve runs: a swap stands over the flag, as runtime-config.json does
        rows = [row for row in rows if row[0] != "pipeline"]
        rows.append(("pipeline", swapped[0] or "(built-in)", swapped[1]))
    # padded to the widest value up to CHECK_VALUE_WIDTH, a longer one not padded to: one value of 3 MB
    # (kept in runtime-config.json, or 10,000 streams) padded each of the 60 rows to it, 174 MB in all
    width = [max(len(row[0]) for row in rows), min(CHECK_VALUE_WIDTH, max(len(row[1]) for row in rows))]
    for key, value, source in rows:
        print(f"{key:<{width[0]}}  {value:<{width[1]}}  {source}")
    file = f" (config file {args.config})" if args.config is not None else ""
    logs.say(f"the settings are valid{file}; nothing was started", event="config-valid")
    return 0


CHECK_VALUE_WIDTH = 48
"""`config check` pads its values to the widest one up to this many characters."""


def _swapped_pipeline(config: ServeConfig | DriverConfig) -> tuple[str, str] | None:
    """(spec, source) of a pipeline swapped in at run time that a start would run instead of the
    flag's (DATA_DIR/pipeline.json; None: the flag's runs). Read as the manager reads it (the same
    pipeline_state.in_force: a trial cut short by a crash counts as the manager counts it), never
    written."""
    path = config.data_dir / STATE_FILE
    try:
        state = read_state(path)
    except PipelineStateError as exc:
        raise ValueError(f"{exc}: serve would stop on it") from None
    if state is None:
        return None
    current, _ = in_force(state, config.data_dir / "checkpoints")
    if current.spec == (config.pipeline or "") or config.reset_pipeline:
        return None
    where = f"{path} (generation {current.number}, swapped in at run time; --reset-pipeline runs the flag's)"
    return current.spec, where


def keys_by_dest(keys: Mapping[str, Key]) -> dict[str, Key]:
    """Each destination's first key (--fsync's, not --no-fsync's)."""
    first: dict[str, Key] = {}
    for key in keys.values():
        first.setdefault(key.dest, key)
    return first


def _effective(config: ServeConfig) -> dict[str, object]:
    """The values serve derives for the flags whose default is a rule ("half the buffer", ...)."""
    return {
        "prefetch": config.receiver.fill_to,
        "low-tide": config.receiver.refill_at,
        "block-records": config.receiver.seal_at,
        "block-linger": "off" if config.receiver.block_linger is None else config.receiver.block_linger,
        "segment-bytes": config.wal_segment_bytes,
        "accept-wal-damage": list(config.accept_wal_damage),  # one list of the flags' lists
        "estimator": config.rate.estimator,
        "initial-rate": config.rate.initial_rate,
    }


def _driver_effective(config: DriverConfig) -> dict[str, object]:
    """What a driver runs with, read back from the configs it starts from, its query's ServeConfig
    (serve_config) included, not from the flags: a setting that does not reach them shows as the driver
    runs it. `--reset-pipeline` once showed "true" here while serve_config() left it out and the driver
    ran the swapped-in pipeline all the same."""
    query = config.serve_config()
    return {
        "data-dir": query.data_dir,
        "master": query.master,
        "pipeline": query.pipeline,
        "reset-pipeline": query.reset_pipeline,
        "trigger-interval": query.trigger_interval,
        "estimator": query.rate.estimator,
        "estimator-params": query.rate.estimator_params,
        "initial-rate": query.rate.initial_rate,
        "min-rate": query.rate.min_rate,
        "max-rate": query.rate.max_rate,
        "host": config.rate_host,
        "port": config.rate_port,
        "metrics-host": config.metrics_host,
        "metrics-port": -1 if config.metrics_port is None else config.metrics_port,
        "metrics-tls": config.metrics_tls,
        "health-port": config.health_port,
        "tls-cert": config.cert_file,
        "tls-key": config.key_file,
        "client-ca": config.ca_file,
        "auth-file": config.auth_file,
        "peer-token-file": config.token_file,
        "insecure": config.insecure,
    }


def _shown(value: object) -> str:  # noqa: PLR0911 - one case per type
    """A setting's value as a flag would take it."""
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:g}"
    if isinstance(value, tuple):  # STREAM=VALUE
        return "=".join(map(_shown, value))
    if isinstance(value, list):
        return ",".join(map(_shown, value)) or "(none)"
    if isinstance(value, dict):
        return ",".join(f"{k}={_shown(v)}" for k, v in value.items()) or "(none)"
    return str(value)


# ---- streams and the pipeline --------------------------------------------------------------------


def _show_streams(view: pb.StreamsView) -> int:
    print("stream\tstate\tbacklog\tsessions")
    for s in view.streams:
        print(f"{printable(s.stream)}\t{printable(s.state)}\t{s.backlog}\t{s.sessions}")
    return 0


def _streams_list(args: argparse.Namespace) -> int:
    request = pb.ListStreamsRequest()
    return _show_streams(
        _unary(args, "streams list", lambda ch, md: pb_grpc.AdminStub(ch).ListStreams(request, metadata=md))
    )


def _streams_add(args: argparse.Namespace) -> int:
    request = pb.AddStreamRequest(stream=args.name)
    return _show_streams(
        _unary(args, "streams add", lambda ch, md: pb_grpc.AdminStub(ch).AddStream(request, metadata=md))
    )


def _streams_remove(args: argparse.Namespace) -> int:
    backlog = pb.RemoveStreamRequest.DRAIN if args.drain else pb.RemoveStreamRequest.KEEP
    request = pb.RemoveStreamRequest(stream=args.name, backlog=backlog, reason=args.reason)
    view = _unary(
        args, "streams remove", lambda ch, md: pb_grpc.AdminStub(ch).RemoveStream(request, metadata=md)
    )
    code = _show_streams(view)
    left = next((s for s in view.streams if s.stream == args.name and s.state == "draining"), None)
    if left is not None:  # a drain is not done when the call returns: say what ends it
        logs.write_stderr(
            f"{args.name} stays draining until the query has processed its backlog ({left.backlog:,} records "
            "now), then it is gone; `sluice streams list` shows how far it got. A server without a query "
            "(--no-spark) waits for whatever reads its blocks."
        )
    return code


def _show_pipeline(view: pb.PipelineView) -> int:
    name = printable(view.pipeline or "built-in Parquet sink")
    print(f"pipeline: {name} (generation {view.generation}, {printable(view.state)})")
    print(f"trigger: {view.trigger_interval_seconds:g} s; checkpoint: {printable(view.checkpoint)}")
    query = view.query_id or ("none yet (Spark is starting it)" if view.state == "starting" else "")
    if view.state == "swapping":  # what is shown is the generation in force until the swap ends
        query = "a swap (or a restart for a new trigger interval) is under way: ask again for its outcome"
    print(f"query: {printable(query)}")
    if view.sink_dir:  # where the built-in sink writes (a pipeline given a PipelineContext may too)
        print(f"sink dir: {printable(view.sink_dir)}")
    if view.HasField("last_swap"):
        swap = view.last_swap
        line = (
            f"last swap: {swap.from_pipeline or 'built-in'} -> {swap.to_pipeline or 'built-in'}: "
            f"{swap.outcome} in {swap.duration_seconds:.1f} s"
        )
        if swap.processing_gap_seconds:  # from the old query's last batch, or the request if later
            line += f", processing gap {swap.processing_gap_seconds:.1f} s"
        if swap.startup_seconds:
            line += f" (new query's start-up {swap.startup_seconds:.1f} s)"
        if swap.start_offsets:
            line += ", started at " + ", ".join(f"{k}={v}" for k, v in sorted(swap.start_offsets.items()))
        print(printable(line + (f"; error: {swap.error}" if swap.error else "")))
    return 0


def _pipeline_get(args: argparse.Namespace) -> int:
    request = pb.GetPipelineRequest()
    return _show_pipeline(
        _unary(args, "pipeline get", lambda ch, md: pb_grpc.AdminStub(ch).GetPipeline(request, metadata=md))
    )


def _metrics_port(text: str) -> int:
    """An argparse type: a port, 0 (any) or -1 (off); -2 was taken as off too."""
    try:
        port = ascii_int(text)
    except ValueError:  # argparse's own message names this function ("invalid _metrics_port value")
        raise argparse.ArgumentTypeError(f"a port is 0..65535 (0: any; -1: off), got {text!r}") from None
    if not -1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535 (0: any; -1: off), got {port}")
    return port


def _pipeline_spec(text: str) -> str:
    """An argparse type: serve's --pipeline, never blank. An unset variable (--pipeline "$SPEC", or
    `pipeline = ""` in the file) ran the built-in Parquet sink unasked: leave the setting out for it."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "an empty pipeline (an unset variable?): give MODULE:FUNCTION, or leave it out for the built-in "
            "Parquet sink"
        )
    return text


def _swap_spec(text: str) -> str:
    """An argparse type: a pipeline spec, never blank. The API's "" is the built-in sink; here that is
    'builtin', so an unset shell variable ($SPEC) cannot swap a pipeline out for the Parquet sink."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "an empty pipeline (an unset variable?): give MODULE:FUNCTION, or 'builtin' for the Parquet sink"
        )
    return text


def _pipeline_swap(args: argparse.Namespace) -> int:
    spec = "" if args.spec == "builtin" else args.spec
    request = pb.SwapPipelineRequest(
        pipeline=spec, keep_state=args.keep_state, first_batch_timeout_seconds=args.first_batch_timeout
    )
    goes_on = (
        "; the swap goes on on the server to its end (done, or rolled back to the old pipeline): "
        f"`sluice pipeline get --target {args.target}` shows its outcome"
    )
    view = _unary(
        args,
        "pipeline swap",
        lambda ch, md: pb_grpc.AdminStub(ch).SwapPipeline(request, metadata=md),
        timeout=swap_deadline(args.first_batch_timeout),
        late=goes_on,
        interrupted=goes_on,
        dropped=(
            ": the server may have done the swap, rolled it back, or stopped mid-swap (its next start "
            f"settles it); `sluice pipeline get --target {args.target}` shows its outcome"
        ),
    )
    return _show_pipeline(view)


SWAP_MARGIN = 60.0
"""Seconds `sluice pipeline swap` allows beyond the server's own bounds: the queries' starts."""


SWAP_STOPS = 3
"""Stops in a swap that may each wait stopTimeout for a batch (ingest.pipeline_manager): the old query's
at the boundary, when its batch outlasted BOUNDARY_TIMEOUT (_stop_at_boundary); the new query's, when
its first batch failed or ran out of time (_committed_after_all); and at the rollback the old query's
start (_roll_back), for which Spark first stops a run left behind on its checkpoint: the old query's own
when the boundary's stop timed out, the new one's with keep_state."""


def swap_deadline(first_batch_timeout: float) -> float:
    """Seconds `sluice pipeline swap` waits for the answer: the old query's batch boundary (up to
    BOUNDARY_TIMEOUT), the new query's first batch (up to `first_batch_timeout`), SWAP_STOPS stops of a
    query that wait for a running batch (Spark's stopTimeout each, STOP_TIMEOUT unless configured
    otherwise) and the queries' starts (SWAP_MARGIN). A deadline of first-batch-timeout + 90 s ended
    before a hung first batch's rollback did, and one counting a single stop before a swap whose
    boundary and first batch both hung."""
    return BOUNDARY_TIMEOUT + first_batch_timeout + SWAP_STOPS * STOP_TIMEOUT + SWAP_MARGIN


def config_change_deadline() -> float:
    """Seconds `sluice config set` and `config reset` wait for the answer: a change of the trigger
    interval restarts the query as a swap replaces it (PipelineManager.restart: the same steps, with
    DEFAULT_FIRST_BATCH_TIMEOUT for its first batch), so a swap's deadline. A wait of 300 s ended
    before a restart whose boundary and first batch hung was rolled back (up to 360 s, and the
    queries' starts)."""
    return swap_deadline(DEFAULT_FIRST_BATCH_TIMEOUT)


# ---- status --------------------------------------------------------------------------------------


def _status(args: argparse.Namespace) -> int:
    from ingest.status_cli import (  # noqa: PLC0415 - rich only here
        StatusReadError,
        check_metrics_transport,
        run_status,
        status_json_url,
    )

    if args.metrics is not None:
        try:
            status_json_url(args.metrics)
        except ValueError as exc:
            return _fail(str(exc), EXIT_USAGE)
    elif args.insecure:
        return _fail(
            "--insecure goes with --metrics http://... only (over gRPC the credentials say TLS)", EXIT_USAGE
        )
    credentials = _credentials(args)
    if args.metrics is not None:
        # the certificate flags given on this command line: with --metrics they are for the metrics port
        flags = {"--ca-file": args.ca_file, "--cert-file": args.cert_file, "--key-file": args.key_file}
        try:
            check_metrics_transport(
                args.metrics,
                token=credentials.token is not None,
                tls_flags=[flag for flag, value in flags.items() if value is not None],
                insecure=args.insecure,
            )
        except ValueError as exc:
            return _fail(printable(str(exc)), EXIT_USAGE)
    cert_file = args.cert_file or os.environ.get("SLUICE_CERT_FILE") or None
    key_file = args.key_file or os.environ.get("SLUICE_KEY_FILE") or None
    where = args.metrics or args.target
    try:
        asyncio.run(
            run_status(
                args.target,
                credentials,
                once=args.once,
                metrics_url=args.metrics,
                cert_file=Path(cert_file) if cert_file else None,
                key_file=Path(key_file) if key_file else None,
            )
        )
    except StatusReadError as exc:
        return _fail(f"status of {where}: {printable(str(exc))}", EXIT_DENIED if exc.denied else EXIT_FAILED)
    except KeyboardInterrupt:
        return 0  # the live view ends this way
    return 0


# ---- sessions ------------------------------------------------------------------------------------


def _sessions_list(args: argparse.Namespace) -> int:
    request = pb.ListSessionsRequest(stream=args.stream)
    listing = _unary(
        args, "sessions list", lambda ch, md: pb_grpc.SessionsStub(ch).ListSessions(request, metadata=md)
    )
    print("id\tstream\tprincipal\tproducer\tcredit\tnext_seq\tdurable_up_to\tstate")
    for s in listing.sessions:
        state = "cancelled" if s.cancelled else "completed" if s.completed else "open"
        names = (printable(s.stream), printable(s.principal), printable(s.producer_id))
        print("\t".join(map(str, (s.session_id, *names, s.credit, s.next_seq, s.durable_up_to, state))))
    return 0


ALREADY_OVER = "had already ended or been cancelled: nothing was cancelled"


def _sessions_cancel(args: argparse.Namespace) -> int:
    request = pb.CancelSessionRequest(session_id=args.session_id, code=args.code, reason=args.reason)
    done = _unary(
        args, "sessions cancel", lambda ch, md: pb_grpc.SessionsStub(ch).CancelSession(request, metadata=md)
    )
    # not cancelled: it had ended (its producer closed it, or it failed) or been cancelled already
    print(f"session {request.session_id} {'cancelled' if done.cancelled else ALREADY_OVER}")
    return 0


# ---- rate ----------------------------------------------------------------------------------------


def _rate_get(args: argparse.Namespace) -> int:
    return _show_rate(
        _unary(
            args,
            "rate get",
            lambda ch, md: pb_grpc.RateControlStub(ch).GetRate(pb.GetRateRequest(), metadata=md),
        )
    )


def _rate_set(args: argparse.Namespace) -> int:
    request = pb.UpdateRateRequest(records_per_second=args.records_per_second, pin=args.pin)
    status = _unary(
        args, "rate set", lambda ch, md: pb_grpc.RateControlStub(ch).UpdateRate(request, metadata=md)
    )
    if status is not None:  # the server holds the rate within its bounds: say when that changed it
        asked = _rate_text(request.records_per_second)
        for past, name, bound in (
            (request.records_per_second < status.min_rate, "min-rate", status.min_rate),
            (request.records_per_second > status.max_rate, "max-rate", status.max_rate),
        ):
            if past:
                side = "below" if name == "min-rate" else "above"
                held = f"the {name} ({_rate_text(bound)} records/s)"
                logs.write_stderr(
                    f"sluice: {asked} records/s is {side} {held}: the rate is held at it "
                    "(`sluice rate bounds MIN MAX` changes the bounds)"
                )
    return _show_rate(status)


def _rate_bounds(args: argparse.Namespace) -> int:
    request = pb.SetBoundsRequest(min_rate=args.min_rate, max_rate=args.max_rate)
    return _show_rate(
        _unary(args, "rate bounds", lambda c, md: pb_grpc.RateControlStub(c).SetBounds(request, metadata=md))
    )


def _rate_estimator(args: argparse.Namespace) -> int:
    request = pb.SetEstimatorRequest(estimator=args.name)
    return _show_rate(
        _unary(
            args,
            "rate estimator",
            lambda ch, md: pb_grpc.RateControlStub(ch).SetEstimator(request, metadata=md),
        )
    )


UNKNOWN = "unknown"
"""How a number that is none (NaN, and -inf where no rate can be: a broken server's) is shown."""


def _rate_text(rate: float) -> str:
    """A rate in records/s as the rate commands show it: "unlimited" for inf, UNKNOWN for NaN or -inf,
    else the number without an exponent (1234567, not 1.23457e+06)."""
    if rate == math.inf:
        return "unlimited"
    if not math.isfinite(rate):
        return UNKNOWN
    return f"{rate:g}" if abs(rate) < 1e6 else f"{rate:.0f}"


def _count_text(rate: float) -> str:
    """A measured rate as a whole number with separators (18,571); inf and NaN as _rate_text says them."""
    return f"{rate:,.0f}" if math.isfinite(rate) else _rate_text(rate)


def _seconds_text(seconds: float, spec: str) -> str:
    """`seconds` formatted by `spec` (".3f", "g") with its unit, UNKNOWN when it is not a number."""
    return f"{format(seconds, spec)} s" if math.isfinite(seconds) else UNKNOWN


_NOT_FINITE = frozenset({"inf", "+inf", "-inf", "infinity", "+infinity", "-infinity", "nan", "+nan", "-nan"})


def _state_text(key: str, value: str) -> str:
    """An estimator state value (the server's str() of it) as the rate commands show it: a rate's
    (rate, max_rate, capacity_rps, ...) inf as "unlimited", a NaN as UNKNOWN, the rest as sent."""
    if value.strip().lower() not in _NOT_FINITE:
        return value
    number = float(value)
    if key == "rate" or key.endswith(("_rate", "_rps")):
        return _rate_text(number)
    return UNKNOWN if math.isnan(number) else value


def _share(stream: pb.StreamRate) -> str:
    """Why a stream has its share of the rate, and the operator's bounds on it ("" while unlimited)."""
    if not stream.share_reason or stream.share_reason == "unlimited":
        return ""
    took = f", takes {_count_text(stream.taken_per_second)} records/s" if stream.busy else ""
    bounded = stream.min_rate > 0 or math.isfinite(stream.max_rate)
    bounds = f"; its bounds {_rate_text(stream.min_rate)} .. {_rate_text(stream.max_rate)}" if bounded else ""
    return f" ({printable(stream.share_reason)}{took}{bounds})"


def _show_nodes(nodes: Sequence[pb.NodeRate]) -> None:
    """On a cluster's driver: the rate's split among receiver nodes, one line each."""
    up = sum(1 for node in nodes if node.up)
    print(f"receiver nodes: {up} of {len(nodes)} up")
    rows = [("node", "target", "state", "share/s", "taken/s", "busy", "backlog", "why")]
    rows += [
        (
            str(node.node_id),
            printable(node.target),
            "up" if node.up else "DOWN",
            _count_text(node.records_per_second),
            _count_text(node.taken_per_second),
            "yes" if node.busy else "no",
            f"{node.backlog:,}",
            printable(node.reason),
        )
        for node in nodes
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for *cells, why in rows:
        print("  " + "".join(cell.ljust(width + 2) for cell, width in zip(cells, widths, strict=True)) + why)


def _show_rate(status: pb.RateStatus | None) -> int:
    if status is None:
        return EXIT_FAILED
    pinned = ", pinned" if status.pinned else ""
    estimator = printable(status.estimator)
    print(f"rate: {_rate_text(status.records_per_second)} records/s ({estimator}{pinned})")
    print(f"bounds: {_rate_text(status.min_rate)} .. {_rate_text(status.max_rate)} records/s")
    for stream in status.streams:
        paused = ", ".join(map(printable, stream.credit_paused))
        paused = f" (credit paused: {paused})" if paused else ""
        rate = _rate_text(stream.records_per_second)
        print(f"stream {printable(stream.stream)}: {rate} records/s{_share(stream)}{paused}")
    if status.nodes:
        _show_nodes(status.nodes)
    if status.estimator_state:
        heard = " (its proposals ignored while pinned)" if status.pinned else ""
        shown = (f"{k}={_state_text(k, v)}" for k, v in sorted(status.estimator_state.items()))
        state = printable(", ".join(shown))
        print(f"estimator state{heard}: {state}")
    if status.HasField("last_batch"):
        b = status.last_batch
        print(
            f"last batch: #{b.batch_id}, {b.records} records, "
            f"processing {_seconds_text(b.processing_delay_seconds, '.3f')}, "
            f"scheduling delay {_seconds_text(b.scheduling_delay_seconds, '.3f')}, "
            f"interval {_seconds_text(b.batch_interval_seconds, 'g')}"
            + (f", {b.backlog} left behind" if b.HasField("backlog") else "")
            + (f", {b.waiting} waiting at completion" if b.HasField("waiting") else "")
        )
    return 0


Metadata = tuple[tuple[str, str], ...]

DROPPED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL})
"""Statuses gRPC gives a call whose server went away under it ("Stream removed", "Socket closed")."""


def _answered(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the server itself ended the call with this status (a refusal marked REFUSAL_HEADER): then
    the connection did not drop, whatever the code. A status gRPC makes up for a lost connection has no
    trailing metadata; grpcio's debug_error_string no longer tells "received from peer" apart."""
    entries: Any = exc.trailing_metadata() or ()  # (key, value) pairs; grpc's stubs type them opaquely
    return any(key == REFUSAL_HEADER for key, _ in entries)


def _unary(
    args: argparse.Namespace,
    what: str,
    call: Callable[[grpc.aio.Channel, Metadata], Awaitable[T]],
    *,
    timeout: float = 10.0,
    late: str = "",
    interrupted: str = "",
    dropped: str = "",
) -> T:
    """One unary call to the server at args.target with the credentials of `args`; on failure print why
    (status and details) in one line and raise _Failed (EXIT_DENIED when the server refused them).
    `late`: said after "no answer within N s" when the call outlives `timeout`. `interrupted`: said after
    "interrupted" on Ctrl-C (exit 130) once the connection was up, so that the server may have the call;
    without it a Ctrl-C is main()'s. `dropped`: said after a failure that ends a call whose connection
    was up (the server went away mid-call: it may have acted on it). The TLS hint (connect_hint) only
    for a connection that never came up: "Socket closed" on one that was up is no TLS mistake."""
    credentials = _credentials(args)
    target = args.target
    connected: list[bool] = []  # whether the call could have reached the server

    async def watch(channel: grpc.aio.Channel) -> None:
        """Notes in `connected` once the channel is READY (the handshake done: the call went out)."""
        state = channel.get_state(try_to_connect=False)
        while state != grpc.ChannelConnectivity.READY:
            await channel.wait_for_state_change(state)
            state = channel.get_state(try_to_connect=False)
        connected.append(True)

    async def run() -> T:
        async with credentials.channel(target) as channel:
            watcher = asyncio.ensure_future(watch(channel))
            try:
                return await asyncio.wait_for(call(channel, credentials.metadata), timeout)
            except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels this, then raises KeyboardInterrupt
                connected.append(channel.get_state() == grpc.ChannelConnectivity.READY)
                raise
            except grpc.aio.AioRpcError as exc:
                details = exc.details() or ""
                code = EXIT_DENIED if refused(exc.code(), details) else EXIT_FAILED
                message = f"{what} on {target}: {exc.code().name}: {printable(details)}"
                up = any(connected)
                message += connect_hint(exc.code(), details, secure=credentials.secure, connected=up)
                if up and dropped and exc.code() in DROPPED and not _answered(exc):
                    message += f"; the connection dropped after the call went out{dropped}"
                raise _Failed(_fail(message, code)) from None
            except TimeoutError:
                raise _Failed(_fail(f"{what} on {target}: no answer within {timeout:g} s{late}")) from None
            finally:
                watcher.cancel()

    try:
        return asyncio.run(run())
    except KeyboardInterrupt:
        if not interrupted:
            raise
        # a call goes out on a connection that is up; before that, none was made
        said = interrupted if any(connected) else " before the connection was up: nothing was asked"
        logs.say(f"{what} on {target}: interrupted{said}", level=logging.WARNING)
        raise _Failed(EXIT_INTERRUPTED) from None


if __name__ == "__main__":
    sys.exit(main(whole_process=True))
