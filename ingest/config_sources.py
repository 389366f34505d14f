"""Where `sluice serve`'s settings come from: flags > environment > TOML file > defaults.

The keys are derived from the argparse parser of `sluice serve`, never listed a second time: a flag
`--block-interval` is the key `block-interval` in the file (given with --config or $SLUICE_CONFIG) and
the variable SLUICE_BLOCK_INTERVAL. A value from the file or the environment goes through the flag's own
argparse type, so it is checked exactly as the flag is. A key in the file, or a SLUICE_* variable, that
names no flag is an error (ConfigError) rather than a setting silently ignored. Settings changed at run
time and kept in DATA_DIR/runtime-config.json override all of these at the next start
(ingest.runtime_config). The long story: docs/configuration.md.
"""

from __future__ import annotations

import argparse
import math
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ingest.config import OutOfRange, ascii_float
from sluice_client.settings_file import read_settings_file

DEFAULT, FILE, ENV, FLAG, RUNTIME = "default", "file", "env", "flag", "runtime"
"""The sources of a setting, from the weakest to the strongest."""

ENV_PREFIX = "SLUICE_"
CONFIG_ENV = "SLUICE_CONFIG"
"""The configuration file, when --config is not given."""
OTHER_ENV = frozenset(
    {
        CONFIG_ENV,
        # the client commands' credentials (sluice_client.credentials): often exported in the same shell
        "SLUICE_CA_FILE",
        "SLUICE_CERT_FILE",
        "SLUICE_KEY_FILE",
        "SLUICE_TOKEN_FILE",
        "SLUICE_TOKEN",
        # deploy/kubernetes/driver.yaml: read by Spark's own configuration, ${env:...}
        "SLUICE_NAMESPACE",
        "SLUICE_POD_NAME",
        # deploy/systemd/sluice.service: more serve flags, from /etc/sluice/sluice.env (EnvironmentFile
        # puts it in serve's environment too: refused, the shipped unit stopped with exit 2)
        "SLUICE_ARGS",
        # tests/test_crash.py
        "SLUICE_CRASH_SEED",
        # sluice_client.allocator: the SDK's and the server's malloc settings
        "SLUICE_MALLOC_TUNING",
    }
)
"""SLUICE_* variables that name no serve flag but are known: not errors. (SLUICE_NODE_ID is --node-id's.)"""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


class ConfigError(ValueError):
    """A key that names no setting, or a value its flag refuses; the message says where it came from."""


@dataclass(frozen=True)
class Key:
    """One setting: a `sluice serve` flag and its names in the file and the environment."""

    name: str
    """The flag without its dashes: the key in the TOML file."""
    action: argparse.Action

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.action.dest


@dataclass(frozen=True)
class Origin:
    """Where a setting's value came from."""

    source: str
    """DEFAULT, FILE, ENV, FLAG (or RUNTIME: DATA_DIR/runtime-config.json)."""
    key: Key
    """The key as the user wrote it (--no-fsync and --fsync share a destination)."""
    where: str = ""
    """The file's path (FILE, RUNTIME)."""

    @property
    def spelled(self) -> str:
        """The key as the user wrote it: --block-interval, SLUICE_BLOCK_INTERVAL, block-interval in FILE."""
        if self.source == ENV:
            return self.key.env
        if self.source in (FILE, RUNTIME):
            return f"{self.key.name} (in {self.where})"
        return self.key.flag

    @property
    def described(self) -> str:
        """The source for a listing: "flag", "env SLUICE_PORT", "file sluice.toml", "default"."""
        if self.source == ENV:
            return f"env {self.key.env}"
        if self.source in (FILE, RUNTIME):
            return f"{self.source} {self.where}"
        return self.source


def keys_of(parser: argparse.ArgumentParser, skip: Iterable[str] = ("help", "config")) -> dict[str, Key]:
    """The settings of `parser`'s flags, by key: each flag's first long option without its dashes."""
    keys: dict[str, Key] = {}
    for action in parser._actions:
        long = [o for o in action.option_strings if o.startswith("--")]
        if not long or action.dest in skip:
            continue
        keys[long[0][2:]] = Key(long[0][2:], action)
    return keys


def subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    """The parser of the command `path` (e.g. "config", "check") under `parser`."""
    for name in path:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) and name in action.choices:
                parser = action.choices[name]
                break
        else:
            raise KeyError(name)
    return parser


