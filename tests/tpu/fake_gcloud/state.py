"""The simulator's state folder (``FAKE_GCLOUD_STATE``): TPU nodes, queued resources, worker homes.

    <state>/calls.jsonl                          every gcloud invocation's argv, one JSON list a line
    <state>/nodes/<project>/<zone>/<name>.json   a node: state, accelerator type, workers, ...
    <state>/homes/<project>/<zone>/<name>/worker-<i>/   each simulated worker's home directory
    <state>/queued/<project>/<zone>/<name>.json  a queued resource
    <state>/control/<project>/<zone>/<name>.preempt.json   a scheduled preemption (tests write it)
    <state>/control/<project>/<zone>/capacity.json   stock-outs to come: {"failures": [MESSAGE, ...]}
    <state>/control/<project>/<zone>/offer.json  what the zone offers, when a test changed it (see catalog.py)
    <state>/config.json                          gcloud's credentialed accounts, active account and properties
    <state>/pids/<pid>                           worker process groups still running (for cleanup)

Tests use the functions at the bottom (`schedule_preemption`, `preempt`,
`schedule_capacity_failures`, `set_login`, `set_property`, `set_offer`, `calls`, `node`, `queued`) to steer
and inspect the simulated cloud.

Until a test says otherwise gcloud is logged in (DEFAULT_ACCOUNT, active) with DEFAULT_PROJECT as its
configured project; CLOUDSDK_CORE_PROJECT and CLOUDSDK_CORE_ACCOUNT override those as in the real CLI.

A scheduled capacity failure is taken by the next creation in the zone: `tpu-vm create` fails at
once with it (exit 1, `{"code": 8, "message": ...}` as the real API's RESOURCE_EXHAUSTED), a queued
resource goes FAILED with it as `state.failedData.error.message` when it would have become ACTIVE.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.tpu.fake_gcloud import catalog

DEFAULT_PROJECT = "fake-project"
DEFAULT_ACCOUNT = "tester@example.com"
# gcloud's properties this simulator keeps (SECTION/NAME); the environment's CLOUDSDK_SECTION_NAME wins
PROPERTIES = ("core/project", "core/account", "compute/zone", "compute/region")
STATE_ENV = "FAKE_GCLOUD_STATE"
CREATE_SECONDS_ENV = "FAKE_GCLOUD_CREATE_SECONDS"  # how long a node stays CREATING (default 0)
QUEUE_SECONDS_ENV = "FAKE_GCLOUD_QUEUE_SECONDS"  # how long a queued resource waits for capacity (default 0)
# What Cloud TPU says when a zone has no capacity left (the API's RESOURCE_EXHAUSTED, code 8).
STOCKOUT_MESSAGE = ('There is no more capacity in the zone "{zone}"; you can try in another zone where Cloud TPU '
                    "Nodes are offered (see https://cloud.google.com/tpu/docs/regions) [EID: 0x5f1b2c3d4e5a6b7c]")


class Cloud:
    """One state folder; every read-modify-write happens under `lock()`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_env(cls) -> Cloud:
        root = os.environ.get(STATE_ENV)
        if not root:
            raise SystemExit(f"ERROR: (gcloud) the simulator needs {STATE_ENV}=FOLDER (its state folder)")
        return cls(Path(root))

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        with open(self.root / "lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def record_call(self, argv: list[str]) -> None:
        with open(self.root / "calls.jsonl", "a") as handle:
            handle.write(json.dumps(argv) + "\n")

    # ------------------------------------------------------------------ paths
    def _file(self, kind: str, project: str, zone: str, name: str, suffix: str = ".json") -> Path:
        return self.root / kind / project / zone / f"{name}{suffix}"

    def homes(self, project: str, zone: str, name: str) -> Path:
        return self.root / "homes" / project / zone / name

    def home(self, project: str, zone: str, name: str, worker: int) -> Path:
        return self.homes(project, zone, name) / f"worker-{worker}"

    # ------------------------------------------------------------------ records
    def _read(self, path: Path) -> dict[str, Any] | None:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None

    def _write(self, path: Path, record: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        tmp.replace(path)

    def node(self, project: str, zone: str, name: str) -> dict[str, Any] | None:
        return self._read(self._file("nodes", project, zone, name))

    def put_node(self, record: dict[str, Any]) -> None:
        self._write(self._file("nodes", record["project"], record["zone"], record["name"]), record)

    def drop_node(self, project: str, zone: str, name: str) -> None:
        self._file("nodes", project, zone, name).unlink(missing_ok=True)
        shutil.rmtree(self.homes(project, zone, name), ignore_errors=True)

    def queued(self, project: str, zone: str, name: str) -> dict[str, Any] | None:
        return self._read(self._file("queued", project, zone, name))

    def put_queued(self, record: dict[str, Any]) -> None:
        self._write(self._file("queued", record["project"], record["zone"], record["name"]), record)

    def drop_queued(self, project: str, zone: str, name: str) -> None:
        self._file("queued", project, zone, name).unlink(missing_ok=True)

    def all(self, kind: str, project: str, zone: str) -> list[dict[str, Any]]:
        folder = self.root / kind / project / zone
        return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.exists() else []

    def new_node(self, project: str, zone: str, name: str, accelerator: str, version: str, workers: int,
                 **extra: Any) -> dict[str, Any]:
        delay = float(os.environ.get(CREATE_SECONDS_ENV, "0"))
        record = {"project": project, "zone": zone, "name": name, "acceleratorType": accelerator,
                  "runtimeVersion": version, "workers": workers, "state": "CREATING" if delay > 0 else "READY",
                  "ready_at": time.time() + delay, **extra}
        shutil.rmtree(self.homes(project, zone, name), ignore_errors=True)
        for worker in range(workers):
            self.home(project, zone, name, worker).mkdir(parents=True)
        self.put_node(record)
        return record

    def refresh(self, project: str, zone: str) -> None:
        """Let time pass: CREATING nodes become READY, waiting queued resources ACTIVE (with their node)."""
        now = time.time()
        for record in self.all("nodes", project, zone):
            if record["state"] == "CREATING" and now >= record["ready_at"]:
                self.put_node({**record, "state": "READY"})
        for qr in self.all("queued", project, zone):
            nodes = [self.node(project, zone, n) for n in node_ids(qr)]
            if qr["state"] in ("ACCEPTED", "WAITING_FOR_RESOURCES") and now >= qr["active_at"]:
                if qr.get("failure"):
                    self.put_queued({**qr, "state": "FAILED"})
                    continue
                for name, node in zip(node_ids(qr), nodes):
                    if node is None:
                        self.new_node(project, zone, name, qr["acceleratorType"], qr["runtimeVersion"],
                                      qr["workers"], spot=qr["spot"], queuedResource=qr["name"],
                                      **qr.get("options", {}))
                self.put_queued({**qr, "state": "ACTIVE"})
            elif qr["state"] == "ACTIVE" and any(n is not None and n["state"] == "PREEMPTED" for n in nodes):
                self.put_queued({**qr, "state": "SUSPENDED"})

    # ------------------------------------------------------------------ gcloud's own configuration
    def config(self) -> dict[str, Any]:
        """{"accounts": [credentialed ...], "properties": {"core/project": ..., "core/account": ...}}"""
        return self._read(self.root / "config.json") or {
            "accounts": [DEFAULT_ACCOUNT],
            "properties": {"core/account": DEFAULT_ACCOUNT, "core/project": DEFAULT_PROJECT},
        }

    def put_config(self, config: dict[str, Any]) -> None:
        self._write(self.root / "config.json", config)

    def property(self, name: str) -> str | None:
        """A property (SECTION/NAME) as gcloud resolves it: the CLOUDSDK_SECTION_NAME variable, else the config."""
        from_env = os.environ.get("CLOUDSDK_" + name.replace("/", "_").upper())
        return from_env or self.config()["properties"].get(name) or None

    # ------------------------------------------------------------------ what a zone offers
    def offer_file(self, project: str, zone: str) -> Path:
        return self.root / "control" / project / zone / "offer.json"

    def offer(self, project: str, zone: str) -> dict[str, list[str]]:
        """{"acceleratorTypes": [...], "runtimeVersions": [...]}: catalog.py's, unless a test changed it."""
        default = {"acceleratorTypes": catalog.accelerator_types(zone),
                   "runtimeVersions": catalog.runtime_versions(zone)}
        return {**default, **(self._read(self.offer_file(project, zone)) or {})}

    # ------------------------------------------------------------------ stock-outs
    def capacity_file(self, project: str, zone: str) -> Path:
        return self.root / "control" / project / zone / "capacity.json"

    def take_capacity_failure(self, project: str, zone: str) -> str | None:
        """The next scheduled stock-out's message (consumed), or None: there is capacity."""
        path = self.capacity_file(project, zone)
        plan = self._read(path) or {"failures": []}
        if not plan["failures"]:
            return None
        message, *rest = plan["failures"]
        self._write(path, {"failures": rest})
        return str(message).format(zone=zone)

    # ------------------------------------------------------------------ preemption
    def control_file(self, project: str, zone: str, name: str) -> Path:
        return self._file("control", project, zone, name, ".preempt.json")

    def preempt(self, project: str, zone: str, name: str) -> bool:
        """Mark the node PREEMPTED (its running ssh sessions then SIGTERM their workers)."""
        record = self.node(project, zone, name)
        if record is None or record["state"] != "READY":
            return False
        self.put_node({**record, "state": "PREEMPTED"})
        self.refresh(project, zone)
        return True

    def register_pid(self, pid: int) -> None:
        (self.root / "pids").mkdir(exist_ok=True)
        (self.root / "pids" / str(pid)).touch()

    def unregister_pid(self, pid: int) -> None:
        (self.root / "pids" / str(pid)).unlink(missing_ok=True)


# ---------------------------------------------------------------------- for tests
def schedule_preemption(state: Path, name: str, zone: str, *, when_exists: Path | None = None,
                        after_s: float | None = None, project: str = DEFAULT_PROJECT) -> None:
    """Preempt the node once, while an ssh command runs on it: when `when_exists` appears, or
    `after_s` seconds after that command started. The running workers get SIGTERM."""
    cloud = Cloud(state)
    path = cloud.control_file(project, zone, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"when_exists": str(when_exists) if when_exists else None, "after_s": after_s}))


