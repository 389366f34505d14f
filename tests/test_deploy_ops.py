"""deploy/ for operators: the Prometheus alert rules (promtool's checks and unit tests, and a mutation of
each rule that its tests must catch), the Grafana dashboard, the systemd unit, and a real Prometheus
server (Debian's package) scraping a live Sluice with the rules loaded.

Every metric name the rules and the dashboard use must be one the service exports: the names are read
from the collectors' source (ingest/, receivers/), and the live test checks that what a real server
exports is among them, so a renamed metric fails here rather than leaving an alert that never fires.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import free_ports, running_server

from ingest.cli import DRAIN_SECONDS
from sluice_client import Producer

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERTS_TEST = DEPLOY / "prometheus" / "alerts_test.yml"
DASHBOARD = DEPLOY / "grafana" / "sluice.json"
UNIT = DEPLOY / "systemd" / "sluice.service"
SYSUSERS = DEPLOY / "systemd" / "sluice.sysusers"
ENV_FILE = DEPLOY / "systemd" / "sluice.env"

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
NO_PROMTOOL = "promtool not installed (Debian package prometheus; .ci/run installs it)"

Doc = dict[str, Any]


# ---- the metrics the service exports, read from its collectors' source

# the series a family of each kind exposes (prometheus_client); a counter's name loses its _total first
_SERIES_SUFFIXES: dict[str, tuple[str, ...]] = {
    "CounterMetricFamily": ("_total",),
    "Counter": ("_total",),
    "GaugeMetricFamily": ("",),
    "Gauge": ("",),
    "HistogramMetricFamily": ("_bucket", "_sum", "_count"),
    "Histogram": ("_bucket", "_sum", "_count"),
    "SummaryMetricFamily": ("", "_sum", "_count"),
    "Summary": ("", "_sum", "_count"),
    "InfoMetricFamily": ("_info",),
    "Info": ("_info",),
    "StateSetMetricFamily": ("",),
    "Enum": ("",),
}
_METRIC = re.compile(r"(?<![A-Za-z0-9_:])sluice_[a-z0-9_]+")


def _callee(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _dict_keys(scope: ast.AST, variable: str) -> list[str]:
    """The string keys of the dict literal assigned to `variable` in `scope`."""
    for node in ast.walk(scope):
        if not isinstance(node, ast.Assign | ast.AnnAssign):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        value = node.value if any(isinstance(t, ast.Name) and t.id == variable for t in targets) else None
        if isinstance(value, ast.Dict):
            keys = [k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            assert len(keys) == len(value.keys), f"{variable}: a key that is not a string literal"
            return keys
    raise AssertionError(f"no dict literal assigned to {variable}")


def _loop_source(scope: ast.AST, variable: str, inside: ast.AST) -> str:
    """The dict that `for variable, ... in DICT.items()` (or `for variable in DICT`) iterates in `scope`,
    in a loop around `inside`."""
    for node in ast.walk(scope):
        if not isinstance(node, ast.For) or not any(n is inside for n in ast.walk(node)):
            continue
        target = node.target.elts[0] if isinstance(node.target, ast.Tuple) else node.target
        if not (isinstance(target, ast.Name) and target.id == variable):
            continue
        source = node.iter
        if isinstance(source, ast.Call) and isinstance(source.func, ast.Attribute):
            source = source.func.value
        if isinstance(source, ast.Name):
            return source.id
    raise AssertionError(f"no loop over a dict binds {variable}")


def _family_names(scope: ast.AST, node: ast.expr) -> list[str]:
    """The metric names a family's name argument takes: a literal, or f"prefix{name}" over the keys of
    the dict literal its loop iterates. Anything else fails: a name this cannot see would be missed."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr) and len(node.values) == 2:
        prefix, formatted = node.values
        if (
            isinstance(prefix, ast.Constant)
            and isinstance(prefix.value, str)
            and isinstance(formatted, ast.FormattedValue)
            and isinstance(formatted.value, ast.Name)
        ):
            keys = _dict_keys(scope, _loop_source(scope, formatted.value.id, node))
            return [f"{prefix.value}{key}" for key in keys]
    raise AssertionError(f"cannot read the metric name {ast.unparse(node)}")


