"""What each accepted command does to the simulated cloud: create, describe, list, delete, scp; what a zone
offers (accelerator types, runtime versions); and gcloud's own state (`auth list`, `config get-value`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.tpu.fake_gcloud.grammar import Parsed, UsageError
from tests.tpu.fake_gcloud.state import (
    DEFAULT_PROJECT,
    PROPERTIES,
    QUEUE_SECONDS_ENV,
    Cloud,
    node_ids,
)

# What the Cloud TPU API says when a creation names what the zone does not offer (INVALID_ARGUMENT, as gcloud
# prints it; the accelerator's wording is the API's, the runtime version's follows it).
NOT_OFFERED = "INVALID_ARGUMENT: Cloud TPU received a bad request. the {what} {value} was not found in zone {zone}"


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
                                                       "preemptible": bool(record.get("preemptible")),
                                                       "reserved": bool(record.get("reserved"))},
        "networkEndpoints": [{"ipAddress": "127.0.0.1", "port": 8470}] * record["workers"],
        "networkConfig": {"network": record.get("network") or "default", "subnetwork": record.get("subnetwork")
                          or "default", "enableExternalIps": not record.get("internalIps")},
        "serviceAccount": {"email": record.get("serviceAccount") or f"default@{record['project']}.iam"},
        **({"tags": record["tags"]} if record.get("tags") else {}),
        **({"queuedResource": record["queuedResource"]} if record.get("queuedResource") else {}),
    }


def queued_view(record: dict[str, Any]) -> dict[str, Any]:
    failed = {"failedData": {"error": {"code": 8, "message": record["failure"]}}} if record["state"] == "FAILED" else {}
    nodes = node_ids(record)
    which = ({"nodeId": nodes[0]} if not record.get("nodeIds") else
             {"multisliceParams": {"nodeCount": len(nodes), "nodeIdPrefix": record["nodePrefix"]}})
    return {
        "name": _resource_name("queuedResources", record["project"], record["zone"], record["name"]),
        "state": {"state": record["state"], **failed},
        "tpu": {"nodeSpec": [{**which, "node": {
            "acceleratorType": record["acceleratorType"], "runtimeVersion": record["runtimeVersion"]}}]},
        **({"spot": {}} if record.get("spot") else {}),
        **({"reserved": True} if record.get("options", {}).get("reserved") else {}),
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


_FILTER = re.compile(r"(-?)([A-Za-z][\w.]*):(\S+)")


def listed(parsed: Parsed, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A list command's items after --filter (one term: KEY:VALUE or -KEY:VALUE, the only form modelled) and
    --limit. --sort-by is refused: the simulator does not model it."""
    if parsed.get("sort-by") is not None:
        raise UsageError(parsed.form.path, "the simulator does not model --sort-by")
    expression = parsed.get("filter")
    if expression is not None:
        term = _FILTER.fullmatch(str(expression))
        if term is None:
            raise UsageError(parsed.form.path, f"the simulator models --filter=KEY:VALUE or -KEY:VALUE only, "
                             f"not {expression!r}")
        negate, key, value = term.groups()
        items = [i for i in items if (str(_lookup(i, key) or "").lower() == value.lower()) != bool(negate)]
    limit = str(parsed.get("limit") or "unlimited")
    return items if limit == "unlimited" else items[:int(limit)]


