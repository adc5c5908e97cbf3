"""The container rules: non-root slim image, health-gated workers, no published peer
ports, no inline secrets."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from shardwire.coordinator.__main__ import settings_from

from .docblocks import block

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_only_the_coordinators_http_port_is_published_on_loopback() -> None:
    services = COMPOSE["services"]
    assert "ports" not in services["worker"]
    (published,) = services["coordinator"]["ports"]
    assert re.fullmatch(r"127\.0\.0\.1:\$\{SHARDWIRE_HTTP_PORT:-\d+\}:29480", published)
    assert "--http-port=29480" in services["coordinator"]["command"]
    assert not any("29400" in str(p) for s in services.values() for p in s.get("ports", []))


def test_workers_wait_for_a_healthy_coordinator() -> None:
    worker = COMPOSE["services"]["worker"]
    assert worker["depends_on"] == {"coordinator": {"condition": "service_healthy"}}
    assert COMPOSE["services"]["coordinator"]["healthcheck"]["test"] == [
        "CMD",
        "shardwire",
        "health",
    ]
    assert worker["deploy"]["replicas"] == "${SHARDWIRE_WORKERS:-3}"


def test_the_token_is_a_secret_never_inline() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    assert "SHARDWIRE_TOKEN=" not in text and "SHARDWIRE_TOKEN:" not in text
    assert COMPOSE["secrets"]["shardwire_token"] == {
        "file": "${SHARDWIRE_TOKEN_FILE:-.secrets/token}"
    }
    for service in COMPOSE["services"].values():
        assert service["secrets"] == ["shardwire_token"]
        assert "--token-file=/run/secrets/shardwire_token" in service["command"]


def test_the_image_is_multi_stage_slim_non_root_and_health_checked() -> None:
    assert "ARG BASE_IMAGE=python:3.11-slim" in DOCKERFILE
    stages = re.findall(r"^FROM \$\{BASE_IMAGE\} AS (\w+)", DOCKERFILE, re.M)
    assert stages == ["build", "runtime"]
    runtime = DOCKERFILE.split("AS runtime", 1)[1]
    assert re.search(r"^USER \d+:\d+$", runtime, re.M)  # numeric, non-root
    assert 'CMD ["shardwire", "health"]' in runtime
    assert 'ENTRYPOINT ["shardwire"]' in runtime
    assert "uv" not in runtime.replace("/opt/venv", "")  # no build tools in the final stage


def test_workers_restart_and_resume_from_a_shared_checkpoint_volume() -> None:
    worker = COMPOSE["services"]["worker"]
    assert worker["restart"] == "on-failure"
    command = worker["command"]
    assert "--max-restarts=${SHARDWIRE_MAX_RESTARTS:-3}" in command
    ckpt = next(arg for arg in command if arg.startswith("--checkpoint-dir="))
    assert worker["volumes"] == ["checkpoints:/checkpoints"]
    assert ckpt.split("=", 1)[1].startswith("/checkpoints/") and "checkpoints" in COMPOSE["volumes"]
    # the volume's mount point belongs to the image's non-root user
    assert "chown 10001:10001 /checkpoints /state" in DOCKERFILE


def test_the_coordinator_journals_to_a_volume_and_is_respawned_on_it() -> None:
    coordinator = COMPOSE["services"]["coordinator"]
    assert coordinator["volumes"] == ["coordinator-state:/state"]
    assert "coordinator-state" in COMPOSE["volumes"]
    command = coordinator["command"]
    assert "--state-dir=/state" in command and "--respawn=10" in command
    # what the coordinator makes of its command: the flags are its own, and they hold
    flags = [a.replace("${SHARDWIRE_RUN_ID:-compose}", "compose") for a in command[1:]]
    flags = [a.replace("${SHARDWIRE_JOIN_TIMEOUT:-300}", "300") for a in flags]
    settings = settings_from([f for f in flags if not f.startswith("--token-file")])
    assert (settings.state_dir, settings.respawn, settings.port) == ("/state", 10, 29400)


def test_the_image_copies_every_package_directory() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    copied = set(re.findall(r"^COPY (\S+) \1$", DOCKERFILE, re.MULTILINE))
    assert folders <= copied, f"the Dockerfile does not copy {sorted(folders - copied)}"


@pytest.mark.e2e
def test_the_compose_smoke_runs_the_running_guide_s_commands(tmp_path) -> None:
    """The Compose smoke test (``scripts/compose-smoke.sh``, run by CI where a Docker
    daemon can start) runs the guide's two commands as written: its token command makes
    the secret file the Compose file reads by default, in a directory only its owner may
    enter (the file itself must stay readable by the containers' user)."""
    make, up = block("compose").commands()
    smoke = (ROOT / "scripts" / "compose-smoke.sh").read_text()
    assert 'block("compose")' in smoke and 'eval "${page[0]}"' in smoke
    assert 'eval "${page[1]}"' in smoke
    assert up.split() == ["docker", "compose", "up", "--build", "--abort-on-container-failure"]
    subprocess.run(["sh", "-c", make], cwd=tmp_path, check=True, timeout=60)
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    default = re.fullmatch(
        r"\$\{SHARDWIRE_TOKEN_FILE:-(.+)\}", compose["secrets"]["shardwire_token"]["file"]
    )
    assert default is not None
    token = tmp_path / default.group(1)
    assert re.fullmatch(r"[0-9a-f]{64}\n", token.read_text())
    assert token.parent.stat().st_mode & 0o077 == 0, oct(token.parent.stat().st_mode)
    assert token.stat().st_mode & 0o004, oct(token.stat().st_mode)  # the container reads it