def _exported_series() -> dict[str, str]:
    """Every series name the service's code exports (prometheus_client families and metrics named
    sluice_*) -> the kind of its family."""
    found: dict[str, str] = {}
    for package in ("ingest", "receivers", "ratecontrol"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for scope in ast.walk(tree):
                if not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for call in ast.walk(scope):
                    if not isinstance(call, ast.Call) or _callee(call) not in _SERIES_SUFFIXES:
                        continue
                    argument = (
                        call.args[0]
                        if call.args
                        else next((k.value for k in call.keywords if k.arg == "name"), None)
                    )
                    if argument is None:
                        continue
                    if isinstance(argument, ast.Constant) and not str(argument.value).startswith("sluice_"):
                        continue
                    kind = _callee(call)
                    for name in _family_names(scope, argument):
                        base = name.removesuffix("_total") if _SERIES_SUFFIXES[kind] == ("_total",) else name
                        for suffix in _SERIES_SUFFIXES[kind]:
                            found[base + suffix] = kind
    return found


EXPORTED = _exported_series()


def _unknown_metrics(expr: str) -> set[str]:
    """Names in a PromQL expression that look like Sluice's metrics and are no series it exports."""
    return set(_METRIC.findall(expr)) - set(EXPORTED)


def test_the_exported_names_are_read_from_the_collectors() -> None:
    # one of each way a family is named: a literal, a dict of counters, of gauges, a cluster driver's
    assert EXPORTED["sluice_records_received_total"] == "CounterMetricFamily"
    assert EXPORTED["sluice_rate_limit"] == "GaugeMetricFamily"
    assert EXPORTED["sluice_credit_paused"] == "GaugeMetricFamily"
    assert EXPORTED["sluice_credit_paused_seconds_total"] == "CounterMetricFamily"
    assert EXPORTED["sluice_batches_completed_total"] == "CounterMetricFamily"
    assert EXPORTED["sluice_node_backlog_records"] == "GaugeMetricFamily"
    assert EXPORTED["sluice_cluster_rate_records_per_second"] == "GaugeMetricFamily"
    assert "sluice_records_received" not in EXPORTED  # a counter is scraped as _total only


def test_an_unknown_or_misspelt_metric_is_caught() -> None:
    assert _unknown_metrics('rate(sluice_records_received_total{stream=~"$stream"}[5m])') == set()
    assert _unknown_metrics("rate(sluice_records_recieved_total[5m])") == {"sluice_records_recieved_total"}
    assert _unknown_metrics("sluice_rate_limit_total") == {"sluice_rate_limit_total"}  # a gauge
    assert _unknown_metrics("increase(sluice_block_write_errors[5m])") == {"sluice_block_write_errors"}


# ---- the alert rules


def _rules() -> list[Doc]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _alert_names() -> list[str]:
    return [rule["alert"] for rule in _rules()]


def test_the_rules_use_only_exported_metrics() -> None:
    used: set[str] = set()
    for rule in _rules():
        assert _unknown_metrics(rule["expr"]) == set(), rule["alert"]
        used |= set(_METRIC.findall(rule["expr"]))
    # what the rules watch (the brief of each alert): removing one of these from the rules fails here
    assert {
        "sluice_batches_completed_total",
        "sluice_records_acked_total",
        "sluice_rate_limit",
        "sluice_records_received_total",
        "sluice_node_backlog_records",
        "sluice_credit_paused",
        "sluice_block_write_errors_total",
        "sluice_wal_truncations_total",
        "sluice_node_up",
        "sluice_wal_disk_bytes",
        "sluice_wal_disk_budget_bytes",
    } <= used


def test_every_rule_has_a_duration_a_severity_and_annotations() -> None:
    names = _alert_names()
    assert len(names) == len(set(names)), names
    assert "SluiceDown" in names
    for rule in _rules():
        assert re.fullmatch(r"\d+[smh]", str(rule["for"])), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        annotations = rule["annotations"]
        assert set(annotations) >= {"summary", "description"}, rule["alert"]
        # the labels that say where: every rule's description names its instance or node
        description = annotations["description"]
        assert "$labels.instance" in description or "$labels.node" in description, rule["alert"]
    down = next(r for r in _rules() if r["alert"] == "SluiceDown")
    assert re.fullmatch(r'up\{job="sluice"\}\s*==\s*0', down["expr"].strip())
    # the scrape config loads the rules under the name the comment in alerts.yml gives
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/sluice-alerts.yml"]
    assert [job["job_name"] for job in config["scrape_configs"]] == ["sluice"]


def test_every_alert_is_tested_firing_and_quiet() -> None:
    tests = yaml.safe_load(ALERTS_TEST.read_text())
    assert tests["rule_files"] == [ALERTS.name]
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert firing == set(_alert_names())
    assert quiet == set(_alert_names())


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=120, check=False, cwd=cwd
    )


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_promtool_checks_the_rules() -> None:
    result = _promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_promtool_unit_tests_of_the_rules_pass() -> None:
    result = _promtool("test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def _with_expr(alert: str, change: str, tmp: Path) -> Path:
    """A copy of the rules and their tests in `tmp`, the rule `alert`'s expr changed by `change`
    ("{expr}" stands for the original)."""
    doc = yaml.safe_load(ALERTS.read_text())
    changed = copy.deepcopy(doc)
    for group in changed["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                rule["expr"] = change.format(expr=rule["expr"].strip())
    folder = tmp / f"{alert}-{len(list(tmp.iterdir()))}"
    folder.mkdir()
    (folder / ALERTS.name).write_text(yaml.safe_dump(changed, sort_keys=False))
    shutil.copy(ALERTS_TEST, folder / ALERTS_TEST.name)
    return folder


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
@pytest.mark.parametrize("alert", _alert_names())
def test_the_unit_tests_catch_a_rule_that_never_fires_or_fires_on_all(alert: str, tmp_path: Path) -> None:
    # never: the test of its trouble must fail
    silent = _with_expr(alert, "vector(1) < 0", tmp_path)
    result = _promtool("test", "rules", ALERTS_TEST.name, cwd=silent)
    assert result.returncode != 0, f"{alert}: a rule that never fires passes its tests"
    # on every input series, healthy ones too: the tests must hold series (or a time) it stays quiet on
    every = 'group by (job, instance, stream, reason, node, kind, outcome) ({{__name__=~".+"}})'
    noisy = _with_expr(alert, every, tmp_path)
    result = _promtool("test", "rules", ALERTS_TEST.name, cwd=noisy)
    assert result.returncode != 0, f"{alert}: a rule that fires on healthy series passes its tests"
    # the copy itself is sound: unchanged, it passes
    same = _with_expr(alert, "{expr}", tmp_path)
    result = _promtool("test", "rules", ALERTS_TEST.name, cwd=same)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- the Grafana dashboard

_GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__range_s", "__interval_ms"}


def _dashboard() -> Doc:
    dashboard: Doc = json.loads(DASHBOARD.read_text())
    return dashboard


def _panels(dashboard: Doc) -> Iterator[Doc]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def _expressions(dashboard: Doc) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]


def _variables(dashboard: Doc) -> dict[str, Doc]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = _dashboard()
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] == "sluice" and dashboard["title"]
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), ids
    variables = _variables(dashboard)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    stream = variables["stream"]
    assert stream["type"] == "query" and stream["multi"] and stream["includeAll"]
    assert re.fullmatch(r"label_values\(sluice_\w+(\{.*\})?, stream\)", stream["query"]["query"])
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_dashboard_panels_do_not_overlap() -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in _panels(_dashboard()):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]