def explicit_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations `argv` sets itself (a flag given with its default value counts). `parser` is
    changed: give a fresh one."""

    def suppress(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    suppress(sub)
            elif action.option_strings:
                action.default = argparse.SUPPRESS

    suppress(parser)
    return set(vars(parser.parse_args(argv)))


def read_file(path: Path, keys: Mapping[str, Key]) -> dict[str, object]:
    """The TOML file's settings, key -> value; ConfigError naming the file for anything wrong."""
    try:
        # ascii_float: TOML reads 1e400 as inf, which to a rate means no limit at all; TOML's own
        # digit separators (1_000.5, checked by tomllib) are TOML's, and taken
        data = tomllib.loads(
            read_settings_file(path).decode("utf-8"),
            parse_float=lambda text: ascii_float(text.replace("_", "")),
        )
    except OutOfRange as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    for name, value in data.items():
        if name not in keys:
            hint = " (keys are the serve flags without their dashes, at the top level)"
            if isinstance(value, dict):
                hint = " (tables are not used: write each key at the top level)"
            raise ConfigError(f"config file {path}: unknown key {name!r}{hint}; see `sluice serve --help`")
    return data


def read_env(environ: Mapping[str, str], keys: Mapping[str, Key]) -> dict[str, str]:
    """The SLUICE_* variables' settings, key -> text; ConfigError for a variable that names no flag."""
    by_env = {key.env: key.name for key in keys.values()}
    found: dict[str, str] = {}
    for variable, text in sorted(environ.items()):
        if not variable.startswith(ENV_PREFIX) or variable in OTHER_ENV:
            continue
        if variable not in by_env:
            raise ConfigError(
                f"environment variable {variable} names no `sluice serve` flag (SLUICE_ + the flag's name, "
                "upper case, dashes as underscores; unset it, or see `sluice serve --help`)"
            )
        found[by_env[variable]] = text
    return found


_UNSET = object()


def convert(key: Key, value: object, where: str, *, from_env: bool = False) -> object:
    """`value` (from TOML, or an environment variable's text) as the flag would have set it; a list
    flag (--stream) takes a TOML list or, from the environment, comma-separated items."""
    action = key.action
    if action.nargs == 0:  # a switch: --insecure, --no-spark, --metrics-auth/--no-metrics-auth
        on = _boolean(value, where)
        if isinstance(action, argparse.BooleanOptionalAction):
            return on
        if on:
            return action.const
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            # `no-spark = false`: the switch's off value, given (the file's, the environment's): it was
            # dropped, so its source showed as "default", and SLUICE_NO_SPARK=false did not override the
            # file's `no-spark = true`
            return action.default
        return _UNSET  # `no-fsync = false` says nothing of --fsync, which shares its destination
    appends = isinstance(action, argparse._AppendAction)
    texts = _texts(value, where, many=appends, from_env=from_env)
    if appends and not texts and action.default != []:
        # `stream = []` would mean the default ("default"), the opposite of what it says; a list whose
        # default is empty (stream-weight) may be given empty
        raise ConfigError(f"{where}: an empty list: give at least one value, or leave it out for the default")
    values = [_typed(action, text, where) for text in texts]
    return values if appends else values[0]


