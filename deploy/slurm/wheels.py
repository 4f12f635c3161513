"""WHEELHOUSE on Slurm: `make doctor WHERE=slurm WHEELHOUSE=W` checks a `make wheelhouse` folder that compute nodes
without a package index install from (deploy/wheelhouse.py).

    here(W)                          # the quick part: made by make wheelhouse, a wheel for every pin, lock unchanged
    probe_argv(..., wheelhouse=W)    # deploy/slurm/doctor.py runs PROBE after slurm/doctor-probe.sh on a node
    on_node(cfg, W, findings, node)  # PYTHON's pip there installs every pin of W with no index (pip --dry-run)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from deploy import wheelhouse
from deploy.checks import Check
from deploy.slurm.options import ROOT, SlurmConfig

# After slurm/doctor-probe.sh's text, its 6th argument: with WHEELHOUSE, can PYTHON install every pin of it here
# with no index? (`pip --isolated`: no pip config of the node adds another source; `--dry-run`: nothing installed.)
PROBE = f"""
wheelhouse=${{6:-}}
if [[ -n $wheelhouse && -n $python ]] && command -v -- "$python" >/dev/null 2>&1; then
    if [[ ! -f $wheelhouse/{wheelhouse.PINS} ]]; then
        say wheelhouse missing
    elif out=$("$python" -m pip --isolated install --dry-run --quiet --no-index --ignore-installed \\
               --find-links "$wheelhouse" -r "$wheelhouse/{wheelhouse.PINS}" 2>&1); then
        say wheelhouse ok
    else
        say wheelhouse "failed $? $(last_line "$out")"
    fi
fi
"""


FIX = "make wheelhouse WHEELHOUSE={w} WHEEL_PYTHON={python} WHEEL_PLATFORM=manylinux_2_M_{machine} (M: the " \
    "nodes' glibc, `ldd --version`) where an index is reachable, on a file system the nodes mount"


def here(folder: str) -> Check:
    """WHEELHOUSE on this machine: made by make wheelhouse, a wheel for every pin, from the lock as it is now."""
    name, found = "wheelhouse", wheelhouse.problems(Path(folder), ROOT)
    if found:
        return Check(name, False, f"WHEELHOUSE={folder}: {'; '.join(found)}",
                     fix=FIX.format(w=folder, python="X.Y", machine="x86_64"))
    return Check(name, True, f"{folder}: {wheelhouse.describe(Path(folder))}, a wheel for every pin")


def on_node(cfg: SlurmConfig, folder: str, found: Mapping[str, str], node: str) -> Check:
    """The probe's word on WHEELHOUSE: PYTHON's pip on the node installs every pin from it with no index."""
    name, python = "wheelhouse on a compute node", cfg.task_python
    said = found.get("wheelhouse", "")
    status, _, rest = said.partition(" ")
    version = found.get("python", "").split(" ")[1:2] or ["X.Y"]
    fix = FIX.format(w=folder, python=".".join(version[0].split(".")[:2]), machine="x86_64 (or aarch64)")
    if status == "ok":
        return Check(name, True, f"{python} on {node} installs every pin of {folder} with no index (pip --dry-run)")
    if status == "missing":
        return Check(name, False, f"WHEELHOUSE={folder} is not on {node}", fix=f"{fix}; or copy it there")
    if status == "failed":
        code, _, words = rest.partition(" ")
        return Check(name, False, f"{python} on {node} cannot install from WHEELHOUSE={folder} with no index "
                     f"(pip exit {code}: {words})", fix=fix)
    return Check(name, False, f"not probed: {python} does not run on {node} (see the interpreter's line)",
                 fix="PYTHON=an interpreter the compute nodes have")