def test_the_dashboard_uses_only_exported_metrics_and_its_own_variables() -> None:
    dashboard = _dashboard()
    variables = set(_variables(dashboard))
    used: set[str] = set()
    for expr in _expressions(dashboard) + [
        v["query"]["query"] for v in _variables(dashboard).values() if v["type"] == "query"
    ]:
        assert _unknown_metrics(expr) == set(), expr
        used |= set(_METRIC.findall(expr))
        for name in re.findall(r"\$\{?(\w+)", expr):
            assert name in variables | _GRAFANA_BUILTINS, f"{expr}: ${name} is no variable"
    # the status page's panels: input, rate limit, Spark's batches, buffers, block log and budget, pauses
    assert {
        "sluice_records_received_total",
        "sluice_rate_limit",
        "sluice_batches_completed_total",
        "sluice_buffered_records",
        "sluice_buffered_bytes",
        "sluice_wal_disk_bytes",
        "sluice_wal_disk_budget_bytes",
        "sluice_credit_paused",
        "sluice_node_backlog_records",
    } <= used
    # per stream: every expression over a family with a stream label is filtered by $stream, but for a
    # total of all streams (the disk budget is one for the whole block log)
    per_stream = _per_stream_series()
    for expr in _expressions(dashboard):
        for name in set(_METRIC.findall(expr)) & per_stream:
            by_stream = re.search(name + r'\{[^}]*stream=~"\$stream"', expr)
            total = re.fullmatch(r"sum by \(instance\) \(" + name + r'\{instance=~"\$instance"\}\)', expr)
            assert by_stream or total, f"{expr}: {name} not by $stream"


