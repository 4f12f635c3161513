"""What each accepted command does to the simulated cloud: create, describe, list, delete, scp."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.tpu.fake_gcloud.grammar import Parsed, UsageError
from tests.tpu.fake_gcloud.state import DEFAULT_PROJECT, QUEUE_SECONDS_ENV, Cloud


class CloudError(Exception):
    """An API error (NOT_FOUND, ALREADY_EXISTS, ...): exit 1, like the real CLI."""

    def __init__(self, parsed: Parsed, message: str) -> None:
        super().__init__(f"ERROR: (gcloud.{'.'.join(parsed.form.path)}) {message}")


def where(parsed: Parsed) -> tuple[str, str]:
    return str(parsed.get("project") or DEFAULT_PROJECT), str(parsed.get("zone"))


def _resource_name(kind: str, project: str, zone: str, name: str) -> str:
    return f"projects/{project}/locations/{zone}/{kind}/{name}"


def node_view(record: dict[str, Any]) -> dict[str, Any]:
    """A node as `describe` shows it."""
    return {
        "name": _resource_name("nodes", record["project"], record["zone"], record["name"]),
        "acceleratorType": record["acceleratorType"], "runtimeVersion": record["runtimeVersion"],
        "state": record["state"], "schedulingConfig": {"spot": bool(record.get("spot")),
                                                       "preemptible": bool(record.get("preemptible"))},
        "networkEndpoints": [{"ipAddress": "127.0.0.1", "port": 8470}] * record["workers"],
        **({"queuedResource": record["queuedResource"]} if record.get("queuedResource") else {}),
    }


def queued_view(record: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": _resource_name("queuedResources", record["project"], record["zone"], record["name"]),
        "state": {"state": record["state"]},
        "tpu": {"nodeSpec": [{"nodeId": record["nodeId"], "node": {
            "acceleratorType": record["acceleratorType"], "runtimeVersion": record["runtimeVersion"]}}]},
        **({"spot": {}} if record.get("spot") else {}),
    }


def _lookup(value: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def render(parsed: Parsed, items: list[dict[str, Any]]) -> str:
    fmt = str(parsed.get("format") or "yaml")
    if fmt == "json":
        return json.dumps(items[0] if parsed.form.path[-1] == "describe" else items, indent=2)
    if fmt.startswith("value(") and fmt.endswith(")"):
        keys = [k.strip() for k in fmt[len("value("):-1].split(",")]
        rows = ["\t".join("" if _lookup(i, k) is None else str(_lookup(i, k)) for k in keys) for i in items]
        return "\n".join(rows)
    if fmt == "yaml":
        return "\n---\n".join("\n".join(f"{k}: {json.dumps(v)}" for k, v in sorted(i.items())) for i in items)
    raise UsageError(parsed.form.path, f"the simulator supports --format=json, yaml or value(KEY,...), not {fmt}")


def _print(text: str) -> None:
    if text:
        print(text, flush=True)


# Each kind of record: how the Cloud looks one up, and its collection in API resource names.
_LOOKUP = {"nodes": Cloud.node, "queued": Cloud.queued}
_COLLECTION = {"nodes": "nodes", "queued": "queuedResources"}


def _record_or_fail(cloud: Cloud, parsed: Parsed, kind: str, name: str) -> dict[str, Any]:
    project, zone = where(parsed)
    with cloud.lock():
        cloud.refresh(project, zone)
        record = _LOOKUP[kind](cloud, project, zone, name)
    if record is None:
        raise CloudError(parsed, f"NOT_FOUND: Resource "
                         f"'{_resource_name(_COLLECTION[kind], project, zone, name)}' was not found")
    return record


def _list(cloud: Cloud, parsed: Parsed, kind: str, view: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """`list`: every record of `kind` in the zone, as `view` shows it."""
    project, zone = where(parsed)
    with cloud.lock():
        cloud.refresh(project, zone)
        items = [view(r) for r in cloud.all(kind, project, zone)]
    _print(render(parsed, items))
    return 0


# ---------------------------------------------------------------------- tpu-vm
def _workers_of(parsed: Parsed, accelerator: str) -> int:
    from deploy.tpu_accelerators import parse_accelerator  # the table the launcher uses
    from job.errors import ConfigError

    try:
        return parse_accelerator(accelerator).hosts
    except ConfigError as e:
        raise CloudError(parsed, f"INVALID_ARGUMENT: accelerator type {accelerator!r} is not available: {e}") from e


def node_create(cloud: Cloud, parsed: Parsed) -> int:
    project, zone = where(parsed)
    name = parsed.positionals[0]
    accelerator = str(parsed.get("accelerator-type", "v2-8"))  # gcloud's default type
    workers = _workers_of(parsed, accelerator)
    with cloud.lock():
        cloud.refresh(project, zone)
        if cloud.node(project, zone, name) is not None:
            raise CloudError(parsed, f"ALREADY_EXISTS: Resource '{_resource_name('nodes', project, zone, name)}' "
                             "already exists")
        record = cloud.new_node(project, zone, name, accelerator, str(parsed.get("version")), workers,
                                spot=bool(parsed.get("spot")), preemptible=bool(parsed.get("preemptible")))
    print(f"Create request issued for: [{name}]", file=sys.stderr, flush=True)
    while not parsed.get("async"):
        with cloud.lock():
            cloud.refresh(project, zone)
            record = cloud.node(project, zone, name) or record
        if record["state"] != "CREATING":
            break
        time.sleep(0.1)
    print(f"Created tpu [{name}].", file=sys.stderr, flush=True)
    return 0


def _node_or_fail(cloud: Cloud, parsed: Parsed, name: str) -> dict[str, Any]:
    return _record_or_fail(cloud, parsed, "nodes", name)


def node_describe(cloud: Cloud, parsed: Parsed) -> int:
    _print(render(parsed, [node_view(_node_or_fail(cloud, parsed, parsed.positionals[0]))]))
    return 0


def node_list(cloud: Cloud, parsed: Parsed) -> int:
    return _list(cloud, parsed, "nodes", node_view)


def node_delete(cloud: Cloud, parsed: Parsed) -> int:
    project, zone = where(parsed)
    name = parsed.positionals[0]
    _node_or_fail(cloud, parsed, name)
    with cloud.lock():
        cloud.drop_node(project, zone, name)  # running ssh sessions see it gone and kill their workers
    print(f"Deleted tpu [{name}].", file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------------- queued-resources
def queued_create(cloud: Cloud, parsed: Parsed) -> int:
    project, zone = where(parsed)
    name, node_id = parsed.positionals[0], str(parsed.get("node-id"))
    accelerator = str(parsed.get("accelerator-type"))
    workers = _workers_of(parsed, accelerator)
    with cloud.lock():
        cloud.refresh(project, zone)
        if cloud.queued(project, zone, name) is not None:
            raise CloudError(parsed, f"ALREADY_EXISTS: Resource "
                             f"'{_resource_name('queuedResources', project, zone, name)}' already exists")
        if cloud.node(project, zone, node_id) is not None:
            raise CloudError(parsed, f"ALREADY_EXISTS: node {node_id} already exists")
        cloud.put_queued({
            "project": project, "zone": zone, "name": name, "nodeId": node_id, "acceleratorType": accelerator,
            "runtimeVersion": str(parsed.get("runtime-version")), "workers": workers,
            "spot": bool(parsed.get("spot")), "state": "ACCEPTED",
            "active_at": time.time() + float(os.environ.get(QUEUE_SECONDS_ENV, "0")),
        })
    print(f"Create request issued for: [{name}]", file=sys.stderr, flush=True)
    return 0


def _queued_or_fail(cloud: Cloud, parsed: Parsed) -> dict[str, Any]:
    return _record_or_fail(cloud, parsed, "queued", parsed.positionals[0])


def queued_describe(cloud: Cloud, parsed: Parsed) -> int:
    _print(render(parsed, [queued_view(_queued_or_fail(cloud, parsed))]))
    return 0


def queued_list(cloud: Cloud, parsed: Parsed) -> int:
    return _list(cloud, parsed, "queued", queued_view)


def queued_delete(cloud: Cloud, parsed: Parsed) -> int:
    project, zone = where(parsed)
    record = _queued_or_fail(cloud, parsed)
    with cloud.lock():
        node = cloud.node(project, zone, record["nodeId"])
        if node is not None and not parsed.get("force"):
            raise CloudError(parsed, f"FAILED_PRECONDITION: queued resource {record['name']} still holds node "
                             f"{record['nodeId']}; delete the node first or pass --force")
        if node is not None:
            cloud.drop_node(project, zone, record["nodeId"])
        cloud.drop_queued(project, zone, record["name"])
    print(f"Deleted queued resource [{record['name']}].", file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------------- scp
def _remote_path(parsed: Parsed, home: Path, path: str) -> Path:
    rel = path[2:] if path.startswith("~/") else ("" if path == "~" else path)
    if rel.startswith("/") or ".." in Path(rel).parts:
        raise CloudError(parsed, f"the simulator models only paths under the worker's home, not {path!r}")
    return home / rel


def _copy(parsed: Parsed, src: Path, dest: Path) -> None:
    if not src.exists():
        raise CloudError(parsed, f"scp: {src}: No such file or directory")
    if dest.is_dir():
        dest = dest / src.name
    if src.is_dir():
        if not parsed.get("recurse"):
            raise CloudError(parsed, f"scp: {src}: not a regular file (pass --recurse)")
        shutil.copytree(src, dest, dirs_exist_ok=True)
    else:
        if not dest.parent.is_dir():
            raise CloudError(parsed, f"scp: {dest.parent}: No such file or directory")
        shutil.copyfile(src, dest)


def scp(cloud: Cloud, parsed: Parsed, workers: list[int], record: dict[str, Any]) -> int:
    *sources, dest = parsed.positionals
    name = record["name"]
    project, zone = where(parsed)
    if dest.startswith(f"{name}:"):
        if any(":" in s for s in sources):
            raise CloudError(parsed, "scp: copying between two remote hosts is not supported")
        for worker in workers:
            target = _remote_path(parsed, cloud.home(project, zone, name, worker), dest.split(":", 1)[1])
            for source in sources:
                _copy(parsed, Path(source), target)
        return 0
    if len(sources) != 1 or not sources[0].startswith(f"{name}:"):
        raise CloudError(parsed, f"Source(s) must be remote when destination is local.  Got sources: "
                         f"[{', '.join(sources)}], destination: {dest}")
    for worker in workers:
        _copy(parsed, _remote_path(parsed, cloud.home(project, zone, name, worker), sources[0].split(":", 1)[1]),
              Path(dest))
    return 0
