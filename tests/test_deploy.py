"""deploy/: the Kubernetes manifests against the API schemas (kubernetes-validate, offline, strict), and
against each other, `sluice serve`'s flags, Spark's settings and the container build.

Nothing here can run a cluster or build an image; what can be checked without one is: every field is
one the API knows (strict: a typo'd field fails), and every name, port, label and path that one file
gives and another relies on is the same in both.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
MANIFESTS = DEPLOY / "kubernetes"
# the oldest Kubernetes the manifests are for: the StatefulSet's pod-index label (SLUICE_NODE_ID) is GA
# from 1.32 on, as are native grpc probes (1.27) and the PVC retention policy (1.32)
KUBERNETES_VERSION = "1.32"

# `sluice serve` flags the cluster roles bring (issue 14); while one is missing the flag check skips
CLUSTER_FLAGS = {"--role", "--node-id", "--nodes", "--replication", "--min-insync", "--health-port"}

Doc = dict[str, Any]


def _documents() -> list[tuple[str, Doc]]:
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path.name, doc))
    return found


DOCUMENTS = _documents()


def _one(kind: str, name: str) -> Doc:
    matches = [d for _, d in DOCUMENTS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def _all(kind: str) -> list[Doc]:
    return [d for _, d in DOCUMENTS if d["kind"] == kind]


def _workloads() -> list[Doc]:
    return _all("StatefulSet") + _all("Deployment")


def _container(workload: Doc) -> Doc:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: Doc = containers[0]
    return container


def _flag(args: list[str], flag: str) -> str:
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    assert len(values) == 1, f"{flag} given {len(values)} times in {args}"
    return values[0]


def _flags(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def _pod_labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


RECEIVERS = _one("StatefulSet", "sluice-receiver")
DRIVER = _one("Deployment", "sluice-driver")


# ---- the schemas


@pytest.mark.parametrize(
    "doc", [d for _, d in DOCUMENTS], ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCUMENTS]
)
def test_every_manifest_is_valid_for_the_api(doc: Doc) -> None:
    # a kind without a schema (a typo'd kind or apiVersion) raises SchemaNotFoundError: a failure here
    problem = None
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:  # its str() dumps the whole schema
        problem = f"{'.'.join(map(str, error.path))}: {error.message}"
    if problem is not None:
        pytest.fail(problem, pytrace=False)


def _typo_field(doc: Doc) -> None:
    doc["spec"]["replica"] = doc["spec"].pop("replicas")


def _port_as_text(doc: Doc) -> None:
    doc["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "50051"


def _probe_misplaced(doc: Doc) -> None:
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["grpc"]["path"] = "/healthz"


@pytest.mark.parametrize("breakage", [_typo_field, _port_as_text, _probe_misplaced])
def test_a_broken_manifest_fails_validation(breakage: Any) -> None:
    broken = copy.deepcopy(RECEIVERS)
    breakage(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    files = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    images = {i["name"] for i in kustomization["images"]}
    used = {_container(w)["image"].split(":")[0] for w in _workloads()}
    assert used <= images


# ---- the manifests agree with each other


def test_receivers_have_stable_names_in_a_headless_service() -> None:
    service = _one("Service", RECEIVERS["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    # peers must find each other while starting, before any is ready
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert _selects(service["spec"]["selector"], _pod_labels(RECEIVERS))


def test_the_nodes_file_names_every_receiver_by_its_stable_name() -> None:
    nodes = _one("ConfigMap", "sluice-nodes")["data"]["nodes.txt"].splitlines()
    replicas = RECEIVERS["spec"]["replicas"]
    name, service = RECEIVERS["metadata"]["name"], RECEIVERS["spec"]["serviceName"]
    port = _flag(_container(RECEIVERS)["args"], "--port")
    # ids are the pods' ordinals: each pod finds itself by its pod-index label
    assert nodes == [f"{i} {name}-{i}.{service}:{port}" for i in range(replicas)]
    env = {e["name"]: e for e in _container(RECEIVERS)["env"]}
    assert env["SLUICE_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    for workload in _workloads():
        args = _container(workload)["args"]
        mount = _mount_of(workload, "configMap", "sluice-nodes")
        assert _flag(args, "--nodes") == f"{mount}/nodes.txt"


def test_replication_fits_the_nodes_and_the_disruption_budget() -> None:
    args = _container(RECEIVERS)["args"]
    replication, min_insync = int(_flag(args, "--replication")), int(_flag(args, "--min-insync"))
    assert 1 <= min_insync <= replication <= RECEIVERS["spec"]["replicas"]
    budget = _one("PodDisruptionBudget", "sluice-receiver")
    assert budget["spec"]["selector"]["matchLabels"] == RECEIVERS["spec"]["selector"]["matchLabels"]
    assert _selects(budget["spec"]["selector"]["matchLabels"], _pod_labels(RECEIVERS))
    # a voluntary eviction may take at most the copies a block can lose and stay readable
    assert budget["spec"]["maxUnavailable"] <= replication - 1


def test_both_roles_take_the_same_streams() -> None:
    receiver = _flags(_container(RECEIVERS)["args"], "--stream")
    assert receiver
    assert _flags(_container(DRIVER)["args"], "--stream") == receiver


def test_selectors_pick_their_own_pods_only() -> None:
    for workload in _workloads():
        labels = _pod_labels(workload)
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for service in _all("Service"):
        selected = [w for w in _workloads() if _selects(service["spec"]["selector"], _pod_labels(w))]
        assert len(selected) == 1, f"Service {service['metadata']['name']} selects {len(selected)} workloads"
        ports = {p["name"]: p["containerPort"] for p in _container(selected[0])["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{service['metadata']['name']}: {port['targetPort']}"
            assert port["port"] == ports[port["targetPort"]]


@pytest.mark.parametrize("workload", [RECEIVERS, DRIVER], ids=["receiver", "driver"])
def test_probes_and_ports_match_the_flags(workload: Doc) -> None:
    container = _container(workload)
    args = container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == int(_flag(args, "--port"))
    probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in container]
    assert "livenessProbe" in container
    for probe in probes:
        if "grpc" in probe:
            # the kubelet's grpc probe has no TLS: only the plaintext health port can answer it
            assert probe["grpc"]["port"] == ports["health"] == int(_flag(args, "--health-port"))
            assert probe["grpc"].get("service", "") in {"", "ingest.v1.Ingest"}
        else:
            assert probe["tcpSocket"]["port"] in ports
    annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
    if "--metrics-port" in args:
        assert ports["metrics"] == int(_flag(args, "--metrics-port"))
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == ports["metrics"]
        assert annotations["prometheus.io/scheme"] == ("https" if "--metrics-tls" in args else "http")
    else:
        assert "prometheus.io/scrape" not in annotations


@pytest.mark.parametrize("workload", [RECEIVERS, DRIVER], ids=["receiver", "driver"])
def test_workloads_are_probed_on_the_health_service(workload: Doc) -> None:
    container = _container(workload)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in container:
            assert "grpc" in container[probe], probe
    assert "livenessProbe" in container and "startupProbe" in container


def _mount_of(workload: Doc, source: str, name: str) -> str:
    """Where `workload`'s container mounts the volume made from ConfigMap/Secret/PVC `name`."""
    key = {"configMap": "name", "secret": "secretName", "persistentVolumeClaim": "claimName"}[source]
    volumes = [
        v["name"]
        for v in workload["spec"]["template"]["spec"].get("volumes", [])
        if source in v and v[source][key] == name
    ]
    assert len(volumes) == 1, f"{workload['metadata']['name']} has {len(volumes)} volumes of {name}"
    mounts = [m["mountPath"] for m in _container(workload)["volumeMounts"] if m["name"] == volumes[0]]
    assert len(mounts) == 1
    return mounts[0]