def _per_stream_series() -> set[str]:
    """The series of SluiceCollector's per-stream families (labels=["stream", ...])."""
    tree = ast.parse((ROOT / "ingest" / "metrics.py").read_text())
    per_stream_literals = [
        str(call.args[0].value)
        for call in ast.walk(tree)
        if isinstance(call, ast.Call)
        and call.args
        and isinstance(call.args[0], ast.Constant)
        and any(
            k.arg == "labels"
            and isinstance(k.value, ast.List)
            and k.value.elts
            and isinstance(k.value.elts[0], ast.Constant)
            and k.value.elts[0].value == "stream"
            for k in call.keywords
        )
    ]
    collect = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef)
        and n.name == "collect"
        and any(isinstance(c, ast.Constant) and c.value == "records_received" for c in ast.walk(n))
    )
    keyed = [f"sluice_{k}" for d in ("counters", "gauges") for k in _dict_keys(collect, d)]
    bases = keyed + per_stream_literals
    per_stream = {name for name in EXPORTED if any(name in (b, b + "_total") for b in bases)}
    assert {"sluice_records_received_total", "sluice_credit_paused", "sluice_wal_disk_bytes"} <= per_stream
    return per_stream


# ---- the systemd unit


def _unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file's sections -> their (key, value) lines in order (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    text = re.sub(r"\\\n", " ", path.read_text())
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        assert current is not None, line
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def _one(section: list[tuple[str, str]], key: str) -> str:
    values = [v for k, v in section if k == key]
    assert len(values) == 1, f"{key}: {values}"
    return values[0]


def _seconds(span: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "ms": 0.001}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span):
        total += float(number) * units[unit]
    return total


def _serve_accepts(args: list[str]) -> subprocess.CompletedProcess[str]:
    """`sluice serve ARGS --help`: argparse takes (and converts) every option before --help, so exit 0
    means sluice serve accepts them all; an unknown flag or a bad value exits 2."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "250"}
    return subprocess.run(
        [sys.executable, "-m", "ingest.cli", "serve", *args, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
        cwd=ROOT,
    )


def _serve_options() -> dict[str, bool]:
    """`sluice serve --help`'s options: flag -> whether it takes a value."""
    result = _serve_accepts([])
    assert result.returncode == 0, result.stderr
    options: dict[str, bool] = {}
    for line in result.stdout.splitlines():
        match = re.match(r"^  (-.*?)(?:\s{2,}|$)", line)
        if match is None:
            continue
        for spelling in match.group(1).split(", "):
            flag, _, metavar = spelling.partition(" ")
            options[flag] = bool(metavar)
    assert options.get("--data-dir") is True and options.get("--no-spark") is False
    return options


def _unknown_flags(args: list[str], options: dict[str, bool]) -> list[str]:
    """The words of `args` that are no flag of sluice serve (or a flag without the value it needs)."""
    unknown = []
    at = 0
    while at < len(args):
        flag = args[at]
        if flag not in options:
            unknown.append(flag)
            at += 1
        elif options[flag]:
            if at + 1 >= len(args) or args[at + 1].startswith("--"):
                unknown.append(f"{flag} without a value")
            at += 2
        else:
            at += 1
    return unknown


def _env_args() -> list[list[str]]:
    """Every SLUICE_ARGS the example environment file gives, commented out or not."""
    found = []
    for line in ENV_FILE.read_text().splitlines():
        match = re.fullmatch(r"#?\s*SLUICE_ARGS=(.*)", line.strip())
        if match:
            found.append(shlex.split(match.group(1)))
    return found


