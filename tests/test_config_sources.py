"""`sluice serve`'s settings from flags, SLUICE_* variables and a TOML file; `sluice config check`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_cli import SLUICE, no_spark_serve, wait_for_line

from ingest import cli
from ingest.config_sources import OTHER_ENV, keys_of, subparser


def clean_env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    return env | {"PYTHONUNBUFFERED": "1"} | more


def check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SLUICE, "config", "check", *args],
        capture_output=True,
        text=True,
        env=clean_env() if env is None else env,
        timeout=120,
        check=False,
    )


def rows(stdout: str) -> dict[str, tuple[str, str]]:
    """config check's listing: key -> (value, source)."""
    table = {}
    for line in stdout.splitlines()[1:]:
        key, value, source = re.split(r"\s{2,}", line.strip(), maxsplit=2)
        table[key] = (value, source)
    return table


def test_every_serve_flag_is_a_key_of_the_file_and_the_environment() -> None:
    parser = cli._parser()
    serve = subparser(parser, "serve")
    keys = keys_of(serve)
    flags = {o for a in serve._actions for o in a.option_strings if o.startswith("--")}
    # --no-metrics-auth: metrics-auth = false; --no-fail-on-data-loss: fail-on-data-loss = false
    flags -= {"--help", "--config", "--no-metrics-auth", "--no-fail-on-data-loss"}
    assert {key.flag for key in keys.values()} == flags
    assert {"no-spark", "no-fsync", "block-interval", "stream", "log-format", "spark-log-level"} <= set(keys)
    assert keys["block-interval"].env == "SLUICE_BLOCK_INTERVAL"
    assert keys["node-id"].env == "SLUICE_NODE_ID"  # the variable a receiver node always took
    assert len({key.env for key in keys.values()}) == len(keys)
    assert not {key.env for key in keys.values()} & OTHER_ENV
    # `config check` takes exactly serve's flags
    assert set(keys_of(subparser(parser, "config", "check"))) == set(keys)


def test_flags_beat_the_environment_which_beats_the_file(tmp_path: Path) -> None:
    config = tmp_path / "sluice.toml"
    config.write_text(
        'block-interval = 0.1\nbuffer-records = 1000\nport = 1111\nstream = ["a", "b"]\n'
        "stream-weight = {a = 3}\nmax-rate = inf\nno-spark = true\nmin-rate = 50\n"
    )
    env = clean_env(
        SLUICE_BLOCK_INTERVAL="0.3",
        SLUICE_PORT="2222",
        SLUICE_MIN_RATE="200",
        SLUICE_CONFIG=str(config),
        SLUICE_TOKEN="not a setting",
        SLUICE_CA_FILE="/x",
    )
    # a flag given with its default value still wins
    result = check("--port", "3333", "--min-rate", "100", "--data-dir", str(tmp_path / "data"), env=env)
    assert result.returncode == 0, result.stderr
    table = rows(result.stdout)
    assert table["block-interval"] == ("0.3", "env SLUICE_BLOCK_INTERVAL")
    assert table["buffer-records"] == ("1000", f"file {config}")
    assert table["port"] == ("3333", "flag")
    assert table["min-rate"] == ("100", "flag")
    assert table["stream"] == ("a,b", f"file {config}")
    assert table["stream-weight"] == ("a=3", f"file {config}")
    assert table["max-rate"] == ("inf", f"file {config}")
    assert table["no-spark"] == ("true", f"file {config}")
    assert table["trigger-interval"] == ("1", "default")
    assert table["prefetch"] == ("500", "default")  # the rule's value: half the buffer
    assert "the settings are valid" in result.stderr
    # nothing was started: no data dir, and --config on the command line beats $SLUICE_CONFIG
    assert not (tmp_path / "data").exists()
    other = tmp_path / "other.toml"
    other.write_text("no-spark = true\nbuffer-records = 7\n")
    again = check("--config", str(other), env=env)
    assert again.returncode == 0, again.stderr
    assert rows(again.stdout)["buffer-records"] == ("7", f"file {other}")


def test_settings_changed_at_run_time_override_the_start_up_ones(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    runtime = {"version": 2, "overrides": {"block-interval": "0.5"}}
    (data / "runtime-config.json").write_text(json.dumps(runtime))
    result = check("--no-spark", "--data-dir", str(data), "--block-interval", "0.1")
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout)["block-interval"] == ("0.5", f"runtime {data / 'runtime-config.json'}")
    (data / "runtime-config.json").write_text(json.dumps({"version": 3, "overrides": {"prefetch": "-1"}}))
    bad = check("--no-spark", "--data-dir", str(data))
    assert bad.returncode == 2
    assert f"{data / 'runtime-config.json'}: prefetch" in bad.stderr and "Traceback" not in bad.stderr


def test_unknown_keys_and_variables_are_errors_naming_them(tmp_path: Path) -> None:
    config = tmp_path / "sluice.toml"
    config.write_text("blok-interval = 0.2\n")
    result = check("--config", str(config))
    assert result.returncode == 2
    assert f"config file {config}: unknown key 'blok-interval'" in result.stderr
    config.write_text("[receiver]\nblock-interval = 0.2\n")
    result = check("--config", str(config))
    assert result.returncode == 2 and "unknown key 'receiver' (tables are not used" in result.stderr
    config.write_text("block-interval = \n")
    result = check("--config", str(config))
    assert result.returncode == 2 and "not valid TOML" in result.stderr
    result = check("--config", str(tmp_path / "missing.toml"))
    assert result.returncode == 2 and "missing.toml: no such file" in result.stderr
    result = check(env=clean_env(SLUICE_BLOK_INTERVAL="0.2"))
    assert result.returncode == 2 and "environment variable SLUICE_BLOK_INTERVAL names no" in result.stderr
    # the variables Sluice already used are not settings, and not errors
    known = clean_env(SLUICE_NODE_ID="4", SLUICE_TOKEN="t", SLUICE_NAMESPACE="n", SLUICE_POD_NAME="p")
    result = check("--no-spark", env=known)
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout)["node-id"] == ("4", "env SLUICE_NODE_ID")


# (key, bad value, what the message says): errors from argparse types, from the dataclasses' checks
# naming fields (block_interval, low_tide, min_rate) and from checks naming no key at all
BAD_VALUES = [
    ("block-interval", "0", "must be at least 0.01 seconds"),
    ("block-interval", "abc", "invalid float value: 'abc'"),
    ("low-tide", "600000", "600000 must be below --prefetch, 250000 by default"),
    ("prefetch", "600000", "600000 must be at most --buffer-records 500000"),
    ("min-rate", "0", "must be >= 1e-06 and finite"),
    ("max-rate", "nan", "must be a number, got NaN"),
    ("initial-rate", "-5", "rate must be > 0 records/s"),
    ("estimator", "magic", "unknown estimator 'magic'"),
    ("trigger-interval", "0", "must be > 0 seconds and finite"),
    ("trigger-interval", "1e-9", "must be at least 0.01 seconds (10 ms"),
    ("segment-bytes", "100", "must be >= 4096"),
    ("handshake-timeout", "0", "a handshake timeout is in 0.1..3600"),
    # an unset variable in a unit file: as a Path, "" is the current folder (the log kept wherever the
    # process starts); every path setting refuses it, --data-dir as this one
    ("auth-file", "", "an empty path (an unset variable?)"),
]


@pytest.mark.parametrize("source", ["flag", "env", "file"])
@pytest.mark.parametrize(("key", "value", "says"), BAD_VALUES)
def test_an_invalid_value_names_the_key_as_the_user_wrote_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    source: str,
    key: str,
    value: str,
    says: str,
) -> None:
    for name in [n for n in os.environ if n.startswith("SLUICE_")]:
        monkeypatch.delenv(name)
    argv = ["config", "check", "--no-spark", "--data-dir", str(tmp_path / "data")]
    config = tmp_path / "sluice.toml"
    if source == "flag":
        argv += [f"--{key}", value]
        spelled = f"--{key}"
    elif source == "env":
        variable = "SLUICE_" + key.upper().replace("-", "_")
        monkeypatch.setenv(variable, value)
        spelled = variable
    else:
        number = re.fullmatch(r"-?\d+(\.\d+)?", value)
        config.write_text(f"{key} = {value if number else json.dumps(value)}\n")
        argv += ["--config", str(config)]
        spelled = f"{key} (in {config})"
    try:
        code = cli.main(argv)
    except SystemExit as exited:  # argparse's own error, for a flag its type refuses
        code = exited.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert spelled in err and says in err, err
    if "-" in key:
        assert key.replace("-", "_") not in err, err  # never the field's name


# settings that are each valid but not together, and the message, {key} spelled as the user wrote it
INCONSISTENT = [
    ({"prefetch": "1000", "buffer-records": "100"}, "{prefetch} 1000 must be at most {buffer-records} 100"),
    ({"prefetch": "100", "low-tide": "200"}, "{low-tide} 200 must be below {prefetch} 100"),
    (
        {"buffer-records": "100", "low-tide": "60"},
        "{low-tide} 60 must be below --prefetch, 50 by default (half of {buffer-records} 100)",
    ),
]


