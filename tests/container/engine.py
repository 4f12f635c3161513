"""The container tier's engine, with the standard library alone: the environment of every podman call, and
the CPU image's build. tests/container/conftest.py hands it to the tests; CI starts it first, on its own:

    python3 -m tests.container.engine

makes the stand-in base (standin.py) and builds the CPU image from this checkout while the virtual
environments are made, so the tier's fixtures find both in podman's store (a build of cached layers,
seconds) instead of building them on a test worker (about 4 minutes on a fresh machine).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.container import standin
from tests.site.sitecustomize import without_fast_compile

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TAG = "localhost/jax-cluster-job-test:cpu"


@dataclasses.dataclass(frozen=True)
class Built:
    tag: str
    seconds: float
    log: str


def engine_env() -> dict[str, str]:
    """The environment every podman (and docker/*.sh) call of these tests runs with."""
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(HERE / "containers.conf"))
    env["CONTAINER_ENGINE"] = "podman"
    env["PYTHONPATH"] = str(ROOT)
    # A container compiles as XLA does by default: the fast compile of the tests' own processes
    # (tests/site/sitecustomize.py) reaches it only through XLA_FLAGS, which the ranks pass on; a host run
    # compared with one in containers passes JOB_TESTS_COMPILE=default.
    env["XLA_FLAGS"] = without_fast_compile(env.get("XLA_FLAGS", ""))
    env["JOB_TESTS_COMPILE"] = "default"
    return env


def build_image(context: Path, tag: str, base: str, env: dict[str, str], timeout: float = 600) -> Built:
    """docker/build.sh of `context` (a repository root), CPU flavour, offline base."""
    argv = ["bash", str(context / "docker" / "build.sh"), "cpu", tag, "--pull=never", f"--build-arg=BASE={base}"]
    began = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - began
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"image build failed (exit {proc.returncode}):\n{log[-6000:]}"
    return Built(tag, seconds, log)


def build_ahead() -> int:
    """The stand-in base and the CPU image, as the tier's fixtures make them; 1 (with the reason) on a failure,
    which the tests then meet and report themselves."""
    env = engine_env()
    began = time.monotonic()
    try:
        base, _ = standin.ensure(env)
        built = build_image(ROOT, TAG, base, env)
    except (AssertionError, RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"tests.container.engine: the image was not built ahead ({exc}); the container tier builds it",
              file=sys.stderr)
        return 1
    print(f"tests.container.engine: {base} and {built.tag} ready in {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(build_ahead())
