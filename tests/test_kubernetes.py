"""``shardwire kubernetes``: the manifests validate against Kubernetes' schemas, every
option reaches its field, the YAML reads back as written, the committed example is a
fresh rendering, and the rendered pods' commands and environment run a real job."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from shardwire.coordinator.__main__ import settings_from
from shardwire.worker.launcher.cli import parser as worker_parser
from shardwire.worker.launcher.kubernetes import main, render
from shardwire.worker.launcher.manifests import (
    COORDINATOR_REPLACEMENTS,
    Deployment,
    default_shm_bytes,
    manifests,
    quantity,
)
from shardwire.worker.launcher.options import LaunchSettings
from shardwire.worker.launcher.yamldoc import dump_all, scalar

from .docblocks import block
from .e2e.cli import ROOT, SHARDWIRE
from .etcdserver import free_ports

# The oldest release with everything the manifests use (podReplacementPolicy on by
# default), and the newest the validator ships.
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
BASE = ["--name", "digits", "--nodes", "2", "--nproc-per-node", "2"]
SCRIPT = ["examples/digits.py", "--steps", "200"]
Doc = dict[str, Any]


def rendered(*argv: str) -> dict[tuple[str, str], Doc]:
    """(kind, name) -> document of ``shardwire kubernetes ARGV``, read by PyYAML."""
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(render([*argv]))}


def pod(docs: dict[tuple[str, str], Doc], job: str) -> Doc:
    return docs["Job", job]["spec"]["template"]["spec"]


def container(docs: dict[tuple[str, str], Doc], job: str) -> Doc:
    (only,) = pod(docs, job)["containers"]
    return only


def env_of(c: Doc) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def coordinator_settings(docs: dict[tuple[str, str], Doc], job: str):
    args = container(docs, f"{job}-coordinator")["args"]
    assert args[0] == "coordinator"
    return settings_from(args[1:])  # the coordinator's own parser and settings


def worker_settings(docs: dict[tuple[str, str], Doc], job: str, monkeypatch) -> LaunchSettings:
    """What ``shardwire worker`` makes of the rendered environment (token and pod name
    as Kubernetes would fill them in)."""
    for key in [k for k in os.environ if k.startswith("SHARDWIRE_")]:
        monkeypatch.delenv(key)
    for name, value in env_of(container(docs, job)).items():
        if isinstance(value, dict):  # valueFrom
            ref = "the-token" if "secretKeyRef" in value else f"{job}-0-abcde"
            monkeypatch.setenv(name, ref)
        else:
            monkeypatch.setenv(name, value)
    return LaunchSettings()


# --- schemas --------------------------------------------------------------------------

PARAMETER_SETS = {
    "one node": ["--name", "solo", "examples/hello.py"],
    "two nodes": [*BASE, *SCRIPT],
    "eight nodes": [
        "--name",
        "big-job",
        "--namespace",
        "ml",
        "--nodes",
        "8",
        "--nproc-per-node",
        "8",
        "--image",
        "registry.example/team/shardwire:1.2",
        "--max-restarts",
        "3",
        "--join-timeout",
        "12.5",
        "--token-secret",
        "team.token",
        "--cpu",
        "7500m",
        "--memory",
        "30Gi",
        "--shm-size",
        "1.5Gi",
        "-m",
        "pkg.train",
        "--lr",
        "3e-4",
        "on",
    ],
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("argv", PARAMETER_SETS.values(), ids=PARAMETER_SETS.keys())
def test_every_document_validates_against_the_kubernetes_schemas(argv, version) -> None:
    docs = list(yaml.safe_load_all(render(argv)))
    kinds = ["Service", "PersistentVolumeClaim", "Job", "Service", "Job"]
    assert [d["kind"] for d in docs] == kinds
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("argv", PARAMETER_SETS.values(), ids=PARAMETER_SETS.keys())
def test_the_yaml_reads_back_as_the_objects_built(argv) -> None:
    from shardwire.worker.launcher.kubernetes import deployment, parser

    objects = manifests(deployment(parser().parse_args(argv)))
    assert list(yaml.safe_load_all(render(argv))) == objects


# --- invalid options ------------------------------------------------------------------

INVALID = {
    "upper-case name": (["--name", "Digits"], "DNS-1035 label"),
    "name starts with a digit": (["--name", "1job"], "DNS-1035 label"),
    "name ends with a dash": (["--name", "job-"], "DNS-1035 label"),
    "name too long": (["--name", "a" * 52], "may have 51 at most"),
    "no name": ([], "--name"),
    "zero nodes": (["--name", "j", "--nodes", "0"], "expected 1 to"),
    "zero processes": (["--name", "j", "--nproc-per-node", "0"], "expected 1 to"),
    "negative restarts": (["--name", "j", "--max-restarts", "-1"], "expected 0 to"),
    "zero join timeout": (["--name", "j", "--join-timeout", "0"], "seconds > 0"),
    "nan join timeout": (["--name", "j", "--join-timeout", "nan"], "seconds > 0"),
    "port out of range": (["--name", "j", "--port", "70000"], "expected 1 to 65535"),
    "same ports": (["--name", "j", "--http-port", "29400"], "must differ"),
    "no cpu": (["--name", "j", "--cpu", "0"], "CPUs"),
    "bad memory": (["--name", "j", "--memory", "2GB"], "bytes"),
    "zero shm": (["--name", "j", "--shm-size", "0"], "bytes"),
    "bad namespace": (["--name", "j", "--namespace", "My_NS"], "DNS-1123 label"),
    "bad secret": (["--name", "j", "--token-secret", "Token"], "DNS-1123 subdomain"),
    "bad image": (["--name", "j", "--image", "a b"], "image reference"),
}


@pytest.mark.parametrize(("argv", "message"), INVALID.values(), ids=INVALID.keys())
def test_invalid_options_exit_2_with_the_reason(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        render([*argv, "train.py"])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_an_argument_yaml_cannot_hold_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        render(["--name", "j", "train.py", "caf\udce9"])  # undecodable bytes in argv
    assert stop.value.code == 2
    assert "lone surrogate" in capsys.readouterr().err


@pytest.mark.e2e
def test_the_longest_name_fits_and_the_command_refuses_bad_ones() -> None:
    name = "a" * 51
    assert ("Job", f"{name}-coordinator") in rendered("--name", name, "train.py")
    done = subprocess.run(
        [SHARDWIRE, "kubernetes", "--name", "Bad", "train.py"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "DNS-1035" in done.stderr and not done.stdout


# --- every option reaches its fields --------------------------------------------------


def test_name_names_every_object_and_the_run(monkeypatch) -> None:
    docs = rendered("--name", "mnist", "train.py")
    assert set(docs) == {
        ("Service", "mnist-coordinator"),
        ("PersistentVolumeClaim", "mnist-coordinator-state"),
        ("Job", "mnist-coordinator"),
        ("Service", "mnist"),
        ("Job", "mnist"),
    }
    for (_kind, name), doc in docs.items():
        component = "coordinator" if "-coordinator" in name else "worker"
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "mnist"
        assert labels["app.kubernetes.io/component"] == component
        assert labels["app.kubernetes.io/name"] == "shardwire"
    for service in ("mnist", "mnist-coordinator"):
        job = docs["Job", service]
        selector = docs["Service", service]["spec"]["selector"]
        assert selector.items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert docs["Service", "mnist"]["spec"]["clusterIP"] == "None"
    assert pod(docs, "mnist")["subdomain"] == "mnist"
    assert coordinator_settings(docs, "mnist").run_id == "mnist"
    settings = worker_settings(docs, "mnist", monkeypatch)
    assert settings.run_id == "mnist"
    assert settings.coordinator == "mnist-coordinator:29400"
    assert settings.node_id == "mnist-0-abcde"  # the pod's name
    assert settings.token is not None and settings.token.get_secret_value() == "the-token"


def test_nodes_and_processes_shape_the_world(monkeypatch) -> None:
    docs = rendered("--name", "j", "--nodes", "5", "--nproc-per-node", "3", "t.py")
    spec = docs["Job", "j"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 5
    assert docs["Job", "j-coordinator"]["spec"]["completions"] == 1
    assert coordinator_settings(docs, "j").world_size == 15
    settings = worker_settings(docs, "j", monkeypatch)
    assert (settings.nnodes, settings.nproc_per_node) == ("5", 3)
    resources = container(docs, "j")["resources"]
    shm = default_shm_bytes(3)
    assert resources["limits"] == {"cpu": "3", "memory": quantity(3 * (1 << 30) + shm)}
    assert resources["requests"] == resources["limits"]


def test_max_restarts_reach_the_coordinator_the_agents_and_the_backoff_limit(
    monkeypatch,
) -> None:
    for restarts in (0, 3):
        docs = rendered("--name", "j", "--max-restarts", str(restarts), "t.py")
        assert coordinator_settings(docs, "j").max_restarts == restarts
        assert worker_settings(docs, "j", monkeypatch).max_restarts == restarts
        assert docs["Job", "j"]["spec"]["backoffLimit"] == restarts
        # a lost coordinator pod is replaced on its claim, however many restarts the job has
        assert docs["Job", "j-coordinator"]["spec"]["backoffLimit"] == COORDINATOR_REPLACEMENTS


def test_recovery_reaches_the_agents(monkeypatch) -> None:
    assert worker_settings(rendered("--name", "j", "t.py"), "j", monkeypatch).recovery == "live"
    docs = rendered("--name", "j", "--recovery", "relaunch", "--max-restarts", "2", "t.py")
    assert worker_settings(docs, "j", monkeypatch).recovery == "relaunch"


def test_join_timeout_reaches_the_coordinator_and_the_agents(monkeypatch) -> None:
    docs = rendered("--name", "j", "--join-timeout", "12.5", "t.py")
    assert coordinator_settings(docs, "j").join_timeout == 12.5
    assert worker_settings(docs, "j", monkeypatch).join_timeout == 12.5
    assert "300" in env_of(container(rendered("--name", "j", "t.py"), "j")).values()


def test_ports_reach_the_coordinator_its_container_its_service_and_the_workers(
    monkeypatch,
) -> None:
    docs = rendered("--name", "j", "--port", "31000", "--http-port", "31080", "t.py")
    settings = coordinator_settings(docs, "j")
    assert (settings.host, settings.port) == ("0.0.0.0", 31000)
    assert (settings.http_host, settings.http_port) == ("0.0.0.0", 31080)
    c = container(docs, "j-coordinator")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"control": 31000, "http": 31080}
    listed = docs["Service", "j-coordinator"]["spec"]["ports"]
    service = {p["name"]: (p["port"], p["targetPort"]) for p in listed}
    assert service == {"control": (31000, "control"), "http": (31080, "http")}
    assert worker_settings(docs, "j", monkeypatch).coordinator == "j-coordinator:31000"
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {ports[p["port"]] for p in probes.values()} == {31080}
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/healthz"


def test_namespace_reaches_every_object_and_the_secret_hint() -> None:
    text = render(["--name", "j", "--namespace", "ml", "t.py"])
    assert all(d["metadata"]["namespace"] == "ml" for d in yaml.safe_load_all(text))
    assert "kubectl create secret generic j-token --namespace ml" in text
    plain = render(["--name", "j", "t.py"])
    assert not any("namespace" in d["metadata"] for d in yaml.safe_load_all(plain))


def test_image_reaches_both_containers() -> None:
    docs = rendered("--name", "j", "--image", "registry.example/sw:2", "t.py")
    assert {container(docs, job)["image"] for job in ("j", "j-coordinator")} == {
        "registry.example/sw:2"
    }
    assert container(rendered("--name", "j", "t.py"), "j")["image"] == "shardwire:local"


def test_the_token_comes_from_the_secret_never_the_manifest() -> None:
    named = (["--name", "j"], "j-token"), (["--name", "j", "--token-secret", "s"], "s")
    for argv, secret in named:
        docs = rendered(*argv, "t.py")
        for job in ("j", "j-coordinator"):
            token = env_of(container(docs, job))["SHARDWIRE_TOKEN"]
            assert token == {"secretKeyRef": {"name": secret, "key": "token"}}


def test_cpu_memory_and_shm_size_reach_the_resources_and_the_volume() -> None:
    docs = rendered(
        "--name", "j", "--cpu", "3500m", "--memory", "3Gi", "--shm-size", "1.5Gi", "t.py"
    )
    resources = container(docs, "j")["resources"]
    assert resources["requests"] == resources["limits"] == {"cpu": "3500m", "memory": "4608Mi"}
    (shm,) = [v for v in pod(docs, "j")["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1536Mi"}
    mounts = {m["name"]: m["mountPath"] for m in container(docs, "j")["volumeMounts"]}
    assert mounts == {"shm": "/dev/shm", "tmp": "/tmp"}


def test_the_script_module_and_arguments_reach_the_worker_command() -> None:
    docs = rendered("--name", "j", "-m", "pkg.train", "--lr", "3e-4", "--flag", "on")
    c = container(docs, "j")
    assert c["command"] == ["shardwire"]
    assert c["args"] == ["worker", "-m", "pkg.train", "--lr", "3e-4", "--flag", "on"]
    args = worker_parser().parse_args(c["args"])  # what shardwire worker makes of them
    assert (args.module, args.script) == (True, "pkg.train")
    assert args.args == ["--lr", "3e-4", "--flag", "on"]


def test_output_writes_the_same_text_to_a_file(tmp_path, capsys) -> None:
    argv = [*BASE, *SCRIPT]
    assert main(["-o", str(tmp_path / "job.yaml"), *argv]) == 0
    assert capsys.readouterr().out == ""
    assert (tmp_path / "job.yaml").read_text() == render(argv)
    # after the script, -o is the script's
    assert render([*argv, "-o", "x"]).splitlines()[0].endswith("--steps 200 -o x")


def test_the_first_line_is_a_command_that_renders_the_same_text() -> None:
    argv = PARAMETER_SETS["eight nodes"]
    text = render(argv)
    first = text.splitlines()[0]
    assert first.startswith("# Rendered by: shardwire kubernetes ")
    again = shlex.split(first.removeprefix("# Rendered by: shardwire kubernetes "))
    assert render(again) == text


def test_pods_run_as_the_images_user_locked_down() -> None:
    user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert user is not None
    docs = rendered("--name", "shardwire", "t.py")  # the name whose service links collide
    for job in ("shardwire", "shardwire-coordinator"):
        spec = pod(docs, job)
        assert spec["securityContext"]["runAsNonRoot"] is True
        ids = (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"])
        assert ids == (int(user[1]), int(user[2]))
        assert spec["enableServiceLinks"] is False
        assert spec["automountServiceAccountToken"] is False
        assert spec["restartPolicy"] == "Never"
        security = container(docs, job)["securityContext"]
        assert security == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
    # the coordinator is reachable while it restarts a generation (/readyz answers 503)
    assert docs["Service", "shardwire-coordinator"]["spec"]["publishNotReadyAddresses"] is True
    assert docs["Job", "shardwire"]["spec"]["podReplacementPolicy"] == "Failed"


# --- /dev/shm -------------------------------------------------------------------------

SHM_TABLE = {1: "64Mi", 2: "64Mi", 3: "80Mi", 4: "112Mi", 8: "208Mi", 16: "400Mi", 32: "784Mi"}


def test_default_shm_holds_four_arenas_and_two_peers_segments_per_rank() -> None:
    page, slot, segment = 4096, 4 << 20, 4096 + 4 * (1 << 20)  # the documented defaults
    for k, text in SHM_TABLE.items():
        arena = k * slot + -(-(page + 512 * k) // page) * page
        need = 4 * arena + k * min(2, k - 1) * segment
        size = default_shm_bytes(k)
        assert max(need, 64 << 20) <= size < max(need, 64 << 20) + (16 << 20), k
        assert quantity(size) == text


def test_the_readme_shows_the_default_shm_sizes() -> None:
    readme = (ROOT / "deploy" / "kubernetes" / "README.md").read_text()
    ks = re.search(r"^\| processes per pod \|(.*)\|$", readme, re.M)
    sizes = re.search(r"^\| default `/dev/shm` \|(.*)\|$", readme, re.M)
    assert ks and sizes
    table = dict(zip(ks[1].split("|"), sizes[1].split("|"), strict=True))
    assert {int(k): v.strip() for k, v in table.items()} == SHM_TABLE


# --- the committed example ------------------------------------------------------------


def test_the_example_is_a_fresh_rendering_of_the_command_on_its_first_line() -> None:
    text = (ROOT / "deploy" / "kubernetes" / "example.yaml").read_text()
    first = text.splitlines()[0]
    prefix = "# Rendered by: shardwire kubernetes "
    assert first.startswith(prefix)
    argv = shlex.split(first.removeprefix(prefix))
    assert argv[:6] == BASE and "examples/digits.py" in argv
    assert render(argv) == text, "deploy/kubernetes/example.yaml is stale: render it again"


# --- the emitter ----------------------------------------------------------------------

TRICKY = [
    "yes",
    "No",
    "ON",
    "off",
    "y",
    "n",
    "true",
    "False",
    "null",
    "Null",
    "~",
    "",
    " ",
    "0700",
    "0x1F",
    "1e3",
    "1_000",
    "1:20",
    "-1",
    "+1",
    ".5",
    "-.inf",
    ".nan",
    "2024-01-01",
    "a: b",
    "a #b",
    "#x",
    "&a",
    "*a",
    "!t",
    "|",
    ">",
    "%x",
    "@x",
    "`x",
    "'q'",
    '"q"',
    "-",
    "--",
    "---",
    "...",
    "- x",
    "? x",
    "key:",
    "a:b",
    "[x]",
    "{x}",
    "a,b",
    "=",
    "<<",
    " lead",
    "trail ",
    "two\nlines",
    "tab\there",
    "back\\slash",
    "nul\x00",
    "del\x7f",
    "nel\x85",
    "ls\u2028",
    "bom\ufeff",
    "café",
    "😀",
    "\ufffe",
    "--steps=3",
    "-m",
    "/tmp/run",
    "shardwire:local",
    "app.kubernetes.io/name",
]


def test_every_string_reads_back_as_itself() -> None:
    doc = {"strings": TRICKY, "keys": {s: s for s in TRICKY}, "n": [0, -7, True, False]}
    text = dump_all([doc])
    assert yaml.safe_load(text) == doc


def test_any_script_argument_reaches_the_worker_as_given() -> None:
    text = render(["--name", "j", "t.py", *TRICKY])  # the first line quotes them too
    docs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(text)}
    (c,) = docs["j"]["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["worker", "t.py", *TRICKY]
    assert text.splitlines()[0].startswith("# Rendered by: ")


def test_yaml_11_keywords_and_numbers_are_quoted_and_names_are_not() -> None:
    for word in ("yes", "On", "NULL", "0700", "1:20", "1e3", "-1"):
        assert scalar(word).startswith('"'), word
    for word in ("digits", "--steps", "/tmp/run", "shardwire:local", "metadata.name"):
        assert scalar(word) == word
    assert (scalar(True), scalar(3)) == ("true", "3")


def test_a_deployment_is_rendered_deterministically() -> None:
    d = Deployment(name="j", command=("t.py",), nodes=3)
    assert dump_all(manifests(d)) == dump_all(manifests(d))


# --- the rendered pods, run on this machine -------------------------------------------


def _as_kubernetes_would(
    c: Doc, *, pod_name: str, secrets: dict, services: set[str], claims: dict[str, Path]
):
    """A container's argv and environment as its pod would see them here: ``valueFrom``
    resolved, Service names and the wildcard address replaced by loopback, and the paths
    where claims are mounted (``claims``: mount path -> a directory here) by theirs."""
    argv = [*c["command"], *c["args"]]
    assert argv[0] == "shardwire"  # the image's entrypoint, on PATH
    local = {"0.0.0.0": "127.0.0.1", **{m: str(d) for m, d in claims.items()}}
    argv = [SHARDWIRE, *(local.get(a, a) for a in argv[1:])]
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SHARDWIRE_", "SLURM_", "PET_")) and k != "JOB_COMPLETION_INDEX"
    }
    for var in c["env"]:
        if "value" in var:
            value = var["value"]
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            value = secrets[ref["name"], ref["key"]]
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
            value = pod_name
        host, sep, port = value.rpartition(":")
        environ[var["name"]] = f"127.0.0.1:{port}" if sep and host in services else value
    return argv, environ


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


# Each pod as a mount namespace: /tmp an empty tmpfs, as the pod's emptyDir, and the
# image's files (this checkout) read-only, as readOnlyRootFilesystem makes them. The
# checkout is bound back from the shell's working directory, so a checkout under /tmp
# (a CI clone) is not hidden by the tmpfs. A pod that could write to it exits 99.
_READ_ONLY_POD = (
    'cd "$0" && mount -t tmpfs -o size=256m tmpfs /tmp && mkdir -p "$0" '
    '&& mount --no-canonicalize -o bind,ro /proc/self/cwd "$0" && cd "$0" '
    '&& ! touch "$0/.read-only-probe" 2>/dev/null || exit 99; exec "$@"'
)


def _read_only(argv: list[str]) -> list[str]:
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        _READ_ONLY_POD,
        str(ROOT),
        *argv,
    ]


def _claims(docs, job: str, tmp_path: Path) -> dict[str, Path]:
    """Where the pods of ``job`` mount claims -> a directory of the claim's here."""
    spec = pod(docs, job)
    volumes = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in spec.get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    mounts = container(docs, job).get("volumeMounts", [])
    return {m["mountPath"]: tmp_path / volumes[m["name"]] for m in mounts if m["name"] in volumes}


