"""A stand-in for the Dockerfile's default base image, made without a registry.

CI reaches no image registry, so the container tests make
docker.io/library/python:3.13-slim themselves: Debian trixie by
`mmdebstrap --variant=minbase` with Python 3.13, venv and CA certificates,
streamed into `podman import` under that exact name. The project's Dockerfile
is built unchanged on top of it. (mmdebstrap, not debootstrap: measured side by
side on 2 busy cores, 58 s against 126 s, and it writes the tarball itself.)

Test only, and specific to this kind of machine: the host's CA certificates
(its HTTPS proxy's among them) are added, so that pip inside the build reaches
PyPI. A base that already carries this recipe's label is reused; a real
python:3.13-slim found locally (no label) is used as it is and never replaced.
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
import time
from pathlib import Path

NAME = "docker.io/library/python:3.13-slim"  # the Dockerfile's default BASE
SUITE = "trixie"  # python:3.13-slim's Debian release (its python3 is 3.13)
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "python3-venv", "ca-certificates")
HOST_CAS = Path("/usr/local/share/ca-certificates")
LABEL = "jax-cluster-job.standin"
# What python:3.13-slim's own config says (and what the Dockerfile's ENV PATH extends).
CHANGES = (
    "ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV=LANG=C.UTF-8",
    'CMD ["python3"]',
)


def recipe() -> str:
    """A digest of everything that goes into the stand-in: a changed recipe rebuilds it."""
    h = hashlib.sha256(repr((SUITE, MIRROR, PACKAGES, CHANGES)).encode())
    for crt in sorted(HOST_CAS.glob("*.crt")):
        h.update(crt.read_bytes())
    return h.hexdigest()[:16]


def existing_label(env: dict[str, str]) -> str | None:
    """None when there is no NAME image; '' when there is one that is not ours; else its recipe."""
    proc = subprocess.run(["podman", "image", "inspect", "--format", f'{{{{index .Config.Labels "{LABEL}"}}}}', NAME],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    value = proc.stdout.strip()
    return "" if value in ("", "<no value>") else value


def mmdebstrap_argv() -> list[str]:
    """Root filesystem as a tarball on stdout; apt's lists and caches are left out (mmdebstrap's default)."""
    cas = [str(crt) for crt in sorted(HOST_CAS.glob("*.crt"))]
    hooks = ([f"--customize-hook=copy-in {' '.join(cas)} /usr/local/share/ca-certificates"] if cas else [])
    hooks.append('--customize-hook=chroot "$1" update-ca-certificates')
    return ["mmdebstrap", "--variant=minbase", "--quiet", f"--include={','.join(PACKAGES)}", *hooks,
            SUITE, "-", MIRROR]


def build(env: dict[str, str]) -> None:
    """mmdebstrap | podman import, as NAME (root; ~30-60 s)."""
    changes = [arg for change in (*CHANGES, f"LABEL={LABEL}={recipe()}") for arg in ("--change", change)]
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a full pipe would block mmdebstrap
        rootfs = subprocess.Popen(mmdebstrap_argv(), env=env, stdout=subprocess.PIPE, stderr=log)
        assert rootfs.stdout is not None
        try:
            imported = subprocess.run(["podman", "import", *changes, "-", NAME], env=env, stdin=rootfs.stdout,
                                      capture_output=True, text=True, timeout=600)
        finally:
            rootfs.stdout.close()
            made = rootfs.wait(timeout=60)
        log.seek(0)
        errors = log.read().decode(errors="replace")
    if made != 0 or imported.returncode != 0:
        raise RuntimeError(f"making the stand-in {NAME} failed: mmdebstrap exit {made}, podman import exit "
                           f"{imported.returncode}\n--- mmdebstrap ---\n{errors[-4000:]}\n"
                           f"--- podman import ---\n{imported.stderr[-4000:]}")


def ensure(env: dict[str, str]) -> tuple[str, float | None]:
    """NAME, present in podman's store; and the seconds it took to make (None when reused)."""
    label = existing_label(env)
    if label == "" or label == recipe():
        return NAME, None
    began = time.monotonic()
    build(env)
    return NAME, time.monotonic() - began
