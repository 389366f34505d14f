"""Settings that change while the service runs (`sluice config`, the Admin service).

Each setting is named as its `sluice serve` flag without the dashes and takes the flag's syntax. A change
is validated by building the whole new ServeConfig (so every check of ReceiverConfig, RateConfig and
ServeConfig runs, cross-field ones included) before anything is applied; a request applies all its
changes or none. Applied changes are kept in DATA_DIR/runtime-config.json (written atomically) and, at
the next start, override the command line's values, as Kafka's dynamic broker configs override
server.properties.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ingest.config import (
    DRIVER_ONLY_SETTINGS,
    OutOfRange,
    ServeConfig,
    ascii_float,
    ascii_int,
    format_estimator_params,
    parse_estimator_params,
)
from ratecontrol import ESTIMATORS, MAX_RATE
from receivers.errors import cut, printable
from receivers.files import DataDirStateError, present, read_json, replace_json
from receivers.sizes import parse_size

log = logging.getLogger(__name__)

FILE = "runtime-config.json"

DEFAULT, COMMAND_LINE, DYNAMIC = "default", "command-line", "dynamic"


MAX_VALUE = 4096
"""The longest value a setting takes, in characters (all 16 of the model's parameters, each to 17 digits,
are under 700)."""

THE_SETTINGS = "the settings"
"""What a change that fails to write its file could not save (rate_service.refuse_unsaved)."""


class SettingRow(NamedTuple):
    """A setting as `sluice config get` shows it (pb.ConfigSetting)."""

    key: str
    value: str
    source: str
    help: str
    effective: str
    """What the rule gives while value is "" (low-tide, block-records), else ""."""


class SettingError(ValueError):
    """A setting name or value the service refuses; nothing was changed."""


class SettingsFileError(SettingError, DataDirStateError):
    """DATA_DIR/runtime-config.json cannot be read or is not a settings file (damage: `sluice serve`
    exits 1 on it; a value its setting refuses is a SettingError, exit 2, as on the command line)."""


_DELETE_SETTINGS = (
    "restore it, or delete it to start from the command line's settings (what `sluice config set` "
    "changed and a pinned rate are then gone)"
)


class UnknownSettingError(SettingError, KeyError):
    """No such setting (or not one that changes at run time)."""

    def __str__(self) -> str:
        return str(self.args[0])


class VersionConflictError(SettingError):
    """The config changed since the version the caller read."""


def _float(text: str) -> float:
    try:
        value = ascii_float(text)
    except OutOfRange as exc:
        raise SettingError(str(exc)) from None
    except ValueError:
        raise SettingError(f"{text!r} is not a number") from None
    if math.isnan(value):
        raise SettingError("NaN is not a value")
    return value + 0.0  # -0 is 0 (shown as "-0" otherwise)


def _int(text: str) -> int:
    try:
        return ascii_int(text)
    except OutOfRange as exc:
        raise SettingError(str(exc)) from None
    except ValueError:
        raise SettingError(f"{text!r} is not an integer") from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise SettingError(str(exc)) from None


def _optional(parse: Callable[[str], object]) -> Callable[[str], object]:
    """ "" (or "none") means the flag's default of None."""
    return lambda text: None if text.strip().lower() in ("", "none") else parse(text)


def _empty_meant(key: str) -> str | None:
    """What an empty value saved by an earlier version meant for `key` ("none" for a budget, "off" for
    the linger), which takes the empty value no more; None: "" is still a value of its own there."""
    setting = SETTINGS.get(key)
    return (setting.none or None) if setting is not None else None


def _none_as(word: str, parse: Callable[[str], object], empty: str) -> Callable[[str], object]:
    """`word` ("none", "off") means None; an empty value is refused (SettingError `empty`), as by the
    flags: an unset shell variable (`config set disk-budget=$BUDGET`) must not lift a bound or turn a
    feature off unseen."""

    def parsed(text: str) -> object:
        if text.strip().lower() == word:
            return None
        if not text.strip():
            raise SettingError(empty)
        return parse(text)

    return parsed


_budget = _none_as("none", _size, "an empty budget: give a size, or 'none' for no budget")
"""A size, or "none" for no budget."""


def _off_or(parse: Callable[[str], object]) -> Callable[[str], object]:
    """ "off" means None: the feature off."""
    return _none_as("off", parse, "an empty value: give a value, or 'off'")


def _estimator(text: str) -> str:
    if text not in ESTIMATORS:
        raise SettingError(f"unknown estimator {text!r}; known: {', '.join(ESTIMATORS)}")
    return text