@pytest.mark.parametrize("source", ["flag", "env", "file"])
@pytest.mark.parametrize(("settings", "says"), INCONSISTENT)
def test_settings_inconsistent_together_are_refused_naming_both_and_their_values(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    source: str,
    settings: dict[str, str],
    says: str,
) -> None:
    """A prefetch past the buffer was taken silently (a session never got more than the buffer's room);
    it is a usage error now, as a low tide at or past the prefetch is, whichever source gave them."""
    for name in [n for n in os.environ if n.startswith("SLUICE_")]:
        monkeypatch.delenv(name)
    argv = ["config", "check", "--no-spark", "--data-dir", str(tmp_path / "data")]
    config = tmp_path / "sluice.toml"
    spelled = {}
    for key, value in settings.items():
        if source == "flag":
            argv += [f"--{key}", value]
            spelled[key] = f"--{key}"
        elif source == "env":
            variable = "SLUICE_" + key.upper().replace("-", "_")
            monkeypatch.setenv(variable, value)
            spelled[key] = variable
        else:
            spelled[key] = f"{key} (in {config})"
    if source == "file":
        config.write_text("".join(f"{key} = {value}\n" for key, value in settings.items()))
        argv += ["--config", str(config)]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"sluice: {says.format(**spelled)}" in err, err


def test_serve_refuses_a_prefetch_past_the_buffer_from_its_file_before_it_starts(tmp_path: Path) -> None:
    config = tmp_path / "sluice.toml"
    config.write_text("buffer-records = 1000\nprefetch = 2000\n")
    data = tmp_path / "d"
    args = ["--no-spark", "--port", "0", "--metrics-port", "-1", "--data-dir", str(data)]
    served = subprocess.run(
        [*SLUICE, "serve", *args, "--config", str(config)],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
        check=False,
    )
    assert served.returncode == 2, served.stderr
    said = f"sluice: prefetch (in {config}) 2000 must be at most buffer-records (in {config}) 1000"
    assert served.stderr.startswith(said), served.stderr
    assert "starting" not in served.stderr and not data.exists()
    # the rules' values stay within any buffer: half of it, and half of that
    for buffer in ("1", "2", "3", "1000"):
        result = check("--no-spark", "--buffer-records", buffer, "--data-dir", str(data))
        assert result.returncode == 0, result.stderr
    given = check("--no-spark", "--buffer-records", "10", "--prefetch", "10", "--low-tide", "9")
    assert given.returncode == 0, given.stderr


def test_config_check_runs_serves_checks_without_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as busy:  # check binds nothing: a taken port is the server's business
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        result = check("--no-spark", "--port", port, "--data-dir", str(tmp_path / "d"))
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "d").exists()
    bad_pipeline = check("--pipeline", "no_such_module:f", "--data-dir", str(tmp_path / "d"))
    assert bad_pipeline.returncode == 2 and "no module named 'no_such_module'" in bad_pipeline.stderr
    missing = tmp_path / "auth.toml"
    no_auth = check("--no-spark", "--auth-file", str(missing))
    assert no_auth.returncode == 2 and str(missing) in no_auth.stderr, no_auth.stderr
    exposed = check("--no-spark", env=clean_env(SLUICE_HOST="0.0.0.0"))
    assert exposed.returncode == 2 and "refusing to serve gRPC in plaintext on 0.0.0.0" in exposed.stderr
    tls = check("--no-spark", env=clean_env(SLUICE_TLS_CERT="/nonexistent/cert.pem"))
    # each key as written: the one set in the environment, and the flag of the one missing
    assert tls.returncode == 2 and "TLS needs both SLUICE_TLS_CERT and --tls-key" in tls.stderr, tls.stderr
    assert not (tmp_path / "d").exists()


def test_auth_file_mistakes_are_named_by_the_files_keys(tmp_path: Path) -> None:
    """An auth file's limits were named by serve's flags at start (`max_sessions = 0` as
    --max-sessions-per-principal, `idle_timeout_seconds = 0` as --idle-timeout; one outside that flag's
    0.1 s .. 10 years was taken), and a producer's
    `streams = ""` passed: it names no stream. So did a grant that is no stream name ("../x", "Default "
    with a space): it is checked as --stream is now ("*" stays every stream)."""
    for text, message in (
        ('[principals.x]\nroles = ["reader"]\nmax_sessions = 0\n', "[principals.x]: max_sessions must be"),
        (
            '[defaults]\nidle_timeout_seconds = 0\n[principals.x]\nroles = ["reader"]\n',
            "[defaults]: idle_timeout_seconds must be 0.1 to 315,360,000 seconds (10 years), or unset",
        ),
        # the bounds of --idle-timeout: below them every session of the principal was cut as idle
        # before its first batch came ("idle for 1e-300 s"), so a producer never got a record acked
        (
            '[principals.x]\nroles = ["reader"]\nidle_timeout_seconds = 1e-300\n',
            "[principals.x]: idle_timeout_seconds must be 0.1 to 315,360,000 seconds (10 years), or unset",
        ),
        (
            '[principals.x]\nroles = ["reader"]\nidle_timeout_seconds = 0.05\n',
            "[principals.x]: idle_timeout_seconds must be 0.1 to",
        ),
        (
            '[defaults]\nidle_timeout_seconds = 1e308\n[principals.x]\nroles = ["reader"]\n',
            "[defaults]: idle_timeout_seconds must be 0.1 to",
        ),
        ('[principals.x]\nroles = ["producer"]\nstreams = ""\n', "[principals.x] streams holds an empty"),
        ('[principals.x]\nroles = ["producer"]\nstreams = [""]\n', "[principals.x] streams holds an empty"),
        # grants no stream can have: the principal could publish nowhere, without a word
        (
            '[principals.x]\nroles = ["producer"]\nstreams = ["clicks", "../x"]\n',
            "[principals.x] streams: invalid stream name '../x'",
        ),
        (
            '[principals.x]\nroles = ["producer"]\nstreams = ["Default "]\n',
            "[principals.x] streams: invalid stream name 'Default '",
        ),
    ):
        auth = tmp_path / "auth.toml"
        auth.write_text(text)
        result = check("--no-spark", "--data-dir", str(tmp_path / "d"), "--auth-file", str(auth))
        assert result.returncode == 2, (text, result.stderr)
        assert f"sluice: {auth} {message}" in result.stderr, (text, result.stderr)
        assert "--max-sessions" not in result.stderr and "--idle-timeout" not in result.stderr


