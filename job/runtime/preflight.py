"""Preflight: after init and before training, every process's facts side by side.

Each process reports its library versions, device kind and count, a hash of
this package's code, its config, whether it can write the run directory, and
whether jax runs on the GPUs this process was given (JOB_SKIP_GPU_CHECK=1
skips that one, for stand-in GPUs).
The facts are gathered onto every process; if anything differs (or a process
cannot write), process 0 prints one report with each process's value and
every process stops before the first step. A mixed-version or mis-configured
cluster then fails in seconds with the culprit named, not at step 1 with a
shape error or hours later with a silent divergence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import socket
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from etils import epath

from job.core import internals, storage
from job.core.errors import JobError
from job.core.flags import flatten
from job.runtime.cluster import environment
from job.runtime.cluster.base import SKIP_GPU_CHECK, skips_gpu_check, visible_gpus

log = logging.getLogger("job.runtime.preflight")

PACKAGES = ("jax", "jaxlib", "flax", "orbax-checkpoint", "optax")
WRITABLE = "writable"
SHARED = "shared"
# Above this many processes the report groups processes by value instead of a column each.
COLUMNS_UP_TO = 8
GPUS = "gpus"
NO_GPUS = "-"
GPUS_OK = "as given"
GPUS_SKIPPED = f"unchecked ({SKIP_GPU_CHECK}=1)"
# Pass/fail facts and the values that pass (the first is the default when a row lacks the fact).
REQUIRED = {"run dir": (WRITABLE,), "run dir shared": (SHARED, "-"), GPUS: (NO_GPUS, GPUS_OK, GPUS_SKIPPED)}
# Fields that say where a process runs: shown in the report, never compared.
IDENTITY = ("process", "host")


class PreflightError(JobError, RuntimeError):
    """The processes of one job disagree (versions, devices, code, config) or cannot write the run dir."""


@functools.cache
def code_hash(root: Path | None = None) -> str:
    """sha256 of every .py file under `root` (default: the `job` package), path and bytes; 12 hex digits."""
    root = root or Path(__file__).resolve().parents[1]  # job/runtime/preflight.py: the package
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def version(package: str) -> str:
    """The installed version of `package` ("absent" when it is not installed), as every process reports it."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def probe_path(directory: epath.Path, process: int) -> epath.Path:
    return directory / f".preflight-{process}"


def writable(directory: epath.Path, process: int, *, keep: bool = False, token: str = "ok") -> str:
    """WRITABLE, or why this process cannot create and write a file (a gs:// object) in `directory`.
    With `keep`, the probe file, which holds `token`, stays (for the shared-folder check); `remove_probe`
    deletes it."""
    reason = storage.probe(directory, probe_path(directory, process).name, keep=keep, content=token)
    return WRITABLE if reason is None else reason


def remove_probe(directory: epath.Path, process: int) -> None:
    try:
        probe_path(directory, process).unlink(missing_ok=True)
    except Exception:  # noqa: BLE001 - a folder this process could not write (already reported): nothing there
        pass


def sees_process_0(directory: epath.Path, token: str) -> str:
    """Whether process 0's probe, holding `token`, is visible here: orbax needs one folder (or bucket) every
    host shares. A probe holding anything else was left by an earlier run (one stopped during its
    preflight) in this host's own folder, where process 0 may then have run."""
    probe = probe_path(directory, 0)
    storage.forget_listings(directory)  # listed before process 0 wrote there: ask the store again
    try:
        found = probe.read_text()  # one request to a bucket; a missing probe is FileNotFoundError there too
    except FileNotFoundError:
        found = None
    except Exception as exc:  # noqa: BLE001 - each store has its own errors; all mean "cannot read it here"
        return f"cannot read process 0's {probe.name}: {type(exc).__name__}: {exc}"
    if found == token:
        return SHARED
    if found is None:
        return f"cannot see process 0's {probe.name}: not a folder the hosts share"
    return (f"found a {probe.name} that process 0 of this job did not write (an earlier run's, left in this "
            "host's own folder): not a folder the hosts share")


