"""Static checks of docker/: the image and the compose file agree with the code they run.

No Docker engine is needed (the CI machine has none): the files are parsed, every command a
service runs is resolved against the real CLI, pipelines and example functions, and every
path, topic, bucket, volume and credential is cross-checked between the services.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pyarrow.fs as pafs
import pytest
import yaml

from snapline.pipeline.cli import main as snapline_cli
from snapline.pipeline.graph import Pipeline, load_pipeline
from snapline.pipeline.runtime.departed import check_worker_id
from snapline.pipeline.runtime.worker import STOP_BOUND
from snapline.sinks import KafkaSink, ParquetSink

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
DOCKERIGNORE = DOCKER / "Dockerfile.dockerignore"
COMPOSE_FILE = DOCKER / "compose.yaml"
KUBERNETES_FILE = DOCKER / "kubernetes.yaml"
#: Where the code that reads SNAPLINE_* variables lives (not tests: this file names them too).
CODE_DIRS = ("snapline", "examples")

EXPECTED_SERVICES = {
    "kafka",
    "kafka-init",
    "minio",
    "minio-init",
    "worker-1",
    "worker-2",
    "producer",
    "spark",
}


# --------------------------------------------------------------------------- Dockerfile


@dataclass
class Stage:
    name: str
    parent: str  #: the FROM image, or the name of an earlier stage
    instructions: list[tuple[str, str]] = field(default_factory=list)


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        result.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return result


def parse_stages(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name."""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for keyword, rest in dockerfile_instructions(text):
        if keyword == "FROM":
            words = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else image
            current = Stage(name, image)
            stages[name] = current
        elif current is None:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            key, _, default = rest.partition("=")
            args[key] = default
        else:
            current.instructions.append((keyword, rest))
    return args, stages


def stage_chain(stages: dict[str, Stage], target: str) -> list[Stage]:
    """The stage and its ancestors, oldest first."""
    chain = [stages[target]]
    while chain[0].parent in stages:
        chain.insert(0, stages[chain[0].parent])
    return chain


def exec_form(value: str) -> list[str]:
    if value.startswith("["):
        parsed = json.loads(value)
        assert isinstance(parsed, list) and all(isinstance(v, str) for v in parsed)
        return parsed
    return shlex.split(value)


def env_pairs(args: str) -> dict[str, str]:
    if "=" not in args.split()[0]:  # legacy ``ENV KEY value``
        key, _, value = args.partition(" ")
        return {key: value.strip()}
    return dict(word.split("=", 1) for word in shlex.split(args))


@dataclass(frozen=True)
class Image:
    """What a build target runs with: entrypoint, command, user, environment."""

    entrypoint: list[str]
    cmd: list[str]
    user: str
    env: dict[str, str]


def image_of(stages: dict[str, Stage], target: str) -> Image:
    entrypoint: list[str] = []
    cmd: list[str] = []
    user = "root"
    env: dict[str, str] = {}
    for stage in stage_chain(stages, target):
        for keyword, rest in stage.instructions:
            if keyword == "ENTRYPOINT":
                entrypoint, cmd = exec_form(rest), []
            elif keyword == "CMD":
                cmd = exec_form(rest)
            elif keyword == "USER":
                user = rest
            elif keyword == "ENV":
                env.update(env_pairs(rest))
    return Image(entrypoint, cmd, user, env)


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    return parse_stages(DOCKERFILE.read_text())


# --------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def service_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(v) for v in value]


@dataclass(frozen=True)
class Run:
    """How one service built from docker/Dockerfile runs: its argv and its environment."""

    name: str
    argv: list[str]
    env: dict[str, str]
    service: dict[str, Any]


def image_services(compose: dict[str, Any], stages: dict[str, Stage]) -> Iterator[Run]:
    """Every service built from docker/Dockerfile, with its entrypoint and command resolved."""
    for name, service in compose["services"].items():
        build = service.get("build")
        if not build:
            continue
        image = image_of(stages, build.get("target") or list(stages)[-1])
        entrypoint = as_list(service["entrypoint"]) if "entrypoint" in service else None
        command = as_list(service["command"]) if "command" in service else None
        if entrypoint is not None:
            argv = entrypoint + (command or [])
        else:
            argv = image.entrypoint + (command if command is not None else image.cmd)
        yield Run(name, argv, {**image.env, **service_env(service)}, service)