def test_a_pipeline_module_in_the_current_directory_is_found(tmp_path: Path) -> None:
    """The README's `sluice serve --pipeline mymodule:build` with mymodule.py beside the user: `sluice`
    is an entry point, whose sys.path lacks the current directory (`python -m` and uvicorn add it)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "mypipe_here.py").write_text(
        "def build(df, ctx):\n    return df.writeStream.format('parquet').option('path', str(ctx.sink_dir))\n"
    )
    result = subprocess.run(
        [*SLUICE, "config", "check", "--pipeline", "mypipe_here:build", "--data-dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=work,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "mypipe_here:build" in result.stdout


def test_metrics_bind_the_chosen_address_and_a_clean_stop_has_no_traceback(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    env = clean_env(SLUICE_METRICS_HOST="127.0.0.2", SLUICE_NO_SPARK="1")
    with log.open("wb") as log_file:
        serve = subprocess.Popen(
            [*SLUICE, "serve", "--port", "0", "--metrics-port", "0", "--data-dir", str(tmp_path / "data")],
            stderr=log_file,
            env=env,
        )
    try:
        match = wait_for_line(serve, log, r"metrics on 127\.0\.0\.2:(\d+)/metrics", 60)
        port = int(match.group(1))
        body = urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=10).read().decode()
        assert "sluice_records_received_total" in body
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            code = serve.wait(timeout=60)
        finally:
            serve.kill()
    text = log.read_text()
    assert code == 0, text
    assert "Traceback" not in text and "sluice: stopped" in text, text


def test_an_empty_stream_list_is_refused_and_so_is_a_shared_health_port(tmp_path: Path) -> None:
    """An empty stream list (`stream = []`, SLUICE_STREAM=) was listed as "(none)", then (once fixed)
    silently served "default": the opposite of what it says. It is refused, naming it, by serve and
    check alike; a list whose default is empty (stream-weight) may still be given empty. A health port
    equal to the gRPC or metrics port failed only at bind time."""
    config = tmp_path / "sluice.toml"
    config.write_text("stream = []\n")
    base = ["--no-spark", "--port", "0", "--metrics-port", "-1", "--data-dir", str(tmp_path / "d")]
    empty = "an empty list: give at least one value, or leave it out for the default"
    refused_by_serve_and_check(
        [*base, "--config", str(config)], clean_env(), f"stream (in {config}): {empty}"
    )
    refused_by_serve_and_check(base, clean_env(SLUICE_STREAM=""), f"SLUICE_STREAM: {empty}")
    config.write_text("stream-weight = []\n")
    result = check(*base, "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert re.search(r"^stream +default ", result.stdout, re.MULTILINE), result.stdout
    for other in ("--port", "--metrics-port"):
        shared = check("--no-spark", other, "50999", "--health-port", "50999")
        assert shared.returncode == 2 and "are both 50999: give them two" in shared.stderr, shared.stderr


@pytest.mark.parametrize(
    ("content", "code"),
    [
        ("null", 1),
        ('{"overrides": {}}', 1),
        ('{"version": -5, "overrides": {}}', 1),
        ('{"version": 1, "overrides": {"min-rate": "1e308"}}', 2),
    ],
    ids=["null", "no-version", "negative-version", "conflicts-with-the-flags"],
)
def test_a_bad_runtime_settings_file_stops_serve_and_check_alike(
    tmp_path: Path, content: str, code: int
) -> None:
    """`null` was read as no file, a file without a version (or with -5) was taken, and a file whose
    value conflicts with a flag stopped `serve` with exit 1 (after Spark started) but `config check` with
    2. Both refuse each at once now: a file that is not a settings file with 1, as any file under the
    data dir that cannot be read (streams.json, node.json, the block log), and a value its setting
    refuses with 2, as on the command line."""
    data = tmp_path / "d"
    data.mkdir()
    (data / "runtime-config.json").write_text(content)
    flags = [
        "--no-spark",
        "--data-dir",
        str(data),
        "--max-rate",
        "1000",
        "--port",
        "0",
        "--metrics-port",
        "-1",
    ]
    checked = check(*flags)
    served = subprocess.run(
        [*SLUICE, "serve", *flags], capture_output=True, text=True, env=clean_env(), timeout=120, check=False
    )
    for result in (checked, served):
        assert result.returncode == code, result.stderr
        assert str(data / "runtime-config.json") in result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("source", ["flag", "env", "file"])
def test_a_bad_stream_policy_names_its_key_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], source: str
) -> None:
    """`stream-weight = ["a=0"]` in a config file said "stream 'a': a stream's weight must be ..."
    without naming the key or the file."""
    for name in [n for n in os.environ if n.startswith("SLUICE_")]:
        monkeypatch.delenv(name)
    argv = ["config", "check", "--no-spark", "--data-dir", str(tmp_path / "data")]
    config = tmp_path / "sluice.toml"
    if source == "flag":
        argv += ["--stream-weight", "a=0", "--stream-max-rate", "a=10"]
        spelled = "--stream-weight"
    elif source == "env":
        monkeypatch.setenv("SLUICE_STREAM_WEIGHT", "a=0")
        spelled = "SLUICE_STREAM_WEIGHT"
    else:
        config.write_text('stream-weight = ["a=0"]\n')
        argv += ["--config", str(config)]
        spelled = f"stream-weight (in {config})"
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{spelled}: stream 'a': a stream's weight must be" in err, err


def test_an_empty_budget_saved_by_an_earlier_version_still_means_none(tmp_path: Path) -> None:
    """`config set disk-budget=` saved "" (then: no budget), `block-linger=` too (then: off); an empty
    value is refused now, but a saved one must not stop the start after an upgrade."""
    data = tmp_path / "d"
    data.mkdir()
    (data / "runtime-config.json").write_text(
        '{"version": 2, "overrides": {"disk-budget": "", "memory-budget": "", "block-linger": ""}}'
    )
    checked = check("--no-spark", "--data-dir", str(data), "--disk-budget", "1GiB")
    assert checked.returncode == 0, checked.stderr
    assert rows(checked.stdout)["disk-budget"][0] == "none", checked.stdout
    assert rows(checked.stdout)["block-linger"][0] == "off", checked.stdout


def test_config_check_shows_the_pipeline_a_swap_left_in_force(tmp_path: Path) -> None:
    """config check said the flag's pipeline would run while pipeline.json's would; --reset-pipeline
    runs the flag's."""
    data = tmp_path / "d"
    data.mkdir()
    swapped = {"spec": "swapped_in:build", "number": 3, "checkpoint": "sluice-g3", "sink": "sink-g3"}
    (data / "pipeline.json").write_text(json.dumps({"current": swapped, "previous": None, "trial": False}))
    result = check("--no-spark", "--data-dir", str(data))
    assert result.returncode == 0, result.stderr
    value, source = rows(result.stdout)["pipeline"]
    assert value == "swapped_in:build"
    assert "generation 3, swapped in at run time" in source
    result = check("--no-spark", "--data-dir", str(data), "--reset-pipeline")
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout)["pipeline"][0] == "(none)"  # the flag's: the built-in sink
    # a crash mid-swap before the new one committed: the previous one runs, and check says so
    previous = {"spec": "earlier:build", "number": 2, "checkpoint": "sluice-g2", "sink": "sink-g2"}
    trial = {"current": swapped, "previous": previous, "trial": True, "trial_base": -1}
    (data / "pipeline.json").write_text(json.dumps(trial))
    result = check("--no-spark", "--data-dir", str(data))
    assert rows(result.stdout)["pipeline"][0] == "earlier:build", result.stdout
    (data / "pipeline.json").write_text("[1")
    result = check("--no-spark", "--data-dir", str(data))
    assert result.returncode == 2
    assert "pipeline.json: not a pipeline state file" in result.stderr


@pytest.mark.parametrize(
    ("name", "code", "says"),
    [
        ("pipeline.json", 2, "not a pipeline state file: JSON nested too deeply to be read"),
        ("runtime-config.json", 1, "cannot read the runtime settings: JSON nested too deeply to be read"),
    ],
)
def test_config_check_names_a_state_file_of_json_nested_too_deeply(
    tmp_path: Path, name: str, code: int, says: str
) -> None:
    """An outside tester's finding: valid JSON nested past what Python's parser takes (100,000 `[`) in
    pipeline.json or runtime-config.json ended config check (and serve) in a RecursionError traceback;
    it is named as any file that is not one is, with the exit code such a file gets."""
    data = tmp_path / "d"
    data.mkdir()
    (data / name).write_text("[" * 100_000 + "]" * 100_000)
    result = check("--no-spark", "--data-dir", str(data))
    assert result.returncode == code, result.stderr
    assert f"{data / name}: {says}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_config_check_reads_pipeline_json_as_the_manager_does(tmp_path: Path) -> None:
    """config check read pipeline.json with a copy of the manager's reading: a file naming a folder
    outside the data dir (which serve refuses, stopping with exit 1) passed the check, showing its
    pipeline as the one a start runs. Both now read it with ingest.pipeline_state (read_state,
    in_force); and a crash mid-swap away from a --reset-pipeline generation that never committed runs
    the generation the reset replaced, as the manager says."""
    data = tmp_path / "d"
    data.mkdir()
    outside = {"spec": "m:p", "number": 1, "checkpoint": "../../etc", "sink": "sink-g1"}
    (data / "pipeline.json").write_text(json.dumps({"current": outside, "previous": None, "trial": False}))
    result = check("--no-spark", "--data-dir", str(data))
    assert result.returncode == 2, result.stdout
    assert "pipeline.json: not a pipeline state file: not a folder name: '../../etc'" in result.stderr
    generations = [
        {"spec": f"m:g{n}", "number": n, "checkpoint": f"sluice-g{n}", "sink": f"sink-g{n}"} for n in range(4)
    ]
    state = {
        "current": generations[3],  # the swap's, cut short
        "previous": generations[2],  # the reset it replaced, in trial
        "trial": True,
        "trial_base": -1,
        "replaced_trial": {"previous": generations[1], "trial_base": -1},
    }
    (data / "pipeline.json").write_text(json.dumps(state))
    assert rows(check("--no-spark", "--data-dir", str(data)).stdout)["pipeline"][0] == "m:g1"
    commits = data / "checkpoints" / "sluice-g2" / "commits"  # the reset committed a batch after all
    commits.mkdir(parents=True)
    (commits / "0").write_text("v1\n{}")
    assert rows(check("--no-spark", "--data-dir", str(data)).stdout)["pipeline"][0] == "m:g2"


def refused_by_serve_and_check(args: list[str], env: dict[str, str], says: str, code: int = 2) -> None:
    """`sluice config check ARGS` and `sluice serve ARGS` both stop with exit `code` (2: bad usage; 1: a
    file under the data dir that cannot be read) and one line saying `says`."""
    for command in (["config", "check"], ["serve"]):
        argv = [*SLUICE, *command, *args]
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
        assert result.returncode == code, (command, args, result.stderr)
        assert says in result.stderr, (command, result.stderr)
        assert "Traceback" not in result.stderr