def gpus_given(env: Mapping[str, str], jax_visible: str = "all") -> int | None:
    """How many GPUs this process was given; None for none (a CPU job).

    The GPUs CUDA_VISIBLE_DEVICES lists (else those the cluster gave the task), narrowed to
    the ones jax was told to use (`jax_visible`: its jax_cuda_visible_devices, set from
    local_device_ids) when that is not "all".
    """
    listed = visible_gpus(env)
    count = len(listed) if listed is not None else environment(env).task_gpus(env)
    if not count:
        return None
    return count if jax_visible == "all" else len(jax_visible.split(","))


def gpu_check(given: int | None, backend: str, found: int, env: Mapping[str, str]) -> str:
    """The "gpus" fact: NO_GPUS, GPUS_OK, GPUS_SKIPPED, or what is wrong (expected, found)."""
    skip = skips_gpu_check(env)
    if given is None:
        return NO_GPUS
    if skip:
        log.warning("preflight: GPU check skipped (%s=1): this process was given %d GPU(s), jax runs on %d %s "
                    "device(s)", SKIP_GPU_CHECK, given, found, backend)
        return GPUS_SKIPPED
    if backend == "gpu" and found == given:
        return GPUS_OK
    return f"expected {given} GPU(s), found {found} {backend} device(s)"