@pytest.fixture(scope="module")
def runs(
    compose: dict[str, Any], dockerfile: tuple[dict[str, str], dict[str, Stage]]
) -> dict[str, Run]:
    return {run.name: run for run in image_services(compose, dockerfile[1])}


def snapline_run_services(runs: dict[str, Run]) -> list[Run]:
    found = [r for r in runs.values() if r.argv[:2] == ["snapline", "run"]]
    assert found, "no service runs `snapline run`"
    return found


def parse_snapline(argv: list[str]) -> dict[str, Any]:
    """Parse ``snapline <command> ...`` exactly as the CLI would (the environment included)."""
    assert argv[0] == "snapline"
    assert argv[1] in snapline_cli.commands, f"snapline has no command {argv[1]!r}"
    command = snapline_cli.commands[argv[1]]
    options = {opt for param in command.params for opt in param.opts if opt.startswith("--")}
    for word in argv[2:]:
        if word.startswith("--"):
            assert word.split("=", 1)[0] in options, (
                f"`snapline {argv[1]}` has no option {word}; it has {sorted(options)}"
            )
    try:
        ctx = command.make_context(f"snapline {argv[1]}", list(argv[2:]))
    except click.ClickException as exc:
        pytest.fail(f"`{shlex.join(argv)}` does not parse: {exc.format_message()}")
    return dict(ctx.params)


def use_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Exactly the SNAPLINE_*/AWS_* variables of ``env``: none leak in from the test run."""
    for key in list(os.environ):
        if key.startswith(("SNAPLINE_", "AWS_")):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def load_fresh(spec: str, monkeypatch: pytest.MonkeyPatch) -> Pipeline:
    """Load ``spec`` with the current environment (examples read it at import time)."""
    module = spec.partition(":")[0]
    for name in list(sys.modules):
        if name == module or name.startswith(module + "."):
            monkeypatch.delitem(sys.modules, name)
    pipeline = load_pipeline(spec)
    pipeline.validate()
    return pipeline


def python_c_script(run: Run) -> str:
    assert run.argv[:2] == ["python", "-c"], f"{run.name}: {run.argv[:2]}"
    return run.argv[2]


def literal_calls(script: str) -> dict[str, tuple[list[Any], dict[str, Any]]]:
    """Calls of imported functions in a ``python -c`` script with their literal arguments."""
    tree = ast.parse(script)
    imported = {
        alias.asname or alias.name: (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    calls: dict[str, tuple[list[Any], dict[str, Any]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id not in imported:
                continue
            module, attr = imported[node.func.id]
            func = getattr(importlib.import_module(module), attr)
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
            inspect.signature(func).bind(*args, **kwargs)  # raises if the call would
            calls[attr] = (args, kwargs)
    return calls


# --------------------------------------------------------------------------- Dockerfile tests


def test_dockerfile_base_user_entrypoint_and_targets(
    dockerfile: tuple[dict[str, str], dict[str, Stage]], compose: dict[str, Any]
) -> None:
    _, stages = dockerfile
    roots = {stage_chain(stages, name)[0].parent for name in stages}
    assert roots == {"python:3.11-slim"}
    assert list(stages)[-1] == "worker", "the worker image must be the default target"
    worker = image_of(stages, "worker")
    assert worker.entrypoint == ["snapline"]
    assert worker.cmd[:1] == ["run"]
    targets = {
        s["build"].get("target") or list(stages)[-1]
        for s in compose["services"].values()
        if s.get("build")
    }
    assert targets <= set(stages)
    for target in targets | {list(stages)[-1]}:
        assert image_of(stages, target).user not in ("", "root", "0"), f"{target} runs as root"


def test_dockerfile_copy_sources_exist_and_pass_the_ignore_file(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    ignore = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources: list[str] = []
    for stage in dockerfile[1].values():
        for keyword, rest in stage.instructions:
            if keyword not in ("COPY", "ADD"):
                continue
            words = exec_form(rest) if rest.startswith("[") else rest.split()
            flags = [w for w in words if w.startswith("--")]
            if any(f.startswith("--from=") for f in flags):
                continue
            sources += [w for w in words if not w.startswith("--")][:-1]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
        if "*" in ignore:
            top = Path(source).parts[0]
            assert f"!{top}" in ignore, f"{DOCKERIGNORE.name} leaves {top} out of the context"


def test_dockerfile_default_command_runs_a_loadable_pipeline(
    dockerfile: tuple[dict[str, str], dict[str, Stage]], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = image_of(dockerfile[1], "worker")
    use_env(monkeypatch, worker.env)
    params = parse_snapline(worker.entrypoint + worker.cmd)
    assert params["bootstrap_servers"], "without Kafka settings the image would need Java"
    load_fresh(params["spec"], monkeypatch)


# --------------------------------------------------------------------------- Kubernetes


@pytest.fixture(scope="module")
def kubernetes() -> dict[str, dict[str, Any]]:
    """docker/kubernetes.yaml's objects by kind (one of each)."""
    objects = [o for o in yaml.safe_load_all(KUBERNETES_FILE.read_text()) if o]
    by_kind = {o["kind"]: o for o in objects}
    assert len(by_kind) == len(objects), "one object of each kind"
    assert set(by_kind) == {"Service", "StatefulSet"}
    return by_kind