def _estimator_params(text: str) -> dict[str, float]:
    try:
        return parse_estimator_params(text)
    except ValueError as exc:
        raise SettingError(str(exc)) from None


def _text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, Mapping):
        return format_estimator_params(value)
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:g}"
    return str(value)


@dataclass(frozen=True)
class Setting:
    key: str
    help: str
    parse: Callable[[str], object]
    section: str
    """"receiver" (ReceiverConfig), "rate" (RateConfig) or "" (ServeConfig itself)."""
    field: str
    none: str = ""
    """How None is shown: "" (the flag's default rule) unless None means something else ("off")."""
    derived: Callable[[ServeConfig], object] | None = None
    """The value the rule gives while the setting is None (shown beside it: ConfigSetting.effective)."""

    def effective(self, config: ServeConfig) -> str:
        """What the rule gives while the setting is None, else ""."""
        if self.derived is None or self.read(config) is not None:
            return ""
        return _text(self.derived(config))

    def read(self, config: ServeConfig) -> object:
        return getattr(getattr(config, self.section) if self.section else config, self.field)

    def text(self, config: ServeConfig) -> str:
        value = self.read(config)
        return self.none if value is None else _text(value)


SETTINGS: dict[str, Setting] = {
    s.key: s
    for s in (
        Setting(
            "trigger-interval",
            "seconds between micro-batches (restarts the query at a batch boundary)",
            _float,
            "",
            "trigger_interval",
        ),
        Setting("block-interval", "seconds between sealed blocks", _float, "receiver", "block_interval"),
        Setting(
            "block-linger",
            "seal early once no batch has come for this long ('off': never)",
            _off_or(_float),
            "receiver",
            "block_linger",
            none="off",
        ),
        Setting(
            "prefetch",
            "credit a session is topped up to ('': half the buffer)",
            _optional(_int),
            "receiver",
            "prefetch",
            derived=lambda config: config.receiver.fill_to,
        ),
        Setting(
            "low-tide",
            "top a session up when its credit falls to this ('' : half the prefetch)",
            _optional(_int),
            "receiver",
            "low_tide",
            derived=lambda config: config.receiver.refill_at,
        ),
        Setting(
            "block-records",
            "seal a block early once this many records wait ('': a quarter of the buffer)",
            _optional(_int),
            "receiver",
            "block_records",
            derived=lambda config: config.receiver.seal_at,
        ),
        Setting(
            "buffer-records",
            "records buffered + credit outstanding per stream",
            _int,
            "receiver",
            "buffer_records",
        ),
        Setting(
            "buffer-bytes",
            "per stream, the memory budget in bytes (e.g. 512MiB)",
            _size,
            "receiver",
            "buffer_bytes",
        ),
        Setting(
            "memory-budget",
            "every stream together, the server's memory budget in bytes (none: no budget)",
            _budget,
            "receiver",
            "memory_budget_bytes",
            none="none",
        ),
        Setting(
            "disk-budget",
            "bytes the block log may take on disk (none: no budget)",
            _budget,
            "receiver",
            "disk_budget_bytes",
            none="none",
        ),
        Setting("min-rate", "lowest rate, records/s", _float, "rate", "min_rate"),
        Setting("max-rate", "highest rate, records/s (inf: none)", _float, "rate", "max_rate"),
        Setting("estimator", "rate estimator: " + ", ".join(ESTIMATORS), _estimator, "rate", "estimator"),
        Setting(
            "estimator-params",
            "the estimator's parameters, name=value,... (e.g. horizon=3)",
            _estimator_params,
            "rate",
            "estimator_params",
        ),
    )
}


_KEY_OF = {setting.field: setting.key for setting in SETTINGS.values()}
_FIELDS = re.compile(
    "|".join(rf"(?<![\w-]){re.escape(f)}(?![\w-])" for f in sorted(_KEY_OF, key=len, reverse=True))
)


def _with(config: ServeConfig, values: Mapping[str, object]) -> ServeConfig:
    """`config` with settings key -> parsed value; its checks raise SettingError."""
    sections: dict[str, dict[str, object]] = {"receiver": {}, "rate": {}, "": {}}
    for key, value in values.items():
        setting = SETTINGS[key]
        sections[setting.section][setting.field] = value
    try:
        receiver = dataclasses.replace(config.receiver, **sections["receiver"])  # type: ignore[arg-type]
        rate = dataclasses.replace(config.rate, **sections["rate"])  # type: ignore[arg-type]
        return dataclasses.replace(config, receiver=receiver, rate=rate, **sections[""])  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise SettingError(_keys_named(str(exc))) from None