def _boolean(value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def _texts(value: object, where: str, *, many: bool, from_env: bool) -> list[str]:
    """A value as the flag's argument text(s): a table is "name=value" pairs, a list one text per item."""
    if isinstance(value, dict):
        pairs = [f"{name}={_scalar(v, where)}" for name, v in value.items()]
        return pairs if many else [",".join(pairs)]
    if isinstance(value, list):
        if not many:
            raise ConfigError(f"{where}: expected one value, got a list")
        return [_scalar(v, where) for v in value]
    text = _scalar(value, where)
    if many and from_env:  # SLUICE_STREAM=a,b
        return [part.strip() for part in text.split(",") if part.strip()]
    return [text]


def _scalar(value: object, where: str) -> str:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a value, not {str(value).lower()}")
    if isinstance(value, float):
        return "inf" if value == math.inf else "-inf" if value == -math.inf else repr(value)
    if isinstance(value, int | str):
        return str(value)
    raise ConfigError(f"{where}: expected a number or a string, got {type(value).__name__} {value!r}")


def _typed(action: argparse.Action, text: str, where: str) -> object:
    convert_text = action.type if callable(action.type) else str
    try:
        value: object = convert_text(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except (ValueError, TypeError):
        kind = getattr(action.type, "__name__", "value")
        raise ConfigError(f"{where}: invalid {kind} value: {text!r}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: invalid choice: {text!r} (choose from {choices})")
    return value


def apply_sources(
    args: argparse.Namespace,
    keys: Mapping[str, Key],
    explicit: set[str],
    environ: Mapping[str, str],
    config_file: Path | None,
    *,
    shadowed: dict[str, list[Origin]] | None = None,
) -> dict[str, Origin]:
    """Fill `args` (parsed from the command line) with the environment's and the file's values for
    every destination the command line left at its default; destination -> Origin of its value.
    `shadowed` (when given) gets destination -> the Origins of values given there too but not in
    force (a file's under the environment's or a flag's, the environment's under a flag's), lowest
    first: what a refusal of the setting must name as well, or the next start meets them."""
    origins: dict[str, Origin] = {}
    for key in keys.values():
        if key.dest not in origins:  # the first key of a destination names it (--fsync, not --no-fsync)
            origins[key.dest] = Origin(FLAG if key.dest in explicit else DEFAULT, key)
    layers: list[tuple[str, dict[str, object], str]] = []
    if config_file is not None:
        layers.append((FILE, read_file(config_file, keys), str(config_file)))
    layers.append((ENV, dict(read_env(environ, keys)), ""))
    for source, values, path in layers:  # the environment after the file: it wins
        for name, value in values.items():
            key = keys[name]
            where = key.env if source == ENV else f"{name} (in {path})"
            converted = convert(key, value, where, from_env=source == ENV)
            if converted is _UNSET:
                continue
            if key.dest in explicit:
                if shadowed is not None:
                    shadowed.setdefault(key.dest, []).append(Origin(source, key, path))
                continue
            if shadowed is not None and origins[key.dest].source == FILE:  # the environment's wins
                shadowed.setdefault(key.dest, []).append(origins[key.dest])
            setattr(args, key.dest, converted)
            origins[key.dest] = Origin(source, key, path)
    return origins


# Names the configuration dataclasses' checks use for their fields (ServeConfig, ReceiverConfig,
# RateConfig, SecurityConfig, Limits...), in code or in words, -> the serve flag's key.
FIELD_KEYS: dict[str, str] = {
    "block_interval": "block-interval",
    "block interval": "block-interval",
    "block_linger": "block-linger",
    "buffer_records": "buffer-records",
    "buffer_bytes": "buffer-bytes",
    "memory_budget_bytes": "memory-budget",
    "disk_budget_bytes": "disk-budget",
    "low_tide": "low-tide",
    "prefetch": "prefetch",
    "block_records": "block-records",
    "min_rate": "min-rate",
    "max_rate": "max-rate",
    "initial_rate": "initial-rate",
    "trigger interval": "trigger-interval",
    "trigger_interval": "trigger-interval",
    "segment bytes": "segment-bytes",
    "gRPC port": "port",
    "gRPC host": "host",
    "metrics host": "metrics-host",
    "metrics port": "metrics-port",
    "health port": "health-port",
    "port": "port",
    "master": "master",
    "handshake timeout": "handshake-timeout",
    "connection idle timeout": "connection-idle-timeout",
    "max connections": "max-connections",
    "metrics TLS": "metrics-tls",
    "max_sessions": "max-sessions-per-principal",
    "max_streams": "max-streams-per-principal",
    "max_message_bytes": "max-message-bytes-per-principal",
    "max message bytes": "max-message-bytes",
    "max_record_bytes": "max-record-bytes",
    "idle_timeout": "idle-timeout",
}


def user_names(message: str, origins: Mapping[str, Origin], keys: Mapping[str, Key]) -> tuple[str, bool]:
    """`message` with each field name (FIELD_KEYS) and each --flag replaced by the key as the user
    wrote it (--low-tide, SLUICE_LOW_TIDE, low-tide (in FILE)); and whether it named any."""
    by_flag = {key.flag: key for key in keys.values()}
    names = sorted(FIELD_KEYS, key=len, reverse=True)
    flags = sorted(by_flag, key=len, reverse=True)
    pattern = re.compile(
        "|".join(
            # a quoted word is a value (a stream 'port', an estimator's parameter 'min_rate'), not a key
            [rf"(?<![\w'-]){re.escape(f)}(?![\w'-])" for f in flags]
            + [rf"(?<![\w'-]){re.escape(n)}(?![\w'-])" for n in names]
        )
    )
    named = False

    def spell(match: re.Match[str]) -> str:
        nonlocal named
        word = match.group(0)
        key = by_flag.get(word) or keys.get(FIELD_KEYS.get(word, ""))
        if key is None:
            return word
        named = True
        origin = origins.get(key.dest)
        if origin is None:
            return key.flag
        if origin.key.name != key.name:  # e.g. --no-fsync set what --fsync names
            return Origin(origin.source, key, origin.where).spelled
        return origin.spelled

    return pattern.sub(spell, message), named


def name_keys(
    message: str, origins: Mapping[str, Origin], keys: Mapping[str, Key], fallback: Sequence[str] = ()
) -> str:
    """user_names(); a message that names no key is prefixed with the `fallback` keys' names."""
    text, named = user_names(message, origins, keys)
    if named or not fallback:
        return text
    known = [keys[k] for k in fallback if k in keys]
    spelled = [origins[key.dest].spelled if key.dest in origins else key.flag for key in known]
    return f"{', '.join(spelled)}: {text}" if spelled else text
