# shardwire: a slim, non-root image whose entrypoint is the `shardwire` command.
# The base image is a build argument so a locally built Python base works too.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG UV_VERSION=0.13.9
ENV UV_PROJECT_ENVIRONMENT=/opt/venv \
    UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/uv && /opt/uv/bin/pip install --no-cache-dir "uv==${UV_VERSION}"
COPY pyproject.toml uv.lock README.md ./
COPY protocol protocol
COPY coordinator coordinator
COPY worker worker
COPY torch_bridge torch_bridge
COPY ray_bridge ray_bridge
RUN /opt/uv/bin/uv sync --locked --no-editable --no-dev --extra examples --compile-bytecode

FROM ${BASE_IMAGE} AS runtime
# The digits example keeps its data set under XDG_CACHE_HOME after the first run: /tmp is
# writable where the root is read-only (the pod's emptyDir), and the user has no home.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/tmp/cache
COPY --from=build /opt/venv /opt/venv
# The node arena's atomic exchanges come from libatomic (without it a node's ranks use TCP).
# Unpinned: the base image is an argument, and its release decides the package version.
# hadolint ignore=DL3008
RUN if command -v apt-get >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends libatomic1 \
      && rm -rf /var/lib/apt/lists/*; \
    fi
COPY examples /app/examples
# The volumes' mount points (checkpoints, the coordinator's state): a new volume takes
# this owner, so the non-root user can write.
RUN mkdir /checkpoints /state && chown 10001:10001 /checkpoints /state
WORKDIR /app
USER 10001:10001
# The slim image has no curl; `shardwire health` asks the coordinator's /healthz.
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=12 \
    CMD ["shardwire", "health"]
ENTRYPOINT ["shardwire"]
CMD ["--help"]