def test_streams_named_alike_but_for_case_are_a_usage_error_unless_the_data_dir_holds_both(
    tmp_path: Path,
) -> None:
    """`--stream a --stream A`: each stream has a folder in the data dir, one folder on a
    case-insensitive file system. `serve` and `config check` refuse a new stream so named (exit 2,
    naming both), from the flags, the file or beside one the data dir holds; a data dir holding both
    already (an earlier version's, on a case-sensitive file system) starts as before."""
    base = ["--no-spark", "--port", "0", "--metrics-port", "-1"]
    fresh = ["--data-dir", str(tmp_path / "fresh")]
    config = tmp_path / "sluice.toml"
    config.write_text('stream = ["x", "X"]\n')
    both_new = "stream 'a' differs from stream 'A' (also among the streams to serve) only in letter case"
    refused_by_serve_and_check([*base, *fresh, "--stream", "a", "--stream", "A"], clean_env(), both_new)
    in_file = "stream 'x' differs from stream 'X' (also among the streams to serve) only in letter case"
    refused_by_serve_and_check([*base, *fresh, "--config", str(config)], clean_env(), in_file)
    refused_by_serve_and_check([*base, *fresh], clean_env(SLUICE_STREAM="a,A"), both_new)
    assert not (tmp_path / "fresh" / "blocks" / "a").exists()
    held = tmp_path / "held"
    held.mkdir()
    (held / "streams.json").write_text('{"streams": {"a": "serving"}}')
    beside = "stream 'A' differs from stream 'a' (in this data dir already) only in letter case"
    refused_by_serve_and_check([*base, "--data-dir", str(held), "--stream", "A"], clean_env(), beside)
    (held / "streams.json").write_text('{"streams": {"a": "serving", "A": "kept"}}')
    result = check(*base, "--data-dir", str(held), "--stream", "a", "--stream", "A")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("name", "content", "says", "code"),
    [
        ("node.json", '{"node_id": ', "cannot read which node this data dir belongs to: Expecting value", 1),
        ("node.json", '{"node_id": "x"}', "node_id must be a node id or null, got 'x'", 1),
        ("node.json", "[1]", "not a node identity (a map with node_id)", 1),
        ("node.json", '{"node_id": 3}', "belongs to node 3", 2),
        ("streams.json", '{"streams": {"a": ', "cannot read the stream states: Expecting value", 1),
        ("streams.json", '{"streams": 5}', "not a stream states file", 1),
        ("streams.json", '{"streams": {"a": 5}}', "not a stream states file", 1),
    ],
    ids=[
        "node-truncated",
        "node-id-a-string",
        "node-a-list",
        "node-another-nodes",
        "streams-truncated",
        "streams-not-a-map",
        "streams-state-a-number",
    ],
)
def test_config_check_reads_node_json_and_streams_json_as_serves_start_does(
    tmp_path: Path, name: str, content: str, says: str, code: int
) -> None:
    """node.json damaged (or naming another node) stopped `serve` with exit 1 (2), naming the file, yet
    passed `config check`, which never read it. Both read it (receivers.node_identity.check_data_dir,
    which claim_data_dir builds on) and streams.json (ingest.streams.StreamRegistry) now, and stop alike;
    `config check` writes neither, and a sound data dir passes."""
    data = tmp_path / "d"
    data.mkdir()
    (data / name).write_text(content)
    args = ["--no-spark", "--data-dir", str(data), "--port", "0", "--metrics-port", "-1"]
    named = f"{data / name}: {says}" if code == 1 else f"{says} ({data / name}, written at its first start)"
    refused_by_serve_and_check(args, clean_env(), named, code)
    assert (data / name).read_text() == content


def test_config_check_passes_a_sound_data_dir_and_writes_no_node_json(tmp_path: Path) -> None:
    """The other side of the test above: a data dir a single server wrote passes, and so does an empty
    one, which `config check` leaves without the node.json a start writes; a receiver node's check
    refuses a single server's data dir as its start does (exit 2)."""
    data = tmp_path / "d"
    data.mkdir()
    args = ["--no-spark", "--data-dir", str(data)]
    result = check(*args)
    assert result.returncode == 0, result.stderr
    assert not (data / "node.json").exists()
    (data / "node.json").write_text('{"node_id": null, "nodes": null}')
    (data / "streams.json").write_text('{"streams": {"a": "serving"}}')
    result = check(*args)
    assert result.returncode == 0, result.stderr
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"0 127.0.0.1:{port}\n")
    node = ["--role", "receiver", "--nodes", str(nodes), "--node-id", "0", "--port", str(port)]
    refused_by_serve_and_check(
        [*node, "--data-dir", str(data), "--metrics-port", "-1"], clean_env(), "belongs to a single server"
    )


def test_a_receiver_node_refuses_the_querys_settings(tmp_path: Path) -> None:
    """`serve --role receiver --pipeline X` ran without X and said nothing: the driver runs the query."""
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("0 127.0.0.1:51101\n")
    node = ["--role", "receiver", "--nodes", str(nodes), "--node-id", "0", "--port", "51101"]
    node += ["--data-dir", str(tmp_path / "d")]
    cases = [
        (["--pipeline", "m:f"], clean_env(), "--pipeline"),
        (["--master", "local[2]", "--reset-pipeline"], clean_env(), "--master, --reset-pipeline"),
        ([], clean_env(SLUICE_PIPELINE="m:f"), "SLUICE_PIPELINE"),
    ]
    for flags, env, named in cases:
        refused_by_serve_and_check(
            [*node, *flags], env, f"--role receiver does not use {named}: the cluster's driver runs"
        )
    result = check(*node, "--block-interval", "0.5")  # what a node takes passes
    assert result.returncode == 0, result.stderr


def test_a_receiver_node_refuses_the_drivers_rate_settings_at_its_start(tmp_path: Path) -> None:
    """`serve --role receiver --max-rate 1000` started, and the node's bounds clamped the share the
    driver pins it: one node silently capped the whole cluster (so did --min-rate, --estimator,
    --estimator-params, --trigger-interval, which the driver runs by). `serve` and `config check` now
    stop with exit 2 before anything starts, naming each as given (flag, environment, config file) and
    the driver's command; a node given none of them starts, and a single server still takes them."""
    from support import free_ports
    from test_cli import wait_for_line

    (port,) = free_ports(1)
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"0 127.0.0.1:{port}\n")
    data = tmp_path / "d"
    node = ["--role", "receiver", "--nodes", str(nodes), "--node-id", "0", "--port", str(port)]
    node += ["--metrics-port", "-1", "--data-dir", str(data)]
    config = tmp_path / "sluice.toml"
    config.write_text('min-rate = 50\nestimator-params = "horizon=3"\n')
    driver = "`sluice serve --role driver"
    cases = [
        (
            ["--max-rate", "1000", "--estimator", "spark-pid"],
            clean_env(),
            [
                "does not take the flag --max-rate, the flag --estimator: ",
                "which a node's own bounds would clamp",
                f"{driver} --max-rate 1000 --estimator spark-pid ...`",
                "`sluice rate bounds MIN 1000 --target DRIVER_HOST:PORT`",
                "`sluice rate estimator spark-pid --target DRIVER_HOST:PORT`",
                "on this node, drop --max-rate, --estimator from the node's command line; and give them",
            ],
        ),
        (
            ["--min-rate", "10", "--estimator-params", "horizon=3", "--trigger-interval", "2"],
            clean_env(),
            [
                "the flag --min-rate, the flag --estimator-params, the flag --trigger-interval: ",
                f"{driver} --min-rate 10 --estimator-params horizon=3 --trigger-interval 2 ...`",
            ],
        ),
        (
            [],
            clean_env(SLUICE_MAX_RATE="1000"),
            [
                "does not take SLUICE_MAX_RATE in the environment: ",
                f"{driver} --max-rate 1000 ...` (or the same in its environment or config file)",
                # an environment shared by the driver and its nodes: what to do on the node
                "on this node, unset SLUICE_MAX_RATE in the node's environment (an environment shared "
                "with the driver: set it for the driver alone)",
            ],
        ),
        (
            ["--trigger-interval", "2"],
            clean_env(SLUICE_ESTIMATOR="spark-pid", SLUICE_MIN_RATE="10"),
            [
                "SLUICE_MIN_RATE in the environment, SLUICE_ESTIMATOR in the environment, the flag "
                "--trigger-interval: ",
                "drop --trigger-interval from the node's command line; unset SLUICE_MIN_RATE, "
                "SLUICE_ESTIMATOR in the node's environment (an environment shared with the driver: set "
                "them for the driver alone); and give them to the driver",
            ],
        ),
        (
            # one setting given in three places: each named (the next start met the one left)
            ["--config", str(config), "--min-rate", "20"],
            clean_env(SLUICE_MIN_RATE="30"),
            [
                "does not take the flag --min-rate over SLUICE_MIN_RATE in the environment over "
                f"min-rate in the config file {config}, estimator-params in the config file {config}: ",
                "drop --min-rate from the node's command line; unset SLUICE_MIN_RATE in the node's "
                f"environment (an environment shared with the driver: set it for the driver alone); "
                f"take min-rate, estimator-params out of the config file {config}",
                "`sluice rate bounds 20 MAX --target DRIVER_HOST:PORT`",
            ],
        ),
        (
            ["--config", str(config)],
            clean_env(),
            [
                f"min-rate in the config file {config}, estimator-params in the config file {config}: ",
                "`sluice rate bounds 50 MAX --target DRIVER_HOST:PORT`",
                f"take min-rate, estimator-params out of the config file {config} (a file shared with "
                "the driver: give the nodes one without them)",
            ],
        ),
    ]
    for flags, env, says in cases:
        for command in (["config", "check"], ["serve"]):
            argv = [*SLUICE, *command, *node, *flags]
            result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
            assert result.returncode == 2, (command, flags, result.stderr)
            assert all(said in result.stderr for said in says), (command, says, result.stderr)
            assert "Traceback" not in result.stderr
    assert not data.exists()  # refused before anything started
    result = check(*node)
    assert result.returncode == 0, result.stderr
    # a single server still takes every one of them, from each source
    single = ["--no-spark", "--data-dir", str(tmp_path / "single")]
    rates = ["--max-rate", "1000", "--estimator", "spark-pid", "--estimator-params", "proportional=0.5"]
    result = check(*single, *rates, "--trigger-interval", "2", "--config", str(config))
    assert result.returncode == 0, result.stderr
    shown = rows(result.stdout)
    assert shown["max-rate"] == ("1000", "flag") and shown["min-rate"][0] == "50", result.stdout
    result = check(*single, env=clean_env(SLUICE_MAX_RATE="1000", SLUICE_ESTIMATOR="model"))
    assert result.returncode == 0, result.stderr
    # a node given none of them starts and serves
    log = tmp_path / "node.log"
    with log.open("wb") as log_file:
        serve = subprocess.Popen([*SLUICE, "serve", *node], stderr=log_file, env=clean_env())
    try:
        wait_for_line(serve, log, rf"on 127\.0\.0\.1:{port}", 60)
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0, log.read_text()