def local_facts(config: Mapping[str, Any], run_dir: epath.Path,
                env: Mapping[str, str] | None = None, token: str = "ok") -> dict[str, Any]:
    """This process's facts (needs jax initialised: it reads the local devices). Its run-dir probe, kept
    for the shared-folder check when there are other processes, holds `token`."""
    import jax  # python -m job rerun imports this module (through provenance) and needs no jax

    env = os.environ if env is None else env
    devices = jax.local_devices()
    # None: a jax without the setting, which uses every GPU it sees
    given = gpus_given(env, internals.cuda_visible_devices() or "all")
    facts: dict[str, Any] = {
        "process": jax.process_index(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        **{package: version(package) for package in PACKAGES},
        "job code": code_hash(),
        "device kind": ",".join(sorted({d.device_kind for d in devices})),
        "local devices": len(devices),
        "run dir": writable(run_dir, jax.process_index(), keep=jax.process_count() > 1, token=token),
        GPUS: gpu_check(given, jax.default_backend(), len(devices), env),
    }
    facts.update({f"config.{k}": v for k, v in flatten(config).items()})
    return facts


def exchange(facts: dict[str, Any], run_dir: epath.Path, decide: Callable[[list[dict[str, Any]]], Any],
             token: str) -> Any:
    """Process 0 gets every process's facts and returns `decide(rows)` on every process. Collective.
    Each process checks that it sees process 0's probe, which holds process 0's `token`.

    Through the coordination service's key-value store, not a device collective:
    it needs no devices (a host with the wrong device count must still be heard),
    and only process 0 reads N records (the others read one verdict).
    """
    import jax  # as in local_facts; multihost imports jax too

    from job.parallel.multihost import barrier, coordination_client, on_process_zero

    me, count = jax.process_index(), jax.process_count()
    client = coordination_client()
    on_process_zero(client.key_value_set, "job/preflight/probe", token, allow_overwrite=True)
    barrier("preflight: probes written")
    written = client.blocking_key_value_get("job/preflight/probe", 60_000)
    facts["run dir shared"] = sees_process_0(run_dir, written) if facts["run dir"] == WRITABLE else "-"
    client.key_value_set(f"job/preflight/facts/{me}", json.dumps(facts, default=str), allow_overwrite=True)
    barrier("preflight: facts")
    on_process_zero(_post_verdict, client, count, decide)
    barrier("preflight: verdict")
    verdict = json.loads(client.blocking_key_value_get("job/preflight/verdict", 60_000))
    barrier("preflight: done")  # nobody removes a probe (or overwrites a key) before all have read
    remove_probe(run_dir, me)
    return verdict


def _post_verdict(client: Any, count: int, decide: Callable[[list[dict[str, Any]]], Any]) -> None:
    """Process 0's part of `exchange`: every process's facts read, `decide(rows)` posted for all."""
    found = dict(client.key_value_dir_get("job/preflight/facts/"))
    rows = [json.loads(found[f"job/preflight/facts/{i}"]) for i in range(count)]
    client.key_value_set("job/preflight/verdict", json.dumps(decide(rows)), allow_overwrite=True)


def problems_of_all(name: str, problem: str | None, timeout_s: float | None = None) -> dict[int, str]:
    """Every process's own finding about `name` (None: none), the same {process: problem} on every process,
    so that all stop together on a problem only some processes saw. Collective (the coordination service's
    key-value store and a barrier; no device collective)."""
    import jax  # as in local_facts; multihost imports jax too

    from job.parallel.multihost import barrier, coordination_client

    if jax.process_count() == 1:
        return {0: problem} if problem else {}
    client = coordination_client()
    prefix = f"job/problems/{name}/"
    client.key_value_set(f"{prefix}{jax.process_index()}", problem or "", allow_overwrite=True)
    barrier(f"problems/{name}", timeout_s)
    found = {int(key.rsplit("/", 1)[-1]): value for key, value in client.key_value_dir_get(prefix)}
    return {process: found[process] for process in sorted(found) if found[process]}


def problems(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Pass/fail facts some process failed, then the facts whose value differs between processes."""
    fields = sorted({k for row in rows for k in row} - set(IDENTITY) - set(REQUIRED), key=_order)
    differ = [f for f in fields if len({json.dumps(row.get(f), default=str) for row in rows}) > 1]
    failed = [f for f, ok in REQUIRED.items() if any(row.get(f, ok[0]) not in ok for row in rows)]
    if "run dir" in failed:  # a process that cannot write makes the shared-folder probe moot
        failed = [f for f in failed if f != "run dir shared"]
    return failed + differ


def _order(field: str) -> tuple[int, str]:
    return (1 if field.startswith("config.") else 0, field)


def report(rows: Sequence[Mapping[str, Any]], fields: Sequence[str], run_dir: epath.Path) -> str:
    """A line per differing fact: a column per process, or (above COLUMNS_UP_TO processes) the
    processes grouped by value, the most common first. A bucket that no process can write,
    for the same reason on all, is the one line of job.core.storage (expected, found, fix)."""
    reasons = {str(row.get("run dir")) for row in rows}
    if storage.is_remote(run_dir) and list(fields) == ["run dir"] and len(reasons) == 1:
        return (f"preflight: stopping before training: all {len(rows)} process(es) cannot write the run dir. "
                + storage.explain(run_dir, reasons.pop()))
    if len(rows) <= COLUMNS_UP_TO:
        heads = [f"process {row['process']} ({row['host']})" for row in rows]
        table = [["", *heads]] + [[f, *(_show(row.get(f, "-")) for row in rows)] for f in fields]
        widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in table]
    else:
        lines = [f"{f}: " + "; ".join(_groups(rows, f)) for f in fields]
    fixes = []
    if any(f in fields for f in (*PACKAGES, "python", "job code")):
        fixes.append("run the same image or environment, and the same code, on every host")
    if "device kind" in fields or "local devices" in fields:
        fixes.append("give every process the same kind and number of devices (check --gpus-per-node, "
                     "CUDA_VISIBLE_DEVICES, the TPU slice)")
    if any(f.startswith("config.") for f in fields):
        fixes.append("pass the same flags to every process (one command line, one config)")
    if GPUS in fields:
        fixes.append("give jax the GPUs each process was given: found cpu devices, run a CUDA build of jax (a "
                     "virtualenv from `make venv FLAVOR=cuda`, or the image of `make docker-build FLAVOR=cuda`) "
                     "with JAX_PLATFORMS unset; found another GPU count, check CUDA_VISIBLE_DEVICES and "
                     "JAX_LOCAL_DEVICE_IDS; to run on the CPU on purpose, hide the GPUs (CUDA_VISIBLE_DEVICES=); "
                     f"stand-in GPUs: {SKIP_GPU_CHECK}=1")
    if ("run dir" in fields or "run dir shared" in fields) and storage.is_remote(run_dir):
        fixes.append(f"give every host's service account {storage.BUCKET_ROLE} on gs://{storage.bucket_of(run_dir)} "
                     "(python -m job check-run-dir RUN_DIR on a host says why it cannot write), or pass --run-dir")
    elif "run dir" in fields or "run dir shared" in fields:
        fixes.append(f"make {run_dir} one folder every host can write (a filesystem they share), or pass --run-dir")
    return (f"preflight: stopping before training: {len(rows)} processes, these facts differ or fail.\n  "
            + "\n  ".join(lines) + "\nFix: " + "; ".join(fixes))


def _groups(rows: Sequence[Mapping[str, Any]], field: str, named: int = 10) -> list[str]:
    """'0.10.2 on 998 processes', then '0.4.1 on process(es) 17, 512 (hosts a, b)' for each rarer value."""
    by_value: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        by_value.setdefault(_show(row.get(field, "-")), []).append(row)
    ordered = sorted(by_value.items(), key=lambda item: -len(item[1]))
    out = [f"{ordered[0][0]} on {len(ordered[0][1])} processes"]
    for value, group in ordered[1:]:
        ids = ", ".join(str(r["process"]) for r in group[:named]) + (", ..." if len(group) > named else "")
        hosts = ", ".join(sorted({str(r["host"]) for r in group[:named]}))
        out.append(f"{value} on {len(group)} process(es) {ids} (hosts {hosts})")
    return out


def _show(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclasses.dataclass(frozen=True)
class Summary:
    processes: int
    facts: dict[str, Any]  # process 0's

    def line(self) -> str:
        f = self.facts
        return (f"preflight: {self.processes} process(es) agree: jax {f['jax']}, jaxlib {f['jaxlib']}, "
                f"flax {f['flax']}, {f['local devices']} x {f['device kind']} per process, "
                f"code {f['job code']}, config {config_hash(f)}")


def config_hash(facts: Mapping[str, Any]) -> str:
    config = {k: v for k, v in facts.items() if k.startswith("config.")}
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def check(config: Mapping[str, Any], run_dir: epath.Path) -> Summary:
    """Compare every process's facts; raise PreflightError on every process if they differ or fail.
    Collective: every process calls it once, after job.initialize."""
    import jax  # as in local_facts

    def decide(rows: list[dict[str, Any]]) -> dict[str, Any]:
        bad = problems(rows)
        return {"bad": bad, "report": report(rows, bad, run_dir) if bad else "", "first": rows[0],
                "processes": len(rows)}

    token = uuid.uuid4().hex  # process 0's is what its probe holds: a probe an earlier run left is told apart
    facts = local_facts(config, run_dir, token=token)
    verdict = decide([facts]) if jax.process_count() == 1 else exchange(facts, run_dir, decide, token)
    if not verdict["bad"]:
        return Summary(verdict["processes"], verdict["first"])
    error = PreflightError(verdict["report"] if jax.process_index() == 0 else
                           f"preflight: this job's processes differ or fail on {', '.join(verdict['bad'])}; "
                           "process 0 prints the report")
    raise_together(error, "preflight")


RAISE_TOGETHER_TIMEOUT_S = 60.0  # how long a process that printed its error waits for its peers to print theirs


def raise_together(error: JobError, name: str) -> NoReturn:
    """Raise `error`, which every process raises, once its message is on every process's stderr: the
    first process to exit aborts the others (the launcher stops them, the coordination service fails
    them), so each prints first and waits for the rest at a barrier. Collective where there are peers;
    a peer that never comes (it did not find the error) delays the raise by RAISE_TOGETHER_TIMEOUT_S at
    most, and the error raised is still `error`, printed already."""
    import jax  # as in local_facts

    if jax.process_count() > 1:
        # multihost imports jax: as in local_facts
        from job.parallel.multihost import barrier

        print(f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
        error.reported = True
        with contextlib.suppress(JobError):  # a barrier timeout: our error, not the wait, is what to say
            barrier(f"{name}: reported", RAISE_TOGETHER_TIMEOUT_S)
    raise error


@contextlib.contextmanager
def raised_together(name: str) -> Iterator[None]:
    """The body's JobError, which every process finds (it reads what they share: the run dir's checkpoints,
    the config), raised as `raise_together` raises it. Collective only when the body raises."""
    try:
        yield
    except JobError as exc:
        raise_together(exc, name)