def _data_mount(workload: Doc) -> str:
    mounts = {m["name"]: m["mountPath"] for m in _container(workload)["volumeMounts"]}
    return mounts["data"]


@pytest.mark.parametrize("workload", [RECEIVERS, DRIVER], ids=["receiver", "driver"])
def test_files_the_flags_name_are_mounted(workload: Doc) -> None:
    args = _container(workload)["args"]
    tls = _mount_of(workload, "secret", "sluice-tls")
    assert _flag(args, "--tls-cert") == f"{tls}/tls.crt"
    assert _flag(args, "--tls-key") == f"{tls}/tls.key"
    assert _flag(args, "--client-ca") == f"{tls}/ca.crt"
    assert _flag(args, "--data-dir") == _data_mount(workload)
    security = workload["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    # the volume is writable by the image's user
    assert security["fsGroup"] == security["runAsUser"] == _containerfile_uid()


def test_the_receivers_volume_holds_the_disk_budget() -> None:
    (claim,) = RECEIVERS["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    budget = _flag(_container(RECEIVERS)["args"], "--disk-budget")
    assert _bytes(budget) < _bytes(claim["spec"]["resources"]["requests"]["storage"])


def _bytes(size: str) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|KiB|MiB|GiB|TiB)", size)
    assert match is not None, size
    return int(match.group(1)) << (10 * ["K", "M", "G", "T"].index(match.group(2)[0]) + 10)


# ---- Spark on Kubernetes


def _spark_defaults() -> dict[str, str]:
    text = _one("ConfigMap", "sluice-spark-defaults")["data"]["spark-defaults.conf"]
    settings = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, value = line.split(maxsplit=1)
            assert key not in settings, f"{key} twice"
            settings[key] = value
    return settings


def test_spark_defaults_point_executors_at_the_driver() -> None:
    conf = _spark_defaults()
    container = _container(DRIVER)
    env = {e["name"]: e for e in container["env"]}
    conf_dir = _mount_of(DRIVER, "configMap", "sluice-spark-defaults")
    assert env["SPARK_CONF_DIR"]["value"] == conf_dir
    # executors connect to the driver by its Service's name, on ports the Service and the pod declare
    service = _one("Service", conf["spark.driver.host"])
    assert _selects(service["spec"]["selector"], _pod_labels(DRIVER))
    assert service["spec"]["clusterIP"] == "None"  # the name is the pod's own address
    service_ports = {p["port"] for p in service["spec"]["ports"]}
    container_ports = {p["containerPort"] for p in container["ports"]}
    for key in ("spark.driver.port", "spark.driver.blockManager.port"):
        assert int(conf[key]) in service_ports & container_ports, key
    assert conf["spark.driver.bindAddress"] == "0.0.0.0"
    assert _flag(container["args"], "--master") == "k8s://https://kubernetes.default.svc"
    # ${env:X}: Spark's substitution from the driver's environment, which must define X
    for variable in re.findall(r"\$\{env:(\w+)\}", json.dumps(conf)):
        assert variable in env, variable
    assert env["SLUICE_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert conf["spark.kubernetes.namespace"] == "${env:SLUICE_NAMESPACE}"
    assert int(conf["spark.executor.instances"]) >= 1
    for key in ("spark.executor.memory", "spark.executor.cores", "spark.kubernetes.container.image"):
        assert conf[key], key


def test_executors_get_the_tls_files_where_the_driver_has_them() -> None:
    conf = _spark_defaults()
    prefix = "spark.kubernetes.executor.secrets."
    secrets = {k.removeprefix(prefix): v for k, v in conf.items() if k.startswith(prefix)}
    assert secrets == {"sluice-tls": _mount_of(DRIVER, "secret", "sluice-tls")}


def test_the_driver_may_run_its_executors() -> None:
    conf = _spark_defaults()
    account = conf["spark.kubernetes.authenticate.driver.serviceAccountName"]
    _one("ServiceAccount", account)
    assert DRIVER["spec"]["template"]["spec"]["serviceAccountName"] == account
    assert DRIVER["spec"]["strategy"]["type"] == "Recreate"
    assert DRIVER["spec"]["replicas"] == 1
    bindings = [
        b
        for b in _all("RoleBinding")
        if {"kind": "ServiceAccount", "name": account} in b["subjects"] and b["roleRef"]["kind"] == "Role"
    ]
    assert len(bindings) == 1
    role = _one("Role", bindings[0]["roleRef"]["name"])
    granted = {
        (resource, verb)
        for rule in role["rules"]
        if rule["apiGroups"] == [""]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    needed = {("pods", v) for v in ("create", "get", "list", "watch", "delete", "deletecollection")}
    for resource in ("services", "configmaps", "persistentvolumeclaims"):
        needed |= {(resource, "create"), (resource, "delete")}
    assert needed <= granted, needed - granted
    # the receivers need no API access at all
    assert RECEIVERS["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_images_are_tagged_with_the_project_version() -> None:
    version = _pyproject()["project"]["version"]
    for workload in _workloads():
        assert _container(workload)["image"] == f"sluice:{version}"
    assert _spark_defaults()["spark.kubernetes.container.image"] == f"sluice-executor:{version}"
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert {i["name"]: i["newTag"] for i in kustomization["images"]}["sluice"] == version


# ---- `sluice serve` knows every flag the manifests give


@pytest.fixture(scope="module")
def serve_options() -> dict[str, set[str] | None]:
    """`sluice serve --help`'s options: flag -> its choices (empty set: any value; None: no value)."""
    env = {**os.environ, "COLUMNS": "250"}  # one option per line
    result = subprocess.run(
        [sys.executable, "-m", "ingest.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
        cwd=ROOT,
    )
    options: dict[str, set[str] | None] = {}
    for line in result.stdout.splitlines():
        match = re.match(r"^  (-.*?)(?:\s{2,}|$)", line)
        if match is None:
            continue
        for spelling in match.group(1).split(", "):
            flag, _, metavar = spelling.partition(" ")
            choices = re.fullmatch(r"\{(.*)\}", metavar)
            options[flag] = None if not metavar else set(choices.group(1).split(",")) if choices else set()
    assert "--port" in options and options["--insecure"] is None
    return options


@pytest.mark.parametrize("workload", [RECEIVERS, DRIVER], ids=["receiver", "driver"])
def test_every_serve_flag_is_one_sluice_serve_knows(
    workload: Doc, serve_options: dict[str, set[str] | None]
) -> None:
    args = list(_container(workload)["args"])
    assert args.pop(0) == "serve"
    missing = []
    at = 0
    while at < len(args):
        flag = args[at]
        assert flag.startswith("--"), f"{flag!r} is no flag (sluice serve takes no positional arguments)"
        if flag not in serve_options:
            assert flag in CLUSTER_FLAGS, f"sluice serve has no {flag}"
            missing.append(flag)
            at += 2 if at + 1 < len(args) and not args[at + 1].startswith("--") else 1
            continue
        choices = serve_options[flag]
        if choices is None:
            at += 1
            continue
        assert at + 1 < len(args) and not args[at + 1].startswith("--"), f"{flag} needs a value"
        value = args[at + 1]
        if choices and value not in choices:
            assert flag == "--role", f"{flag} {value}: not one of {sorted(choices)}"
            missing.append(f"--role {value}")
        at += 2
    if missing:
        pytest.skip(f"sluice serve does not take {', '.join(missing)} yet (issue 14, the lead's part)")


# ---- the container build


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _stages() -> dict[str, list[tuple[str, str]]]:
    """The Containerfile's stages: name -> its (INSTRUCTION, rest) lines, continuations joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Containerfile").read_text())
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM":
            current = []
            stages[rest.split(" AS ")[-1].strip() if " AS " in rest else rest] = current
        current.append((instruction.upper(), rest.strip()))
    return stages


def _stage_lines(stages: dict[str, list[tuple[str, str]]], name: str, instruction: str) -> list[str]:
    return [rest for ins, rest in stages[name] if ins == instruction]


def _containerfile_uid() -> int:
    users = _stage_lines(_stages(), list(_stages())[-1], "USER")
    return int(users[-1])


def test_the_image_runs_the_console_script() -> None:
    stages = _stages()
    final = list(stages)[-1]  # what `docker build` builds without --target
    (entrypoint,) = _stage_lines(stages, final, "ENTRYPOINT")
    command = json.loads(entrypoint)
    scripts = _pyproject()["project"]["scripts"]
    # tini (PID 1: reaps the driver's JVM, forwards SIGTERM), then the console script
    assert command[:2] == ["tini", "--"]
    assert command[2] in scripts and scripts[command[2]] == "ingest.console:main"
    assert _containerfile_uid() != 0


def test_the_image_installs_the_packages_pyproject_names() -> None:
    stages = _stages()
    base = stages["base"]
    (source,) = [rest for ins, rest in base if ins == "FROM"]
    python = re.fullmatch(r"python:(\d+\.\d+)-slim-\w+ AS base", source)
    assert python is not None, source
    assert _pyproject()["project"]["requires-python"] == f">={python.group(1)}"
    copied = set()
    for ins, rest in base:
        if ins == "COPY":
            copied.update(rest.split()[:-1])
    for path in copied:
        assert (ROOT / path).exists(), path
    packages = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= copied
    assert {"pyproject.toml", _pyproject()["project"]["readme"]} <= copied
    env = " ".join(rest for ins, rest in base if ins == "ENV")
    assert f"/opt/sluice/venv/lib/python{python.group(1)}/site-packages/pyspark" in env
    # `pip install sluice` alone has no Spark, Arrow or TLS checks: an image that serves takes the extra
    installs = [rest for ins, rest in base if ins == "RUN" and "pip install" in rest]
    assert any("'/tmp/sluice-src[server]'" in rest for rest in installs), installs
    assert "server" in _pyproject()["project"]["optional-dependencies"]


def test_the_executor_image_starts_sparks_executor(tmp_path: Path) -> None:
    stages = _stages()
    (entrypoint,) = _stage_lines(stages, "spark-executor", "ENTRYPOINT")
    script = json.loads(entrypoint)[-1]
    copies = _stage_lines(stages, "spark-executor", "COPY")
    assert f"deploy/spark-executor-entrypoint.sh {script}" in copies
    # run it against a stand-in java that prints what it was given: the environment Spark sets on an
    # executor pod becomes KubernetesExecutorBackend's command line
    java_home = tmp_path / "java"
    (java_home / "bin").mkdir(parents=True)
    fake = java_home / "bin" / "java"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    env = {
        "PATH": os.environ["PATH"],
        "JAVA_HOME": str(java_home),
        "SPARK_HOME": "/spark",
        "SPARK_EXECUTOR_MEMORY": "2g",
        "SPARK_DRIVER_URL": "spark://CoarseGrainedScheduler@sluice-driver:7078",
        "SPARK_EXECUTOR_ID": "3",
        "SPARK_EXECUTOR_CORES": "1",
        "SPARK_APPLICATION_ID": "spark-app",
        "SPARK_EXECUTOR_POD_IP": "10.0.0.7",
        "SPARK_RESOURCE_PROFILE_ID": "0",
        "SPARK_EXECUTOR_POD_NAME": "sluice-exec-1",
        # Spark numbers the JVM options; 10 must come after 2
        "SPARK_JAVA_OPT_10": "-Dlast=1",
        "SPARK_JAVA_OPT_2": "-Dsecond=1",
        "SPARK_JAVA_OPT_0": "-Dfirst=1",
    }
    result = subprocess.run(
        ["bash", str(DEPLOY / "spark-executor-entrypoint.sh"), "executor"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env=env,
    )
    argv = result.stdout.splitlines()
    assert argv[:5] == ["-Dfirst=1", "-Dsecond=1", "-Dlast=1", "-Xms2g", "-Xmx2g"]
    backend = "org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend"
    assert argv[5:8] == ["-cp", "/spark/conf:/spark/jars/*", backend]
    given = dict(zip(argv[8::2], argv[9::2], strict=True))
    assert given == {
        "--driver-url": env["SPARK_DRIVER_URL"],
        "--executor-id": "3",
        "--cores": "1",
        "--app-id": "spark-app",
        "--hostname": "10.0.0.7",
        "--resourceProfileId": "0",
        "--podName": "sluice-exec-1",
    }
    # anything but "executor" runs as given
    passthrough = subprocess.run(
        ["bash", str(DEPLOY / "spark-executor-entrypoint.sh"), "echo", "as given"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env=env,
    )
    assert passthrough.stdout == "as given\n"


def test_pyspark_ships_the_executor_backend_the_image_starts() -> None:
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    wanted = "org/apache/spark/scheduler/cluster/k8s/KubernetesExecutorBackend.class"
    found = False
    for jar in jars.glob("spark-kubernetes_*.jar"):
        with zipfile.ZipFile(jar) as archive:
            found = found or wanted in archive.namelist()
    assert found