def test_a_driver_refuses_the_settings_it_would_run_without(tmp_path: Path) -> None:
    """`serve --role driver` and `config check --role driver` took --replication (and every other
    setting of a receiver node) and ran without it, without a word: a cluster's driver then looked
    configured for what only its nodes do. Both now refuse them, as serve's other usage errors."""
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("0 127.0.0.1:51101\n")
    driver = ["--role", "driver", "--nodes", str(nodes), "--data-dir", str(tmp_path / "d")]
    config = tmp_path / "sluice.toml"
    config.write_text("buffer-records = 100\n")
    cases = [
        (["--replication", "2"], clean_env(), "--replication"),
        (["--no-fsync", "--min-insync", "2"], clean_env(), "--min-insync, --fsync/--no-fsync"),
        ([], clean_env(SLUICE_DISK_BUDGET="1GiB"), "SLUICE_DISK_BUDGET"),
        (["--config", str(config)], clean_env(), f"buffer-records (in {config})"),
    ]
    for flags, env, named in cases:
        refused_by_serve_and_check(
            [*driver, *flags], env, f"--role driver does not use {named}: a driver would run without"
        )
    # what a driver takes passes
    taken = ["--estimator", "fixed", "--min-rate", "10", "--trigger-interval", "2", "--health-port", "0"]
    result = check(*driver, *taken)
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout)["trigger-interval"] == ("2", "flag"), result.stdout
    assert set(cli._serve_keys()) >= cli.DRIVER_KEYS  # no key misspelled


def test_a_driver_takes_estimator_params_as_a_single_server_does(tmp_path: Path) -> None:
    """`serve --role driver --estimator-params ...` was refused as a setting the driver would run
    without: an operator could not tune the cluster's estimator (the PID's gains), which a single server
    takes. The driver takes it from a flag, the environment or the file, checks it as a single server
    does (by the estimator: exit 2 naming the flag), runs its estimator with it, and keeps parameters
    in its runtime-config.json beside the rate's bounds and estimator (a kept one no longer stops it)."""
    from ingest.cluster_driver import ClusterDriver

    nodes = tmp_path / "nodes.txt"
    nodes.write_text("0 127.0.0.1:51101\n")
    data = tmp_path / "d"
    driver = ["--role", "driver", "--nodes", str(nodes), "--data-dir", str(data)]
    pid = ["--estimator", "spark-pid", "--estimator-params", "proportional=0.5,integral=0.1"]
    result = check(*driver, *pid)
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout)["estimator-params"] == ("proportional=0.5,integral=0.1", "flag"), result.stdout
    result = check(*driver, env=clean_env(SLUICE_ESTIMATOR_PARAMS="horizon=2"))
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout)["estimator-params"] == ("horizon=2", "env SLUICE_ESTIMATOR_PARAMS")
    for params, says in (
        ("kp=1", "--estimator-params: estimator 'spark-pid' has no parameter 'kp'"),
        ("proportional=-1", "--estimator-params: proportional gain must be a finite number >= 0"),
    ):
        refused_by_serve_and_check(
            [*driver, "--estimator", "spark-pid", "--estimator-params", params], clean_env(), says
        )

    # the driver runs its estimator with them, and a restart with a kept change of the rate's settings
    # (ClusterDriver's gRPC parts want an event loop: one of their own, whatever tests ran before)
    async def drivers() -> None:
        args = cli._parser().parse_args(["serve", *driver, *pid])
        args.origins = {}
        config = cli._driver_config(args)
        first = ClusterDriver(config)
        first.blocks.close()
        estimator = first.rate.estimator
        assert (estimator.name, estimator.proportional, estimator.integral) == ("spark-pid", 0.5, 0.1)  # type: ignore[attr-defined]
        data.mkdir(exist_ok=True)
        (data / "runtime-config.json").write_text(
            '{"version": 2, "overrides": {"min-rate": "200", "estimator-params": "proportional=0.25"}}'
        )
        restarted = ClusterDriver(config)
        restarted.blocks.close()
        driver_rate = restarted.rate
        assert driver_rate.bounds.min_rate == 200
        assert driver_rate.estimator.proportional == 0.25  # type: ignore[attr-defined]
        result = check(*driver, *pid)
        assert result.returncode == 0, result.stderr
        runtime = f"runtime {data / 'runtime-config.json'}"
        assert rows(result.stdout)["estimator-params"] == ("proportional=0.25", runtime), result.stdout
        # `sluice rate estimator model` (SetEstimator's change: the old one's parameters go) is not refused
        # for --estimator-params, which are spark-pid's; back to spark-pid, they are in force again
        restarted.change_settings({"estimator": "model"}, ["estimator-params"])
        assert driver_rate.estimator.name == "model"
        again = ClusterDriver(config)
        again.blocks.close()
        assert again.rate.estimator.name == "model"
        again.change_settings({"estimator": "spark-pid"}, ["estimator-params"])
        assert again.rate.estimator.proportional == 0.5  # type: ignore[attr-defined]

    asyncio.run(drivers())


def test_a_driver_refuses_a_trigger_interval_a_single_server_refuses(tmp_path: Path) -> None:
    """A driver's query settings are checked as a single server's (its DriverConfig checked none of
    them): 1e-9, below the 10 ms bound, stops `serve` and `config check` with exit 2."""
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("0 127.0.0.1:51101\n")
    driver = ["--role", "driver", "--nodes", str(nodes), "--data-dir", str(tmp_path / "d")]
    refused_by_serve_and_check(
        [*driver, "--trigger-interval", "1e-9"], clean_env(), "must be at least 0.01 seconds (10 ms"
    )
    assert check(*driver, "--trigger-interval", "0.01").returncode == 0