def worker_container(kubernetes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (container,) = kubernetes["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    return container


def pod_env(container: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet would set it in pod ``pod_name`` (secrets
    stand in as a placeholder)."""
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "fieldRef" in item["valueFrom"]:
            assert item["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[item["name"]] = pod_name
        else:
            assert "secretKeyRef" in item["valueFrom"], item
            env[item["name"]] = "from-a-secret"
    return env


def pod_names(kubernetes: dict[str, dict[str, Any]]) -> list[str]:
    sts = kubernetes["StatefulSet"]
    return [f"{sts['metadata']['name']}-{i}" for i in range(int(sts["spec"]["replicas"]))]


def test_kubernetes_pods_run_a_loadable_pipeline_each_under_its_own_stable_worker_id(
    kubernetes: dict[str, dict[str, Any]],
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    container = worker_container(kubernetes)
    assert container["image"] == "snapline-worker:local"
    image = image_of(dockerfile[1], "worker")
    argv = image.entrypoint + [str(a) for a in container["args"]]
    # The worker id must follow the pod, not be one literal every replica shares.
    (worker_id,) = [e for e in container["env"] if e["name"] == "SNAPLINE_WORKER_ID"]
    assert worker_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "--worker-id" not in argv
    seen = set()
    for pod in pod_names(kubernetes):
        with monkeypatch.context() as patch:
            use_env(patch, {**image.env, **pod_env(container, pod)})
            params = parse_snapline(argv)
            assert params["worker_id"] == pod
            check_worker_id(params["worker_id"])
            pipeline = load_fresh(params["spec"], patch)
            uri = params["checkpoint_dir"]
            # Shared by every pod: a URI, never the container's own disk.
            assert uri and uri.startswith("s3://"), uri
            fs, _ = pafs.FileSystem.from_uri(uri)  # offline: validates the query parameters
            assert isinstance(fs, pafs.S3FileSystem)
        assert pipeline.sources()
        seen.add(params["worker_id"])
    assert len(seen) == len(pod_names(kubernetes)) >= 2


def test_kubernetes_local_state_is_on_the_pods_own_volume(
    kubernetes: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    sts = kubernetes["StatefulSet"]
    container = worker_container(kubernetes)
    with monkeypatch.context() as patch:
        use_env(patch, pod_env(container, pod_names(kubernetes)[0]))
        local_dir = parse_snapline(["snapline", *map(str, container["args"])])["local_dir"]
    assert local_dir, "without --local-dir the state would go to the container's home"
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in container["volumeMounts"]}
    claims = {c["metadata"]["name"]: c for c in sts["spec"]["volumeClaimTemplates"]}
    volume = mounts.get(local_dir.rstrip("/"))
    # A claim per pod follows the pod to another node: local recovery and the incarnation
    # token (runtime/incarnation.py) survive a reschedule.
    assert volume in claims, f"{local_dir} is not a volume claim template's mount"
    assert claims[volume]["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_kubernetes_pods_stop_within_their_grace_period_as_the_images_user(
    kubernetes: dict[str, dict[str, Any]],
) -> None:
    pod = kubernetes["StatefulSet"]["spec"]["template"]["spec"]
    # SIGTERM: a final checkpoint, then exit within STOP_BOUND; the kubelet's SIGKILL after
    # the grace period must not come first.
    assert pod["terminationGracePeriodSeconds"] >= STOP_BOUND + 15
    uid = re.search(r"--uid (\d+)", DOCKERFILE.read_text())
    assert uid, "the Dockerfile creates no user with a fixed uid"
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == security["fsGroup"] == int(uid.group(1))
    assert "livenessProbe" not in worker_container(kubernetes), "the worker has its own watchdog"


def test_kubernetes_service_governs_the_statefulset_and_its_metrics_port(
    kubernetes: dict[str, dict[str, Any]],
) -> None:
    service, sts = kubernetes["Service"], kubernetes["StatefulSet"]
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    container = worker_container(kubernetes)
    env = pod_env(container, pod_names(kubernetes)[0])
    port = int(env["SNAPLINE_METRICS_PORT"])
    assert env["SNAPLINE_METRICS_HOST"] == "0.0.0.0", "scrapers reach the pod from elsewhere"
    assert [p["containerPort"] for p in container["ports"]] == [port]
    assert [p["port"] for p in service["spec"]["ports"]] == [port]


def test_kubernetes_credentials_come_from_a_secret(
    kubernetes: dict[str, dict[str, Any]],
) -> None:
    env = {e["name"]: e for e in worker_container(kubernetes)["env"]}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "value" not in env[name], f"{name} is written into the manifest"
        assert env[name]["valueFrom"]["secretKeyRef"]["key"] == name


# --------------------------------------------------------------------------- compose tests


def test_compose_has_every_service_and_resolves_references(compose: dict[str, Any]) -> None:
    services = compose["services"]
    missing = EXPECTED_SERVICES - set(services)
    assert not missing, f"compose.yaml lacks the services {sorted(missing)}"
    declared_volumes = set(compose.get("volumes") or {})
    for name, service in services.items():
        for target, spec in (service.get("depends_on") or {}).items():
            assert target in services, f"{name} depends on unknown service {target}"
            if spec.get("condition") == "service_healthy":
                assert services[target].get("healthcheck"), f"{target} has no healthcheck"
        for volume in service.get("volumes") or []:
            source = str(volume).split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared_volumes, f"{name}: volume {source} is not declared"
        build = service.get("build")
        if build:
            context = (COMPOSE_FILE.parent / build["context"]).resolve()
            assert context == ROOT, f"{name}: build context {context} is not the repository"
            assert (context / build["dockerfile"]).resolve() == DOCKERFILE


def test_kafka_is_a_single_node_kraft_broker_ready_for_transactions(
    compose: dict[str, Any],
) -> None:
    kafka = compose["services"]["kafka"]
    assert re.fullmatch(r"apache/kafka:4\.\d+\.\d+", kafka["image"])
    env = service_env(kafka)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    for key in (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
    ):
        assert env[key] == "1", key
    assert env["KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS"] == "0"
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert kafka["healthcheck"]["test"]


def test_every_snapline_command_parses_and_its_pipeline_loads(
    runs: dict[str, Run], compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = compose["services"]
    for run in snapline_run_services(runs):
        with monkeypatch.context() as patch:
            use_env(patch, run.env)
            params = parse_snapline(run.argv)
            pipeline = load_fresh(params["spec"], patch)
        for server in params["bootstrap_servers"].split(","):
            host, _, port = server.rpartition(":")
            assert host in services, f"{run.name}: bootstrap host {host} is no service"
            listeners = service_env(services[host])["KAFKA_LISTENERS"]
            assert f":{port}" in listeners, f"{run.name}: {host} does not listen on {port}"
        assert pipeline.sources()


def test_worker_ids_are_given_and_distinct(
    runs: dict[str, Run], monkeypatch: pytest.MonkeyPatch
) -> None:
    ids: dict[str, str] = {}
    for run in snapline_run_services(runs):
        with monkeypatch.context() as patch:
            use_env(patch, run.env)
            worker_id = parse_snapline(run.argv)["worker_id"]
        # Without one a worker uses its hostname, which is a fresh container id on each start.
        assert worker_id, f"{run.name} has no --worker-id"
        assert worker_id not in ids, f"{run.name} and {ids.get(worker_id)} share {worker_id}"
        ids[worker_id] = run.name
        assert "replicas" not in (run.service.get("deploy") or {}), "replicas share one id"
    assert len(ids) >= 2


def test_checkpoints_go_to_the_minio_bucket_with_its_credentials(
    runs: dict[str, Run], compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = compose["services"]
    minio = service_env(services["minio"])
    mc_host = urlsplit(service_env(services["minio-init"])["MC_HOST_local"])
    assert (mc_host.username, mc_host.password) == (
        minio["MINIO_ROOT_USER"],
        minio["MINIO_ROOT_PASSWORD"],
    )
    mb = as_list(services["minio-init"]["command"])
    assert mb[0] == "mb"
    bucket = mb[-1].split("/", 1)[1]
    for run in snapline_run_services(runs):
        with monkeypatch.context() as patch:
            use_env(patch, run.env)
            uri = parse_snapline(run.argv)["checkpoint_dir"]
            assert uri and uri.startswith("s3://"), f"{run.name}: checkpoints in {uri!r}"
            # Offline: from_uri validates the query parameters without contacting the store.
            fs, path = pafs.FileSystem.from_uri(uri)
        assert isinstance(fs, pafs.S3FileSystem)
        options = fs.__reduce__()[1][0]
        host = options["endpoint_override"].rsplit(":", 1)[0]
        assert host == "minio" and options["scheme"] == "http", options
        assert path.split("/")[0] == bucket, f"{run.name}: bucket of {uri} is not {bucket}"
        assert run.env["AWS_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"]
        assert run.env["AWS_SECRET_ACCESS_KEY"] == minio["MINIO_ROOT_PASSWORD"]
        needs = services[run.name]["depends_on"]
        for init in ("kafka-init", "minio-init"):
            assert needs[init]["condition"] == "service_completed_successfully"


def test_topics_producer_and_spark_match_the_pipeline(
    runs: dict[str, Run], compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = compose["services"]
    topics_args, _ = literal_calls(python_c_script(runs["kafka-init"]))["create_topics"]
    bootstrap, topics = topics_args
    produce_args, _ = literal_calls(python_c_script(runs["producer"]))["produce_orders"]
    assert bootstrap == produce_args[0] == "kafka:9092"
    spark = runs["spark"]
    assert spark.argv[:3] == ["python", "-m", "examples.spark_analytics"]
    assert importlib.util.find_spec("examples.spark_analytics") is not None
    table = spark.argv[3]
    spark_volumes = {str(v).split(":")[0] for v in services["spark"].get("volumes") or []}
    for run in snapline_run_services(runs):
        with monkeypatch.context() as patch:
            use_env(patch, run.env)
            pipeline = load_fresh(parse_snapline(run.argv)["spec"], patch)
        kafka_sinks = [s.topic for s in pipeline.sinks() if isinstance(s, KafkaSink)]
        assert set(pipeline.source_topics()) | set(kafka_sinks) <= set(topics)
        assert produce_args[1] in pipeline.source_topics()
        tables = [str(s.path) for s in pipeline.sinks() if isinstance(s, ParquetSink)]
        assert tables == [table], f"{run.name} writes {tables}, spark reads {table}"
        mounts = [str(v).split(":")[:2] for v in run.service.get("volumes") or []]
        shared = [src for src, dst in mounts if table.startswith(dst.rstrip("/") + "/")]
        assert shared and shared[0] in spark_volumes, f"{table} is not on a volume spark mounts"


def test_snapline_variables_set_in_docker_files_are_read_by_the_code(
    runs: dict[str, Run], kubernetes: dict[str, dict[str, Any]]
) -> None:
    code = "\n".join(
        path.read_text() for d in CODE_DIRS for path in sorted((ROOT / d).rglob("*.py"))
    )
    names = {k for run in runs.values() for k in run.env if k.startswith("SNAPLINE_")}
    names |= {e["name"] for e in worker_container(kubernetes)["env"]}
    names = {n for n in names if n.startswith("SNAPLINE_")}
    assert names
    unread = sorted(n for n in names if not re.search(rf"\b{n}\b", code))
    assert not unread, f"no code reads {unread}"