def schedule_capacity_failures(state: Path, zone: str, messages: list[str], project: str = DEFAULT_PROJECT) -> None:
    """The next len(messages) creations in the zone fail, each with its message ("{zone}" is filled in;
    STOCKOUT_MESSAGE is a stock-out)."""
    cloud = Cloud(state)
    with cloud.lock():
        cloud._write(cloud.capacity_file(project, zone), {"failures": list(messages)})


def set_login(state: Path, accounts: list[str], active: str | None = None) -> None:
    """gcloud's credentialed accounts and the active one (`accounts=[]`: never logged in, or all revoked)."""
    cloud = Cloud(state)
    with cloud.lock():
        config = cloud.config()
        config["accounts"] = list(accounts)
        config["properties"] = {k: v for k, v in config["properties"].items() if k != "core/account"}
        if active is not None:
            config["properties"]["core/account"] = active
        cloud.put_config(config)


def set_property(state: Path, name: str, value: str | None) -> None:
    """`gcloud config set NAME VALUE` (None: `gcloud config unset NAME`); NAME as SECTION/NAME."""
    assert name in PROPERTIES, name
    cloud = Cloud(state)
    with cloud.lock():
        config = cloud.config()
        config["properties"] = {k: v for k, v in config["properties"].items() if k != name}
        if value is not None:
            config["properties"][name] = value
        cloud.put_config(config)