def test_the_unit_runs_sluice_serve_as_its_own_user_and_stops_cleanly() -> None:
    unit = _unit(UNIT)
    service = unit["Service"]
    assert _one(service, "User") == "sluice" == _one(service, "Group")
    state = _one(service, "StateDirectory")
    data_dir = f"/var/lib/{state}"
    assert data_dir in _one(service, "ReadWritePaths").split()
    assert _one(service, "WorkingDirectory") == data_dir
    argv = shlex.split(_one(service, "ExecStart"))
    assert Path(argv[0]).name == "sluice" and argv[1] == "serve"
    assert argv[argv.index("--data-dir") + 1] == data_dir
    assert _one(service, "Restart") == "on-failure"
    assert _one(service, "KillSignal") == "SIGTERM"
    # SIGTERM to sluice alone: its Spark JVM must outlive the drain
    assert _one(service, "KillMode") == "mixed"
    assert _seconds(_one(service, "TimeoutStopSec")) >= DRAIN_SECONDS + 30
    assert _one(service, "NoNewPrivileges") == "yes"
    assert _one(service, "ProtectSystem") == "strict"
    assert _one(service, "PrivateTmp") == "yes"
    # the JVM's JIT writes and runs code
    assert "MemoryDenyWriteExecute" not in {k for k, _ in service}
    assert _one(service, "EnvironmentFile").startswith("-")  # optional
    assert _one(service, "ExecReload") == "/bin/kill -HUP $MAINPID"  # sluice re-reads TLS and auth files
    sysusers = [line.split() for line in SYSUSERS.read_text().splitlines() if line and line[0] != "#"]
    assert sysusers[0][:2] == ["u", "sluice"]
    assert data_dir in sysusers[0]


def test_sluice_serve_accepts_the_units_flags() -> None:
    argv = shlex.split(_one(_unit(UNIT)["Service"], "ExecStart"))[2:]
    assert "$SLUICE_ARGS" in argv
    own = [a for a in argv if a != "$SLUICE_ARGS"]
    examples = _env_args()
    assert len(examples) >= 2
    options = _serve_options()
    for extra in examples:
        assert _unknown_flags(own + extra, options) == [], own + extra
        # argparse converts every value before --help: exit 0 means each value is one serve takes
        result = _serve_accepts(own + extra)
        assert result.returncode == 0, f"{own + extra}: {result.stderr}"
    # the checks can fail
    assert _unknown_flags([*own, "--no-such-flag", "--stream"], options) == [
        "--no-such-flag",
        "--stream without a value",
    ]
    assert _serve_accepts([*own, "--disk-budget", "lots"]).returncode == 2