def test_a_driver_refuses_plaintext_off_loopback_as_a_node_does(tmp_path: Path) -> None:
    """A receiver node refuses to serve gRPC or /metrics in plaintext on an address that is not a
    loopback one, unless --insecure; the driver served its rate server (RateControl, and Admin's
    pipeline swaps) and /metrics in plaintext on 0.0.0.0 without a word, and refused --insecure as a
    node's setting. Now it takes the node's rule, --insecure included."""
    from pki import CertificateAuthority

    nodes = tmp_path / "nodes.txt"
    nodes.write_text("0 127.0.0.1:51101\n")
    driver = ["--role", "driver", "--nodes", str(nodes), "--data-dir", str(tmp_path / "d")]
    metrics = ["--metrics-host", "0.0.0.0", "--metrics-port", "0"]
    cases = [
        (["--host", "0.0.0.0"], clean_env(), "gRPC"),
        ([], clean_env(SLUICE_HOST="10.1.2.3"), "gRPC"),
        (metrics, clean_env(), "metrics"),
    ]
    for flags, env, what in cases:
        host = "10.1.2.3" if "SLUICE_HOST" in env else "0.0.0.0"
        refused_by_serve_and_check(
            [*driver, *flags],
            env,
            f"refusing to serve {what} in plaintext on {host}, which is not a loopback",
        )
    # as for a node: --insecure accepts it, and TLS needs no --insecure
    result = check(*driver, "--host", "0.0.0.0", *metrics, "--insecure")
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout)["insecure"] == ("true", "flag"), result.stdout
    cert = CertificateAuthority(tmp_path / "pki").issue("localhost", server=True, file_stem="server")
    tls = ["--tls-cert", str(cert.cert_file), "--tls-key", str(cert.key_file)]
    result = check(*driver, "--host", "0.0.0.0", *tls, *metrics, "--metrics-tls")
    assert result.returncode == 0, result.stderr
    result = check(*driver, "--host", "0.0.0.0", *tls, *metrics)  # TLS on gRPC only: /metrics is plaintext
    assert result.returncode == 2, result.stderr
    assert "refusing to serve metrics in plaintext on 0.0.0.0" in result.stderr, result.stderr


def test_config_check_of_a_driver_reads_the_files_the_driver_reads(tmp_path: Path) -> None:
    """`config check --role driver` read none of the driver's TLS files, auth file or peer token file:
    it said "valid" where `serve --role driver` then stopped on one. It reads each as the driver does
    at its start now (as a single server's check reads its own), and both stop on a bad one."""
    from pki import CertificateAuthority
    from test_metrics_security import auth_file

    nodes = tmp_path / "nodes.txt"
    nodes.write_text("0 127.0.0.1:51101\n")
    driver = ["--role", "driver", "--nodes", str(nodes), "--data-dir", str(tmp_path / "d")]
    ca = CertificateAuthority(tmp_path / "pki")
    cert = ca.issue("localhost", server=True, file_stem="server")
    other = ca.issue("localhost", server=True, file_stem="other")
    tls = ["--tls-cert", str(cert.cert_file), "--tls-key", str(cert.key_file)]
    good_auth = auth_file(tmp_path / "auth.toml")
    token = tmp_path / "peer.token"
    token.write_text("a-peer-token\n")
    bad_auth = tmp_path / "bad.toml"
    bad_auth.write_text("not toml\n")
    cases = [
        (["--auth-file", str(bad_auth)], f"auth file {bad_auth} is not valid TOML"),
        (["--auth-file", str(tmp_path / "none.toml")], "cannot read the auth file (--auth-file)"),
        (["--peer-token-file", str(tmp_path / "none.token")], "cannot read token file"),
        (
            ["--tls-cert", str(cert.cert_file), "--tls-key", str(other.key_file)],
            "is not the key of the certificate",
        ),
        ([*tls, "--client-ca", str(bad_auth)], "(--client-ca)"),
    ]
    for flags, says in cases:
        refused_by_serve_and_check([*driver, *flags], clean_env(), says)
    good = [
        *tls,
        "--client-ca",
        str(ca.cert_file),
        "--auth-file",
        str(good_auth),
        "--peer-token-file",
        str(token),
    ]
    result = check(*driver, *good)
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout)["auth-file"] == (str(good_auth), "flag"), result.stdout


def test_config_check_of_a_driver_reads_its_runtime_config_as_its_start_does(tmp_path: Path) -> None:
    """The driver keeps a pinned rate in DATA_DIR/runtime-config.json and reads it at its start (a bad
    one stops `serve --role driver`, exit 1: a file under the data dir that cannot be read); `config
    check --role driver` did not read it and said "valid". It reads it as the start does now, as a single
    server's check reads its own."""
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("0 127.0.0.1:51101\n")
    data = tmp_path / "d"
    data.mkdir()
    driver = ["--role", "driver", "--nodes", str(nodes), "--data-dir", str(data)]
    runtime = data / "runtime-config.json"
    for text, says in (
        ('{"version": 0, "overrides": {}, "pinned_rate": -5}', "pinned_rate -5 is not a rate"),
        ('{"version": 0, "overrides": {}, "pinned_rate": "fast"}', "pinned_rate 'fast' is not a rate"),
        ("{not json", str(runtime)),
    ):
        runtime.write_text(text)
        refused_by_serve_and_check(driver, clean_env(), says, code=1)
    runtime.write_text('{"version": 0, "overrides": {}, "pinned_rate": 5000}')
    result = check(*driver)
    assert result.returncode == 0, result.stderr
    # the rate's bounds and estimator `sluice rate` kept there (the driver starts with them), and no
    # other setting: a receiver node's, which the driver would run without
    runtime.write_text('{"version": 2, "overrides": {"max-rate": "8000.0", "estimator": "fixed"}}')
    result = check(*driver)
    assert result.returncode == 0, result.stderr
    shown = rows(result.stdout)
    assert shown["max-rate"] == ("8000.0", f"runtime {runtime}"), result.stdout
    assert shown["estimator"] == ("fixed", f"runtime {runtime}"), result.stdout
    runtime.write_text('{"version": 1, "overrides": {"block-interval": "0.5"}}')
    refused_by_serve_and_check(driver, clean_env(), "block-interval is not a driver's setting")


def test_a_switch_turned_off_in_the_file_or_the_environment_shows_that_source(tmp_path: Path) -> None:
    """An outside tester: `no-spark = false` in the file (or SLUICE_NO_SPARK=false) showed as "default"
    in `config check`: a switch's false was dropped as if not given, so SLUICE_NO_SPARK=false did not
    override the file's `no-spark = true` either. It is a value of its source now, as other keys'."""
    config = tmp_path / "c.toml"
    config.write_text("no-spark = false\ninsecure = false\nreset-pipeline = false\n")
    on = tmp_path / "on.toml"
    on.write_text("no-spark = true\n")
    env = {"SLUICE_NO_SPARK": "false"}
    for argv, environ, value, source in (
        (["--config", str(config)], {}, False, f"file {config}"),
        ([], env, False, "env SLUICE_NO_SPARK"),
        (["--config", str(on)], env, False, "env SLUICE_NO_SPARK"),  # the environment wins
        (["--config", str(on)], {}, True, f"file {on}"),
        (["--no-spark", "--config", str(config)], {}, True, "flag"),
        ([], {}, False, "default"),
    ):
        full = ["serve", *argv]
        args = cli._parser().parse_args(full)
        cli._layer_settings(args, full, environ)
        assert (args.no_spark, args.origins["no_spark"].described) == (value, source), (argv, environ)
    full = ["serve", "--config", str(config)]
    args = cli._parser().parse_args(full)
    cli._layer_settings(args, full, {})
    for dest in ("insecure", "reset_pipeline"):
        assert (getattr(args, dest), args.origins[dest].described) == (False, f"file {config}"), dest
    result = check("--config", str(config), "--data-dir", str(tmp_path / "d"))
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout)["no-spark"] == ("false", f"file {config}"), result.stdout


def test_a_driver_takes_fail_on_data_loss_from_a_flag_the_environment_or_the_file(tmp_path: Path) -> None:
    """The cluster source's failOnDataLoss had no driver setting: `serve --role driver` always stopped on
    a node's lost log. `--fail-on-data-loss` / `--no-fail-on-data-loss` (default true), from a flag, the
    environment or the file as every setting, goes to the driver's query as the source option, is shown
    by `config check`, and is refused by a receiver node, which runs no query. A single server takes it
    for its own query."""
    from ingest.spark.source import OPTION_FAIL_ON_DATA_LOSS

    nodes = tmp_path / "nodes.txt"
    nodes.write_text("0 127.0.0.1:51101\n")
    driver = ["--role", "driver", "--nodes", str(nodes), "--data-dir", str(tmp_path / "d")]
    config = tmp_path / "sluice.toml"
    config.write_text("fail-on-data-loss = false\n")
    cases = [
        ([], clean_env(), ("true", "default")),
        (["--no-fail-on-data-loss"], clean_env(), ("false", "flag")),
        (["--fail-on-data-loss"], clean_env(SLUICE_FAIL_ON_DATA_LOSS="false"), ("true", "flag")),
        ([], clean_env(SLUICE_FAIL_ON_DATA_LOSS="false"), ("false", "env SLUICE_FAIL_ON_DATA_LOSS")),
        (["--config", str(config)], clean_env(), ("false", f"file {config}")),
        (
            ["--config", str(config)],
            clean_env(SLUICE_FAIL_ON_DATA_LOSS="yes"),
            ("true", "env SLUICE_FAIL_ON_DATA_LOSS"),
        ),
    ]
    for flags, env, shown in cases:
        result = check(*driver, *flags, env=env)
        assert result.returncode == 0, (flags, result.stderr)
        assert rows(result.stdout)["fail-on-data-loss"] == shown, (flags, result.stdout)
    # what the driver's query is given (and the queries a pipeline swap starts: the same SparkDriver's)
    for flags, environ, option in (
        ([], {}, "true"),
        (["--no-fail-on-data-loss"], {}, "false"),
        ([], {"SLUICE_FAIL_ON_DATA_LOSS": "0"}, "false"),
        (["--config", str(config)], {}, "false"),
    ):
        argv = ["serve", *driver, *flags]
        args = cli._parser().parse_args(argv)
        cli._layer_settings(args, argv, environ)
        made = cli._driver_config(args)
        assert made.source_options()[OPTION_FAIL_ON_DATA_LOSS] == option, (flags, environ)
    refused_by_serve_and_check(
        [*driver],
        clean_env(SLUICE_FAIL_ON_DATA_LOSS="maybe"),
        "SLUICE_FAIL_ON_DATA_LOSS: expected true or false",
    )
    node = ["--role", "receiver", "--nodes", str(nodes), "--node-id", "0", "--port", "51101"]
    node += ["--data-dir", str(tmp_path / "n")]
    refused_by_serve_and_check(
        [*node, "--no-fail-on-data-loss"],
        clean_env(),
        "--role receiver does not use --fail-on-data-loss: the cluster's driver runs",
    )
    # a single server's own query takes it too (its log lost under a checkpoint kept elsewhere)
    single = ["--data-dir", str(tmp_path / "s")]
    result = check(*single, "--no-fail-on-data-loss")
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout)["fail-on-data-loss"] == ("false", "flag"), result.stdout
    argv = ["serve", *single, "--config", str(config)]
    args = cli._parser().parse_args(argv)
    cli._layer_settings(args, argv, {})
    assert cli._serve_config(args).fail_on_data_loss is False