def _keys_named(message: str) -> str:
    """A config check's message with each field it names (low_tide) spelled as its setting's key
    (low-tide): the names a caller of `sluice config set` knows."""
    return _FIELDS.sub(lambda match: _KEY_OF[match.group(0)], message)


class RuntimeConfig:
    """The command line's config, the dynamic overrides on top, and their version."""

    def __init__(
        self,
        base: ServeConfig,
        defaults: ServeConfig | None = None,
        origins: Mapping[str, str] | None = None,
        *,
        announce: bool = True,
    ) -> None:
        """`announce`: log each override as the server takes it (not for a check before the start)."""
        self.base = base
        self._announce = announce
        """What the command line gave (with the defaults for what it did not)."""
        self._defaults = defaults
        self._origins = dict(origins or {})
        """Setting key -> where `sluice serve` took its value: "file PATH", "env VAR" (a flag, or
        nothing given, are told apart with `defaults`)."""
        self.path = base.data_dir / FILE
        self.overrides: dict[str, str] = {}
        self.ignored: dict[str, str] = {}
        """On a cluster's receiver node: the driver's settings (DRIVER_ONLY_SETTINGS) the file holds, kept
        by an earlier version (before a node refused them), key -> value. Never in force: they clamped the
        share the driver pins the node. clear_ignored() takes them out of the file."""
        self.pinned_rate: float | None = None
        """The rate `sluice rate set RATE --pin` pinned (records/s, clamped into the bounds, again by new
        bounds), kept in the same file so that a restart pins it again; None: not pinned. Not a setting:
        no version."""
        self.version = 0
        self.changes: dict[tuple[str, str], int] = {}
        """(key, "applied" | "invalid") -> count, for metrics."""
        self._lock = threading.Lock()
        self._load()
        self.current = self._build(self.overrides)
        """The config in force: base with the overrides."""

    def _load(self) -> None:
        try:
            if not present(self.path):  # a symlink to nowhere: refused by read_json, named
                return
        except OSError as exc:  # a data dir no one may search, a path too long: one line, not a traceback
            raise SettingError(f"{self.path}: cannot read the runtime settings: {exc.strerror}") from None
        data = read_json(self.path, "the runtime settings", SettingsFileError, _DELETE_SETTINGS)  # `null` too
        overrides = data.get("overrides") if isinstance(data, dict) else None
        version = data.get("version") if isinstance(data, dict) else None
        valid_version = isinstance(version, int) and not isinstance(version, bool) and version >= 0
        if not isinstance(overrides, dict) or not valid_version:
            raise SettingsFileError(
                f"{self.path}: not a runtime settings file (an object of a version >= 0 and overrides); "
                f"{_DELETE_SETTINGS}"
            )
        # an empty budget or linger, which `config set` took for none (off) before it took "none" ("off")
        # alone, still means it
        overrides = {
            str(k): ((_empty_meant(str(k)) or "") if str(v).strip() == "" else str(v))
            for k, v in overrides.items()
        }
        if self.base.cluster is not None:  # a receiver node: the driver's settings are not its own
            self.ignored = {k: v for k, v in overrides.items() if k in DRIVER_ONLY_SETTINGS}
            overrides = {k: v for k, v in overrides.items() if k not in DRIVER_ONLY_SETTINGS}
        try:
            self._build(overrides)
        except SettingError as exc:
            # from an older version with other bounds, or edited by hand: say how to get going again
            raise SettingError(
                f"{self.path}: {exc} (this file holds what `sluice config set` changed: correct the "
                "value there, or delete the file to start from the command line's settings)"
            ) from None
        self.overrides = overrides
        self.version = data.get("version", 0)
        self.pinned_rate = _pinned_rate(data.get("pinned_rate"), self.path)
        for key, value in self.overrides.items() if self._announce else ():
            was = SETTINGS[key].text(self.base) or "(none)"
            # as SetConfig took it: "0.5\n" is a float, its newline no log line; and cut: a 3 MB "0.111..."
            # kept by an earlier version was a 3 MB line at every start
            shown = printable(cut(value))
            log.info("setting %s = %s (dynamic, %s; without it: %s)", key, shown, self.path, was)

    def clear_ignored(self) -> None:
        """Take the driver's settings an earlier version kept on this receiver node (self.ignored) out
        of the file, with one WARNING naming each; nothing when there are none. The caller holds the
        data dir's lock. A file that cannot be written: they stay there, ignored, and the WARNING says
        so (OSError is not raised: the node runs without them either way)."""
        if not self.ignored:
            return
        named = ", ".join(f"{key} = {printable(cut(value))}" for key, value in self.ignored.items())
        why = (
            f"{self.path} holds {named}, kept by an earlier version: a cluster's receiver node takes "
            f"{'them' if len(self.ignored) > 1 else 'it'} from the driver, which pins the node's share "
            "(a node's own bounds would clamp it)"
        )
        driver = (
            "set the cluster's on the driver (sluice rate bounds|estimator --target DRIVER_HOST:PORT, its "
            "--estimator-params and --trigger-interval at its start)"
        )
        with self._lock:
            try:
                self._persist(self.overrides, self.version, self.pinned_rate)
            except OSError as exc:
                log.warning(
                    "%s; ignored, but still in the file (it cannot be written: %s): delete %s there; %s",
                    why,
                    exc,
                    ", ".join(self.ignored),
                    driver,
                )
                return
        log.warning("%s; ignored, and removed from the file; %s", why, driver)
        self.ignored = {}

    def _build(self, overrides: Mapping[str, str]) -> ServeConfig:
        parsed = {}
        for key, text in overrides.items():
            setting = SETTINGS.get(key)
            if setting is None:
                raise UnknownSettingError(f"no setting {key!r}; settings: {', '.join(SETTINGS)}")
            try:
                parsed[key] = setting.parse(text)
            except SettingError as exc:
                raise SettingError(f"{key}: {exc}") from None
        return _with(self.base, parsed)

    def source(self, key: str, overrides: Mapping[str, str] | None = None) -> str:
        if key in (self.overrides if overrides is None else overrides):
            return DYNAMIC
        if key in self._origins:  # a config file or the environment
            return self._origins[key]
        if self._defaults is not None and SETTINGS[key].read(self._defaults) == SETTINGS[key].read(self.base):
            return DEFAULT
        return COMMAND_LINE

    def view(self, keys: Iterable[str] = ()) -> list[SettingRow]:
        """The rows of `keys` (all when empty); UnknownSettingError for others."""
        return self._rows(keys, self.current, self.overrides)

    def preview(self, set_: Mapping[str, str], reset: Iterable[str] = ()) -> list[SettingRow]:
        """view() of every setting as change() with these would leave them, nothing applied; raises as
        change() does."""
        _check_keys(set_, list(reset))
        overrides = {k: v for k, v in self.overrides.items() if k not in reset}
        overrides.update({k: v.strip() for k, v in set_.items()})
        rows = self._rows((), self._build(overrides), overrides)
        _check_lengths(set_)
        return rows

    def _rows(
        self, keys: Iterable[str], config: ServeConfig, overrides: Mapping[str, str]
    ) -> list[SettingRow]:
        # each once: a reader's GetConfig of one key 300,000 times was answered 300,000 rows (19 MB,
        # seconds of the event loop, every other client waiting)
        wanted = list(dict.fromkeys(keys)) or list(SETTINGS)
        for key in wanted:
            if key not in SETTINGS:
                raise UnknownSettingError(f"no setting {key!r}; settings: {', '.join(SETTINGS)}")
        return [
            SettingRow(
                key,
                SETTINGS[key].text(config),
                self.source(key, overrides),
                SETTINGS[key].help,
                SETTINGS[key].effective(config),
            )
            for key in wanted
        ]

    def change(
        self,
        set_: Mapping[str, str],
        reset: Iterable[str] = (),
        *,
        validate_only: bool = False,
        expected_version: int | None = None,
    ) -> tuple[ServeConfig, ServeConfig]:
        """Validate every change, then (unless validate_only) keep and persist them all: (old, new)
        configs. SettingError (UnknownSettingError, VersionConflictError) and nothing changes. A key
        reset that was not set at run time is nothing to reset (not_set): a change of only such keys
        is no change, and the version stays (100,000 resets of an unset key bumped it, and the file was
        written as often)."""
        reset = list(dict.fromkeys(reset))
        with self._lock:
            try:
                if expected_version is not None and expected_version != self.version:
                    raise VersionConflictError(
                        f"the settings are at version {self.version}, not {expected_version}: read them again"
                    )
                _check_keys(set_, reset)
                overrides = {k: v for k, v in self.overrides.items() if k not in reset}
                overrides.update({k: v.strip() for k, v in set_.items()})
                new = self._build(overrides)
                _check_lengths(set_)
            except SettingError as exc:
                self._count_invalid([*set_, *reset])
                if "estimator" in set_ and "estimator-params" not in set_ and "has no parameter" in str(exc):
                    # the parameters in force are another estimator's: say how to switch
                    raise SettingError(
                        f"{exc}; the estimator-params in force are another estimator's: give "
                        f"estimator-params with it (`sluice config set estimator={set_['estimator'].strip()} "
                        "estimator-params=` for its defaults), or `sluice rate estimator "
                        f"{set_['estimator'].strip()}`"
                    ) from None
                raise
            old = self.current
            reset = [key for key in reset if key in self.overrides]  # the others: nothing to reset
            if validate_only or not (set_ or reset):
                return old, new
            pinned = self.pinned_rate
            if pinned is not None:
                # new bounds clamp a pinned rate as they clamp the rate in force (RateController): the
                # pin kept is that rate, or a restart pinned the old one under bounds since moved back
                pinned = min(max(pinned, new.rate.min_rate), new.rate.max_rate)
            self._persist(overrides, self.version + 1, pinned)
            self.overrides, self.version, self.current = overrides, self.version + 1, new
            self.pinned_rate = pinned
            for key in [*set_, *reset]:
                self._count(key, "applied")
            return old, new

    def not_set(self, reset: Iterable[str]) -> list[str]:
        """The settings among `reset` that are not set at run time: nothing to reset there."""
        return [key for key in dict.fromkeys(reset) if key in SETTINGS and key not in self.overrides]

    def count_refused(self, keys: Iterable[str]) -> None:
        """Count each of `keys` "invalid", as change() counts a request it refuses: for a request
        refused before change() saw it (a receiver node refusing the driver's settings)."""
        with self._lock:
            self._count_invalid(keys)

    def _count_invalid(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._count(key, "invalid")

    def _count(self, key: str, result: str) -> None:
        label = key if key in SETTINGS else "unknown"
        self.changes[(label, result)] = self.changes.get((label, result), 0) + 1

    def pin(self, rate: float | None) -> None:
        """Keep `rate` as the pinned rate (None: not pinned) in the file, before the caller applies it
        (OSError: nothing changed). No write when it is what the file says already."""
        with self._lock:
            if rate == self.pinned_rate:
                return
            self._persist(self.overrides, self.version, rate)
            self.pinned_rate = rate

    def _persist(self, overrides: Mapping[str, str], version: int, pinned_rate: float | None) -> None:
        data: dict[str, object] = {"version": version, "overrides": dict(overrides)}
        if pinned_rate is not None:
            data["pinned_rate"] = "inf" if math.isinf(pinned_rate) else pinned_rate
        replace_json(self.path, data)


def _pinned_rate(value: object, path: object) -> float | None:
    """The file's pinned rate: absent (None), a number > 0 or "inf"; SettingError naming the file."""
    if value is None:
        return None
    if value == "inf":
        return math.inf
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= MAX_RATE:
        return float(value)
    raise SettingsFileError(
        f'{path}: pinned_rate {value!r} is not a rate (records/s > 0 and at most {MAX_RATE:g}, or "inf"): '
        "correct it, or remove it to start with the rate unpinned"
    )


def _check_keys(set_: Mapping[str, str], reset: Sequence[str]) -> None:
    """UnknownSettingError for a key that names no setting; SettingError for one both set and reset
    (which was meant? the set won, silently)."""
    for key in [*set_, *reset]:
        if key not in SETTINGS:
            raise UnknownSettingError(f"no setting {key!r}; settings: {', '.join(SETTINGS)}")
    both = sorted(set(set_) & set(reset))
    if both:
        raise SettingError(f"{', '.join(both)}: both set and reset in one change; give one")


def _check_lengths(set_: Mapping[str, str]) -> None:
    """SettingError for a value longer than MAX_VALUE that its setting takes (checked after the values,
    so that one it refuses says why): kept verbatim in DATA_DIR/runtime-config.json, a 3 MB "0.1111..."
    was taken as 0.111111 and made the file 3 MB, read again at every start."""
    for key, value in set_.items():
        length = len(value.strip())
        if length > MAX_VALUE:
            raise SettingError(
                f"{key}: a value of {length:,} characters; a setting's value has at most {MAX_VALUE:,}"
            )