def _list(cloud: Cloud, parsed: Parsed, kind: str, view: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """`list`: every record of `kind` in the zone, as `view` shows it."""
    project, zone = where(parsed)
    with cloud.lock():
        cloud.refresh(project, zone)
        items = [view(r) for r in cloud.all(kind, project, zone)]
    _print(render(parsed, listed(parsed, items)))
    return 0


# ---------------------------------------------------------------------- what a zone offers
def accelerator_types_list(cloud: Cloud, parsed: Parsed) -> int:
    """`tpu-vm accelerator-types list`: AcceleratorType resources (name, type)."""
    return _offered(cloud, parsed, "acceleratorTypes", "type")


def versions_list(cloud: Cloud, parsed: Parsed) -> int:
    """`tpu-vm versions list`: RuntimeVersion resources (name, version)."""
    return _offered(cloud, parsed, "runtimeVersions", "version")


def _offered(cloud: Cloud, parsed: Parsed, collection: str, field: str) -> int:
    """What the zone offers of `collection`, one resource each: its full name and its `field`."""
    project, zone = where(parsed)
    items = [{"name": f"projects/{project}/locations/{zone}/{collection}/{value}", field: value}
             for value in cloud.offer(project, zone)[collection]]
    _print(render(parsed, listed(parsed, items)))
    return 0


def _check_offered(cloud: Cloud, parsed: Parsed, accelerator: str, version: str) -> None:
    """A creation must name an accelerator type and a runtime version the zone offers."""
    project, zone = where(parsed)
    offer = cloud.offer(project, zone)
    if accelerator not in offer["acceleratorTypes"]:
        raise CloudError(parsed, NOT_OFFERED.format(what="accelerator", value=accelerator, zone=zone))
    if version not in offer["runtimeVersions"]:
        raise CloudError(parsed, NOT_OFFERED.format(what="runtime version", value=version, zone=zone))


# ---------------------------------------------------------------------- gcloud's own state
def auth_list(cloud: Cloud, parsed: Parsed) -> int:
    """`auth list`: each credentialed account, status ACTIVE for the active one (else empty); when nothing is
    shown, the real CLI's note on stderr (exit 0 all the same)."""
    active = cloud.property("core/account")
    accounts = cloud.config()["accounts"]
    if parsed.get("filter-account"):
        accounts = [a for a in accounts if a == parsed.get("filter-account")]
    items = listed(parsed, [{"account": a, "status": "ACTIVE" if a == active else ""} for a in accounts])
    if items:
        _print(render(parsed, items))
        print("\nTo set the active account, run:\n    $ gcloud config set account `ACCOUNT`\n", file=sys.stderr)
    else:
        print("\nNo credentialed accounts.\n\nTo login, run:\n  $ gcloud auth login `ACCOUNT`\n", file=sys.stderr)
    return 0


def config_get_value(cloud: Cloud, parsed: Parsed) -> int:
    """`config get-value [SECTION/]PROPERTY`: the value on stdout; `(unset)` on stderr when it has none."""
    raw = parsed.positionals[0]
    name = raw if "/" in raw else f"core/{raw}"
    if name not in PROPERTIES:
        section, _, prop = name.partition("/")
        raise CloudError(parsed, f"Section [{section}] has no property [{prop}].")
    value = cloud.property(name)
    if value:
        print(value, flush=True)
    else:
        print("(unset)", file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------------- tpu-vm
def _workers_of(parsed: Parsed, accelerator: str) -> int:
    from deploy.tpu.accelerators import parse_accelerator  # the table the launcher uses
    from job.errors import ConfigError

    try:
        return parse_accelerator(accelerator).hosts
    except ConfigError as e:
        raise CloudError(parsed, f"INVALID_ARGUMENT: accelerator type {accelerator!r} is not available: {e}") from e


def _options(parsed: Parsed) -> dict[str, Any]:
    """The creation flags a node keeps (shown by describe)."""
    found = {"reserved": bool(parsed.get("reserved")), "internalIps": bool(parsed.get("internal-ips")),
             "network": parsed.get("network"), "subnetwork": parsed.get("subnetwork"),
             "serviceAccount": parsed.get("service-account"),
             "tags": str(parsed.get("tags")).split(",") if parsed.get("tags") else None}
    return {k: v for k, v in found.items() if v}


def _stockout(cloud: Cloud, parsed: Parsed, project: str, zone: str) -> None:
    """A scheduled capacity failure: the API's RESOURCE_EXHAUSTED, as gcloud prints it."""
    message = cloud.take_capacity_failure(project, zone)
    if message is not None:
        raise CloudError(parsed, json.dumps({"code": 8, "message": message}))


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
        _check_offered(cloud, parsed, accelerator, str(parsed.get("version")))
        _stockout(cloud, parsed, project, zone)
        record = cloud.new_node(project, zone, name, accelerator, str(parsed.get("version")), workers,
                                spot=bool(parsed.get("spot")), preemptible=bool(parsed.get("preemptible")),
                                **_options(parsed))
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
    name = parsed.positionals[0]
    prefix = parsed.get("node-prefix")
    nodes = ([f"{prefix}-{i}" for i in range(int(str(parsed.get("node-count"))))] if prefix
             else [str(parsed.get("node-id"))])
    accelerator = str(parsed.get("accelerator-type"))
    workers = _workers_of(parsed, accelerator)
    with cloud.lock():
        cloud.refresh(project, zone)
        if cloud.queued(project, zone, name) is not None:
            raise CloudError(parsed, f"ALREADY_EXISTS: Resource "
                             f"'{_resource_name('queuedResources', project, zone, name)}' already exists")
        for node_id in nodes:
            if cloud.node(project, zone, node_id) is not None:
                raise CloudError(parsed, f"ALREADY_EXISTS: node {node_id} already exists")
        _check_offered(cloud, parsed, accelerator, str(parsed.get("runtime-version")))
        cloud.put_queued({
            "project": project, "zone": zone, "name": name, "nodeId": nodes[0], "acceleratorType": accelerator,
            **({"nodeIds": nodes, "nodePrefix": prefix} if prefix else {}),
            "runtimeVersion": str(parsed.get("runtime-version")), "workers": workers,
            "spot": bool(parsed.get("spot")), "state": "ACCEPTED", "options": _options(parsed),
            "failure": cloud.take_capacity_failure(project, zone),
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
        held = [n for n in node_ids(record) if cloud.node(project, zone, n) is not None]
        if held and not parsed.get("force"):
            raise CloudError(parsed, f"FAILED_PRECONDITION: queued resource {record['name']} still holds node "
                             f"{', '.join(held)}; delete the node first or pass --force")
        for node_id in held:
            cloud.drop_node(project, zone, node_id)
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