def test_a_path_no_system_call_takes_is_one_line_naming_its_setting(tmp_path: Path) -> None:
    """A --data-dir with a name over 255 bytes ended `config check` and `serve` in an OSError "File name
    too long" traceback, exit 1; `data-dir = "\\u0000x"` in a config file was blamed on pipeline.json.
    Each is now one line naming the setting as written, exit 2, as other bad paths are."""
    long_name = "a" * 300
    base = ["--no-spark", "--port", "0", "--metrics-port", "-1"]
    too_long = (
        "a name of 300 bytes in the path (aaaaaaaaaaaaaaaaaaaa...): over the 255 bytes a file name may have"
    )
    config = tmp_path / "paths.toml"
    config.write_text(f'data-dir = "{tmp_path}/{long_name}"\n')
    for args, env, named in (
        (["--data-dir", long_name], clean_env(), "argument --data-dir"),
        ([], clean_env(SLUICE_DATA_DIR=f"x/{long_name}/y"), "SLUICE_DATA_DIR"),
        (["--config", str(config)], clean_env(), f"data-dir (in {config})"),
        (["--data-dir", str(tmp_path), "--tls-key", "k", "--tls-cert", long_name], clean_env(), "--tls-cert"),
    ):
        refused_by_serve_and_check([*base, *args], env, f"{named}: {too_long}")
    config.write_text('data-dir = "\\u0000x"\nauth-file = "a"\n')
    nul = f"data-dir (in {config}): a path cannot hold a NUL character, got '\\x00x'"
    refused_by_serve_and_check([*base, "--config", str(config)], clean_env(), nul)
    # every name short enough, the whole too long for the files in it: the runtime settings file, the first
    deep = "/".join(["b" * 255] * 16)
    refused_by_serve_and_check(
        [*base, "--data-dir", deep],
        clean_env(),
        "runtime-config.json: cannot read the runtime settings: File name too long",
    )


ARABIC_HALF = "\u0660.\u0665"  # Arabic-Indic digits: float() reads 0.5
FULL_WIDTH_12 = "\uff11\uff12"  # full-width digits: int() reads 12


def sluice_text(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SLUICE, *args], capture_output=True, text=True, timeout=60, check=False)


def test_numbers_are_ascii_digits_only(tmp_path: Path) -> None:
    """Python's float() and int() take the digits of every script: `config set block-interval=<Arabic-Indic
    0.5>` and the same flag became 0.5. Flags, variables, the config file and `config set` now refuse
    them with the message any other invalid number gets."""
    base = ["--no-spark", "--data-dir", str(tmp_path / "d"), "--port", "0", "--metrics-port", "-1"]
    for args, env, says in (
        (
            ["--block-interval", ARABIC_HALF],
            {},
            f"argument --block-interval: invalid float value: '{ARABIC_HALF}'",
        ),
        (["--port", FULL_WIDTH_12], {}, f"argument --port: invalid int value: '{FULL_WIDTH_12}'"),
        (["--buffer-bytes", f"{FULL_WIDTH_12}MiB"], {}, f"invalid size '{FULL_WIDTH_12}MiB'"),
        (["--fsync", f"interval:{FULL_WIDTH_12}"], {}, f"invalid fsync policy 'interval:{FULL_WIDTH_12}'"),
        (["--estimator-params", f"horizon={FULL_WIDTH_12}"], {}, f"'{FULL_WIDTH_12}' is not a number"),
        (["--handshake-timeout", FULL_WIDTH_12], {}, f"'{FULL_WIDTH_12}' is not a number"),
        (["--stream-weight", f"default={FULL_WIDTH_12}"], {}, "expected STREAM=NUMBER"),
        (
            [],
            {"SLUICE_TRIGGER_INTERVAL": ARABIC_HALF},
            f"SLUICE_TRIGGER_INTERVAL: invalid float value: '{ARABIC_HALF}'",
        ),
        ([], {"SLUICE_NODE_ID": FULL_WIDTH_12}, f"SLUICE_NODE_ID: '{FULL_WIDTH_12}' is not an integer"),
    ):
        result = check(*base, *args, env=clean_env(**env))
        assert result.returncode == 2, (args, env, result.stderr)
        assert says in result.stderr and "Traceback" not in result.stderr, (args, env, result.stderr)
    config = tmp_path / "sluice.toml"
    config.write_text(f'min-rate = "{FULL_WIDTH_12}"\n')
    refused_by_serve_and_check(
        [*base, "--config", str(config)],
        clean_env(),
        f"min-rate (in {config}): invalid float value: '{FULL_WIDTH_12}'",
    )
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"0 127.0.0.1:{FULL_WIDTH_12}\n")
    result = check(*base[:3], "--role", "receiver", "--node-id", "0", "--nodes", str(nodes))
    assert result.returncode == 2 and f"{nodes}, line 1: expected 'ID HOST:PORT'" in result.stderr, (
        result.stderr
    )
    rate = sluice_text("rate", "set", FULL_WIDTH_12, "--target", "127.0.0.1:1")
    assert rate.returncode == 2 and f"invalid float value: '{FULL_WIDTH_12}'" in rate.stderr, rate.stderr
    with no_spark_serve(tmp_path, tmp_path / "served") as target:
        for change, says in (
            (f"block-interval={ARABIC_HALF}", f"'{ARABIC_HALF}' is not a number"),
            (f"prefetch={FULL_WIDTH_12}", f"'{FULL_WIDTH_12}' is not an integer"),
            (f"buffer-bytes={FULL_WIDTH_12}MiB", f"invalid size '{FULL_WIDTH_12}MiB'"),
        ):
            changed = sluice_text("config", "set", change, "--target", target)
            assert changed.returncode == 1 and "INVALID_ARGUMENT" in changed.stderr, changed.stderr
            assert says in changed.stderr, changed.stderr
        shown = sluice_text("config", "get", "block-interval", "--target", target)
        assert re.search(r"^block-interval\s+0\.2\s+default$", shown.stdout, re.M), shown.stdout


def test_a_number_too_large_for_a_float_is_refused_not_read_as_no_limit(tmp_path: Path) -> None:
    """float("1e400") is inf, and an inf rate or bound means no limit at all: `rate set 1e400`, the
    flag, the variable, the config file (TOML reads 1e400 as inf too) and `config set` took it silently.
    Now each says it is out of range; inf spelled as inf still means no limit."""
    says = "1e400 is out of range (the largest number is 1.8e+308)"
    base = ["--no-spark", "--data-dir", str(tmp_path / "d"), "--port", "0", "--metrics-port", "-1"]
    for args, env in (
        (["--max-rate", "1e400"], {}),
        (["--estimator-params", "horizon=1e400"], {}),
        (["--stream-max-rate", "default=1e400"], {}),
        ([], {"SLUICE_MIN_RATE": "1e400"}),
    ):
        result = check(*base, *args, env=clean_env(**env))
        assert result.returncode == 2, (args, env, result.stderr)
        assert says in result.stderr and "Traceback" not in result.stderr, (args, env, result.stderr)
    config = tmp_path / "sluice.toml"
    config.write_text("max-rate = 1e400\n")
    refused_by_serve_and_check([*base, "--config", str(config)], clean_env(), f"config file {config}: {says}")
    config.write_text("max-rate = inf\n")
    assert check(*base, "--config", str(config)).returncode == 0
    rate = sluice_text("rate", "set", "-1e400", "--target", "127.0.0.1:1")
    assert rate.returncode == 2 and "argument RATE: -1e400 is out of range" in rate.stderr, rate.stderr
    with no_spark_serve(tmp_path, tmp_path / "served") as target:
        changed = sluice_text("config", "set", "max-rate=1e400", "--target", target)
        assert changed.returncode == 1 and "INVALID_ARGUMENT" in changed.stderr, changed.stderr
        assert says in changed.stderr, changed.stderr
        assert sluice_text("config", "set", "max-rate=inf", "--target", target).returncode == 0


