#!/usr/bin/env bash
# Builds the job's image (what `make docker-build` runs):
#
#   docker/build.sh FLAVOR IMAGE [BUILD OPTIONS...]
#
#   FLAVOR  cpu (requirements.lock), cuda or tpu (docker/requirements-FLAVOR.lock)
#   IMAGE   the tag, e.g. jax-cluster-job:cpu
#   BUILD OPTIONS go to `ENGINE build` unchanged, e.g. --build-arg BASE=python:3.13-slim@sha256:...
#
# The engine is docker/engine.sh's choice (CONTAINER_ENGINE=docker|podman
# overrides). The context is the repository root; .dockerignore keeps it to the
# lock files, the entrypoint and job/. DRY_RUN=1 prints the command only.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)

fail() {
    echo "docker/build.sh: $1" >&2
    exit 2
}

# on NAME VALUE: true for an on word, false for an off word, as job/core/values.py reads them
# (1/true/yes/on, 0/false/no/off or empty, in any case); anything else is refused
on() {
    case ${2,,} in
        1 | true | yes | on) return 0 ;;
        "" | 0 | false | no | off) return 1 ;;
        *) fail "$1: expected 1 or 0 (or true/false), found '$2'. Fix: $1=1, or leave it unset" ;;
    esac
}

(($# >= 2)) || fail "expected FLAVOR and IMAGE, found $# argument(s). Fix: docker/build.sh cpu jax-cluster-job:cpu"
flavor=$1
image=$2
shift 2

case $flavor in
    cpu) lock=requirements.lock ;;
    cuda | tpu) lock=docker/requirements-$flavor.lock ;;
    *) fail "expected FLAVOR cpu, cuda or tpu, found '$flavor'. Fix: make docker-build FLAVOR=cpu" ;;
esac
[[ -f $root/$lock ]] || fail "expected the lock file $lock for FLAVOR=$flavor, found none. Fix: make lock"
[[ -n $image && $image != *[[:space:]]* ]] ||
    fail "expected an image name such as jax-cluster-job:$flavor, found '$image'. Fix: make docker-build IMAGE=jax-cluster-job:$flavor"

engine=$(sh "$root/docker/engine.sh")
command=("$engine" build --file "$root/docker/Dockerfile" --build-arg "LOCK=$lock"
    --label "jax-cluster-job.flavor=$flavor" --tag "$image" "$@" "$root")

on DRY_RUN "${DRY_RUN:-}" && dry=1 || dry=0
echo "+ ${command[*]}"
if ((dry)); then
    exit 0
fi
exec "${command[@]}"