def set_offer(state: Path, zone: str, *, accelerator_types: list[str] | None = None,
              runtime_versions: list[str] | None = None, project: str = DEFAULT_PROJECT) -> None:
    """Replace what the zone offers (either list; the other stays catalog.py's)."""
    cloud = Cloud(state)
    changes = {k: v for k, v in (("acceleratorTypes", accelerator_types), ("runtimeVersions", runtime_versions))
               if v is not None}
    with cloud.lock():
        path = cloud.offer_file(project, zone)
        cloud._write(path, {**(cloud._read(path) or {}), **changes})


def node_ids(qr: dict[str, Any]) -> list[str]:
    """The nodes a queued resource holds: its --node-id, or NODE_PREFIX-0 .. NODE_PREFIX-(N-1)."""
    return list(qr.get("nodeIds") or [qr["nodeId"]])


def queued(state: Path, name: str, zone: str, project: str = DEFAULT_PROJECT) -> dict[str, Any] | None:
    return Cloud(state).queued(project, zone, name)


def preempt(state: Path, name: str, zone: str, project: str = DEFAULT_PROJECT) -> bool:
    cloud = Cloud(state)
    with cloud.lock():
        return cloud.preempt(project, zone, name)


def node(state: Path, name: str, zone: str, project: str = DEFAULT_PROJECT) -> dict[str, Any] | None:
    return Cloud(state).node(project, zone, name)


def calls(state: Path) -> list[list[str]]:
    path = state / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def kill_leftovers(state: Path) -> list[int]:
    """SIGKILL every worker process group a simulated ssh left running; their ids."""
    killed = []
    for entry in sorted((state / "pids").glob("*")) if (state / "pids").exists() else []:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.killpg(int(entry.name), signal.SIGKILL)
            killed.append(int(entry.name))
        entry.unlink(missing_ok=True)
    return killed