def test_python_digit_separators_are_no_number_but_tomls_are(tmp_path: Path) -> None:
    """float() and int() take Python's digit separators: `--block-interval 1_0` ran with 10 s, and
    `config set trigger-interval=1_0` was taken as 10 and kept as "1_0" (a size refused "1_0" already).
    A flag, a variable and `rate set` refuse it now; a TOML number's own separators (1_000.5, TOML's
    syntax) are still TOML's."""
    base = ["--no-spark", "--data-dir", str(tmp_path / "d"), "--port", "0", "--metrics-port", "-1"]
    for args, env, says in (
        (["--block-interval", "1_0"], {}, "argument --block-interval: invalid float value: '1_0'"),
        (["--buffer-records", "1_000"], {}, "argument --buffer-records: invalid int value: '1_000'"),
        ([], {"SLUICE_TRIGGER_INTERVAL": "1_0"}, "'1_0'"),
    ):
        result = check(*base, *args, env=clean_env(**env))
        assert result.returncode == 2, (args, env, result.stdout, result.stderr)
        assert says in result.stderr and "Traceback" not in result.stderr, (args, env, result.stderr)
    rate = sluice_text("rate", "set", "1_0", "--target", "127.0.0.1:1")
    assert rate.returncode == 2 and "argument RATE: invalid float value: '1_0'" in rate.stderr, rate.stderr
    config = tmp_path / "sluice.toml"
    config.write_text("block-interval = 1_0.5\nbuffer-records = 1_000\n")
    result = check(*base, "--config", str(config))
    assert result.returncode == 0, result.stderr
    table = rows(result.stdout)
    assert table["block-interval"][0] == "10.5" and table["buffer-records"][0] == "1000", table


def test_config_check_pads_no_row_to_one_very_long_value(tmp_path: Path) -> None:
    """A value of 100,000 characters kept in runtime-config.json (a 3 MB one made 174 MB of output):
    `config check` padded every row's value to the longest one. It pads to the widest value up to
    CHECK_VALUE_WIDTH; the long one is shown whole, once."""
    data = tmp_path / "d"
    data.mkdir()
    value = "0." + "1" * 100_000
    (data / "runtime-config.json").write_text(
        json.dumps({"version": 1, "overrides": {"block-interval": value}})
    )
    result = check("--no-spark", "--data-dir", str(data), "--port", "0", "--metrics-port", "-1")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout) < 200_000, len(result.stdout)
    table = rows(result.stdout)
    assert table["block-interval"][0] == value and table["log-level"] == ("info", "default"), table[
        "log-level"
    ]
    header = result.stdout.splitlines()[0]
    assert header.index("source") == header.index("value") + cli.CHECK_VALUE_WIDTH + 2, header


def test_an_empty_pipeline_is_refused_from_the_file_and_the_environment_as_from_the_flag(
    tmp_path: Path,
) -> None:
    """`pipeline = ""` in the config file (or SLUICE_PIPELINE=, or --pipeline "$UNSET") passed `config
    check` and ran the built-in Parquet sink: refused everywhere now, as `pipeline swap ""` is."""
    base = ["--no-spark", "--port", "0", "--metrics-port", "-1", "--data-dir", str(tmp_path / "d")]
    empty = "an empty pipeline (an unset variable?): give MODULE:FUNCTION, or leave it out"
    config = tmp_path / "sluice.toml"
    config.write_text('pipeline = ""\n')
    for args, env, named in (
        (["--config", str(config)], clean_env(), f"pipeline (in {config})"),
        ([], clean_env(SLUICE_PIPELINE=" "), "SLUICE_PIPELINE"),
        (["--pipeline", ""], clean_env(), "argument --pipeline"),
    ):
        refused_by_serve_and_check([*base, *args], env, f"{named}: {empty}")


def test_a_host_that_is_no_address_is_said_to_be_invalid_first(tmp_path: Path) -> None:
    """`--host "not a host"` was refused as "plaintext on a non-loopback address" (and with --insecure
    failed at bind time, exit 1): the host is checked first now, and named as written."""
    base = ["--no-spark", "--port", "0", "--metrics-port", "-1", "--data-dir", str(tmp_path / "d")]
    config = tmp_path / "sluice.toml"
    config.write_text('metrics-host = "bad_host!"\n')
    for args, env, says in (
        (
            ["--host", "not a host"],
            clean_env(),
            "--host 'not a host' is neither an IP address nor a host name",
        ),
        (["--host", "not a host", "--insecure"], clean_env(), "--host 'not a host' is neither an IP address"),
        (["--host", "[127.0.0.1]"], clean_env(), "--host '[127.0.0.1]' is neither an IP address"),
        ([], clean_env(SLUICE_HOST=""), "SLUICE_HOST is empty (an unset variable?): give 0.0.0.0 or ::"),
        (["--config", str(config)], clean_env(), f"metrics-host (in {config}) 'bad_host!' is neither"),
    ):
        refused_by_serve_and_check([*base, *args], env, says)
    for host in ("0.0.0.0", "::", "[::1]", "localhost", "sluice-1.example.com"):
        result = check(*base, "--host", host, "--insecure")
        assert result.returncode == 0, (host, result.stderr)


def test_checks_and_refusals_answer_without_importing_spark(tmp_path: Path) -> None:
    """Issue 17 (fast where users feel it): `config check` (a single server's and a driver's) and a serve
    refused on a bad file answer before pyspark is imported (it took a driver's check from ~0.6 to ~1.5 s:
    DriverConfig lived beside the Spark driver in ingest.cluster_driver); only a start that runs needs it."""
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("0 127.0.0.1:51101\n")
    bad = tmp_path / "bad.toml"
    bad.write_text("not toml\n")
    driver = ["--role", "driver", "--nodes", str(nodes), "--data-dir", str(tmp_path / "d")]
    single = ["--data-dir", str(tmp_path / "s")]
    commands = [
        (["config", "check", *single], 0),
        (["config", "check", *driver], 0),
        (["config", "check", *driver, "--auth-file", str(bad)], 2),
        (["serve", *driver, "--auth-file", str(bad)], 2),
        (["serve", *single, "--auth-file", str(bad)], 2),
    ]
    for argv, code in commands:
        script = (
            "import sys\nfrom ingest import cli\n"
            f"code = cli.main({argv!r})\n"
            "print('exit', code, 'pyspark' in sys.modules)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=120,
            check=False,
        )
        assert done.stdout.strip().splitlines()[-1] == f"exit {code} False", (argv, done.stdout, done.stderr)


def test_accept_wal_damage_takes_stream_names_from_every_source(tmp_path: Path) -> None:
    """--accept-wal-damage STREAM[,STREAM], repeatable; a list in the file, comma-separated in the
    environment; a name no stream can have is a usage error naming it."""
    data = ["--no-spark", "--data-dir", str(tmp_path / "data")]
    flags = check(*data, "--accept-wal-damage", "a,b", "--accept-wal-damage", "b")
    assert flags.returncode == 0, flags.stderr
    assert rows(flags.stdout)["accept-wal-damage"] == ("a,b", "flag")
    config = tmp_path / "sluice.toml"
    config.write_text('accept-wal-damage = ["events", "clicks"]\n')
    filed = check(*data, "--config", str(config))
    assert rows(filed.stdout)["accept-wal-damage"] == ("events,clicks", f"file {config}"), filed.stderr
    env = check(*data, env=clean_env(SLUICE_ACCEPT_WAL_DAMAGE="x,y"))
    assert rows(env.stdout)["accept-wal-damage"] == ("x,y", "env SLUICE_ACCEPT_WAL_DAMAGE"), env.stderr
    assert rows(check(*data).stdout)["accept-wal-damage"] == ("(none)", "default")
    bad = check(*data, "--accept-wal-damage", "a,../b")
    assert bad.returncode == 2 and "invalid stream name '../b'" in bad.stderr, bad.stderr
    (tmp_path / "nodes").write_text("0 127.0.0.1:51101\n")
    driver = check("--role", "driver", "--nodes", str(tmp_path / "nodes"), "--accept-wal-damage", "a")
    assert driver.returncode == 2 and "does not use --accept-wal-damage" in driver.stderr, driver.stderr
