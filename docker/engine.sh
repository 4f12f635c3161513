#!/bin/sh
# Prints the container engine the docker targets use:
#   $CONTAINER_ENGINE when set (docker or podman),
#   else docker when its daemon answers,
#   else podman.
set -eu

fail() {
    echo "docker/engine.sh: $1" >&2
    exit 2
}

if [ -n "${CONTAINER_ENGINE:-}" ]; then
    case $CONTAINER_ENGINE in
        docker | podman) ;;
        *) fail "expected CONTAINER_ENGINE=docker or podman, found '$CONTAINER_ENGINE'. Fix: unset it to choose automatically" ;;
    esac
    command -v "$CONTAINER_ENGINE" >/dev/null 2>&1 ||
        fail "expected $CONTAINER_ENGINE on PATH (CONTAINER_ENGINE=$CONTAINER_ENGINE), found none. Fix: install it or unset CONTAINER_ENGINE"
    echo "$CONTAINER_ENGINE"
    exit 0
fi
# A docker client without a reachable daemon counts as no docker.
if command -v docker >/dev/null 2>&1 && docker version --format '{{.Server.Version}}' >/dev/null 2>&1; then
    echo docker
    exit 0
fi
if command -v podman >/dev/null 2>&1; then
    echo podman
    exit 0
fi
fail "expected docker (with a running daemon) or podman, found neither. Fix: apt-get install podman, or start the Docker daemon"
