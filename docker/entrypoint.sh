#!/bin/sh
# The image's one entrypoint: `python -m job` with the container's arguments.
#
#   docker run IMAGE train --steps 100    ->  python -m job train --steps 100
#   docker run IMAGE                      ->  python -m job train (the image's CMD)
#   docker run IMAGE python -m job demo   ->  runs as given: a first argument that
#                                             is a program on PATH runs as it is
#                                             (the TPU path and shells use this)
#
# exec, so that the job receives the container's signals itself (SIGTERM,
# SIGUSR1, SIGUSR2: save and exit 75 for a requeue). Run with --init when the
# job must also stop on a signal before its training loop has started.
set -eu

if [ "$#" -gt 0 ] && [ "${1#-}" = "$1" ] && command -v -- "$1" >/dev/null 2>&1; then
    exec "$@"
fi
exec python -m job "$@"