def test_sluice_serve_takes_the_environment_the_unit_gives_it(tmp_path: Path) -> None:
    """EnvironmentFile= puts every variable of sluice.env in serve's environment, SLUICE_ARGS too: serve
    refused it as a SLUICE_* variable that names no flag, so the shipped unit stopped with exit 2."""
    variables = {}
    for line in ENV_FILE.read_text().splitlines():
        match = re.fullmatch(r"#?\s*([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if match:
            variables[match.group(1)] = match.group(2)
    assert "SLUICE_ARGS" in variables
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(variables, PYTHONPATH=str(ROOT))
    argv = [*("--data-dir", str(tmp_path / "data"), "--port", "0", "--metrics-port", "-1", "--no-spark")]
    result = subprocess.run(
        [sys.executable, "-m", "ingest.cli", "config", "check", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "SLUICE_ARGS" not in result.stderr


def test_systemd_verifies_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (Debian package systemd)")
    # verify wants the command to exist: the venv's sluice stands in for /opt/sluice/venv/bin/sluice
    sluice = Path(sys.executable).parent / "sluice"
    assert sluice.exists(), sluice
    text = UNIT.read_text()
    argv0 = shlex.split(_one(_unit(UNIT)["Service"], "ExecStart"))[0]
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace(f"ExecStart={argv0} ", f"ExecStart={sluice} "))
    result = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=120, check=False
    )
    # an unknown key is only a warning (exit 0): any line about the unit fails
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if UNIT.name in line]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr
    broken = tmp_path / "broken" / UNIT.name
    broken.parent.mkdir()
    broken.write_text(unit.read_text().replace("KillMode=", "KilMode="))
    result = subprocess.run(
        [analyze, "verify", str(broken)], capture_output=True, text=True, timeout=120, check=False
    )
    assert "KilMode" in result.stdout + result.stderr
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is not None:
        checked = subprocess.run(
            [sysusers, "--dry-run", str(SYSUSERS)], capture_output=True, text=True, timeout=60, check=False
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr


# ---- a real Prometheus scraping a live Sluice


def _get(url: str) -> Doc:
    with urllib.request.urlopen(url, timeout=10) as response:
        answer: Doc = json.loads(response.read())
    return answer


async def _until(what: str, check: Any, timeout: float = 60.0) -> Any:
    """Polls check() (blocking, in a thread) until it returns something truthy; its last error or value
    in the failure."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = await asyncio.to_thread(check)
        except OSError as exc:  # not up yet
            last = exc
        else:
            if last:
                return last
        await asyncio.sleep(0.5)
    raise AssertionError(f"{what} within {timeout:g} s; last: {last!r}")


def _grafana_to_promql(expr: str) -> str:
    return (
        expr.replace("$__rate_interval", "1m")
        .replace("$__range", "5m")
        .replace("$instance", ".*")
        .replace("$stream", ".*")
    )


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian package prometheus)")
async def test_prometheus_scrapes_sluice_with_the_rules_loaded(tmp_path: Path) -> None:
    assert PROMETHEUS is not None
    records = 3_000
    async with running_server(tmp_path / "data", "s", metrics=True, disk_budget_bytes=1 << 30) as server:
        async with Producer(server.target, "s") as producer:
            await producer.send_many([b"r" * 16] * records)
            await producer.flush(timeout=60)
        assert server.metrics_port is not None
        (port,) = free_ports(1)
        config = tmp_path / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(ALERTS)],
                    "scrape_configs": [
                        {
                            "job_name": "sluice",
                            "static_configs": [{"targets": [f"127.0.0.1:{server.metrics_port}"]}],
                        }
                    ],
                }
            )
        )
        api = f"http://127.0.0.1:{port}/api/v1"
        with (tmp_path / "prometheus.log").open("w") as log:
            process = await asyncio.to_thread(
                subprocess.Popen,
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )
            try:
                await _check_prometheus(api, records, process)
            except AssertionError as exc:
                tail = (tmp_path / "prometheus.log").read_text()[-4000:]
                raise AssertionError(f"{exc}\n--- prometheus's log:\n{tail}") from exc
            finally:
                process.terminate()
                try:
                    await asyncio.to_thread(process.wait, 30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    await asyncio.to_thread(process.wait, 30)
        assert process.returncode is not None


async def _check_prometheus(api: str, records: int, process: subprocess.Popen[bytes]) -> None:
    def acked() -> list[Doc] | None:
        assert process.poll() is None, f"prometheus exited with {process.returncode}"
        query = urllib.parse.quote('sluice_records_acked_total{job="sluice", stream="s"}')
        result: list[Doc] = _get(f"{api}/query?query={query}")["data"]["result"]
        return result if result and float(result[0]["value"][1]) == records else None

    (sample,) = await _until(f"sluice_records_acked_total == {records}", acked)
    assert sample["metric"]["instance"].startswith("127.0.0.1:")

    def rules() -> dict[str, Doc] | None:
        groups = _get(f"{api}/rules")["data"]["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        return loaded if loaded and all(r["health"] == "ok" for r in loaded.values()) else None

    loaded = await _until("every rule loaded and evaluated with health ok", rules)
    assert set(loaded) == set(_alert_names())
    assert all(rule["type"] == "alerting" for rule in loaded.values())
    # a healthy service: nothing fires
    firing = [a for r in loaded.values() for a in r.get("alerts", []) if a["state"] == "firing"]
    assert firing == []

    # every series Prometheus stored from Sluice is one the name check knows
    names = _get(f"{api}/label/__name__/values")["data"]
    stored = {n for n in names if n.startswith("sluice_")}
    assert "sluice_wal_disk_budget_bytes" in stored
    assert stored <= set(EXPORTED), stored - set(EXPORTED)

    # every dashboard expression is PromQL Prometheus runs
    for expr in _expressions(_dashboard()):
        query = urllib.parse.quote(_grafana_to_promql(expr))
        answer = _get(f"{api}/query?query={query}")
        assert answer["status"] == "success", (expr, answer)
    received = urllib.parse.quote(
        _grafana_to_promql('sum(sluice_records_received_total{instance=~"$instance", stream=~"$stream"})')
    )
    (total,) = _get(f"{api}/query?query={received}")["data"]["result"]
    assert float(total["value"][1]) == records