def _run_pods(
    docs, name: str, tmp_path: Path, *, read_only: bool = False, lose_coordinator_at: str = ""
) -> list[Path]:
    """Start the rendered pods' commands as local processes (workers first, as Kubernetes
    may start them), wait for the job to end and return each pod's log. With
    ``lose_coordinator_at``: once worker 0 logs it, the coordinator pod is killed and a
    replacement started on the same claim, as the Job's pod replacement does."""
    secrets = {(f"{name}-token", "token"): "kubernetes-test-token"}
    services = {n for kind, n in docs if kind == "Service"}
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []

    def start(c: Doc, pod_name: str, **extra: str) -> subprocess.Popen:
        job = pod_name.rsplit("-", 1)[0] if "coordinator" in pod_name else name
        argv, environ = _as_kubernetes_would(
            c,
            pod_name=pod_name,
            secrets=secrets,
            services=services,
            claims=_claims(docs, job, tmp_path),
        )
        logs.append(tmp_path / f"{pod_name}.log")
        with logs[-1].open("w") as log:
            proc = subprocess.Popen(
                _read_only(argv) if read_only else argv,
                env={**environ, **extra},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        procs.append(proc)
        return proc

    try:
        workers = [
            start(container(docs, name), f"{name}-{i}-x{i}z", JOB_COMPLETION_INDEX=str(i))
            for i in range(2)
        ]
        coordinator = start(container(docs, f"{name}-coordinator"), f"{name}-coordinator-q")
        probes = container(docs, f"{name}-coordinator")
        ports = {p["name"]: p["containerPort"] for p in probes["ports"]}
        ready, live = (probes[k]["httpGet"] for k in ("readinessProbe", "livenessProbe"))
        deadline = time.monotonic() + 90
        while _get(f"http://127.0.0.1:{ports[ready['port']]}{ready['path']}") != 200:
            assert coordinator.poll() is None and time.monotonic() < deadline, logs[-1].read_text()
            time.sleep(0.05)
        assert _get(f"http://127.0.0.1:{ports[live['port']]}{live['path']}") == 200
        if lose_coordinator_at:
            while lose_coordinator_at not in logs[0].read_text():
                assert workers[0].poll() is None and time.monotonic() < deadline + 90
                time.sleep(0.05)
            coordinator.kill()  # its pod lost: the Job starts another on the same claim
            assert coordinator.wait(timeout=30) == -signal.SIGKILL
            replaced = container(docs, f"{name}-coordinator")
            coordinator = start(replaced, f"{name}-coordinator-r")
        codes = [w.wait(timeout=180) for w in workers]
        assert codes == [0, 0], [log.read_text()[-3000:] for log in logs]
        assert coordinator.wait(timeout=30) == 0, logs[-1].read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return logs


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_rendered_pods_run_a_job_on_this_machine(tmp_path: Path) -> None:
    control, http = free_ports(2)
    name = "kube"
    docs = rendered(
        "--name",
        name,
        "--nodes",
        "2",
        "--nproc-per-node",
        "2",
        "--port",
        str(control),
        "--http-port",
        str(http),
        "examples/digits.py",
        "--steps",
        "60",
        "--run-dir",
        str(tmp_path / "run"),
    )
    logs = _run_pods(docs, name, tmp_path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["workers"] == 4
    # JOB_COMPLETION_INDEX is the node rank: pod 0 holds ranks 0 and 1
    assert "[rank0]:" in logs[0].read_text() and "[rank0]:" not in logs[1].read_text()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_coordinator_pod_lost_mid_job_is_replaced_and_resumes_from_its_claim(
    tmp_path: Path,
) -> None:
    control, http = free_ports(2)
    name = "lost"
    docs = rendered(
        "--name",
        name,
        "--nodes",
        "2",
        "--nproc-per-node",
        "1",
        "--port",
        str(control),
        "--http-port",
        str(http),
        "examples/digits.py",
        "--steps",
        "1500",
        "--log-every",
        "100",
        "--run-dir",
        str(tmp_path / "run"),
    )
    logs = _run_pods(docs, name, tmp_path, lose_coordinator_at="step 300/")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["steps"] == 1500
    replaced = logs[-1].read_text()
    said = "coordinator restarted from its journal: generation 1 of 2 ranks; waiting up to 180 s"
    assert said in replaced, replaced[-3000:]
    assert "reconnected to the coordinator" in logs[0].read_text()
    assert (tmp_path / f"{name}-coordinator-state").is_dir()  # the claim, not the root


def _documented_command() -> list[str]:
    """The ``shardwire kubernetes`` command of the clusters page, as a user copies it."""
    commands = block("kubernetes-render").commands()
    (command,) = [c for c in commands if c.startswith("shardwire kubernetes ")]
    return shlex.split(command.split("|", 1)[0])[2:]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_clusters_page_example_runs_with_a_read_only_root(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("a read-only root needs a mount namespace, made here as root")
    probe = subprocess.run(_read_only(["true"]), capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a read-only mount namespace here: {probe.stderr.strip()}")
    argv = _documented_command()
    assert argv[argv.index("--name") + 1] == "digits"
    control, http = free_ports(2)  # the documented ports may be taken on this machine
    docs = rendered("--port", str(control), "--http-port", str(http), *argv)
    logs = _run_pods(docs, "digits", tmp_path, read_only=True)
    assert "held_out_accuracy" in logs[0].read_text()
