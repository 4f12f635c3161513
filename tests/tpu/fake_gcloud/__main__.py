"""`gcloud ...` for the simulator (the `gcloud` shell shim runs `python -m tests.tpu.fake_gcloud`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.tpu.fake_gcloud import commands, ssh
from tests.tpu.fake_gcloud.commands import CloudError
from tests.tpu.fake_gcloud.grammar import Parsed, UsageError, parse
from tests.tpu.fake_gcloud.state import Cloud


def _on_workers(cloud: Cloud, parsed: Parsed) -> int:
    """ssh and scp: the node must exist and be READY."""
    name = parsed.positionals[0] if parsed.form.path[-1] == "ssh" else next(
        (p.split(":", 1)[0] for p in parsed.positionals if ":" in p), "")
    if not name:
        *sources, dest = parsed.positionals
        raise CloudError(parsed, f"Source(s) must be remote when destination is local.  Got sources: "
                         f"[{', '.join(sources)}], destination: {dest}")
    record = commands._node_or_fail(cloud, parsed, name)
    if record["state"] != "READY":
        raise CloudError(parsed, f"FAILED_PRECONDITION: node {name} is {record['state']}, not READY")
    workers = ssh.select_workers(parsed, record)
    if parsed.form.path[-1] == "ssh":
        return ssh.ssh(cloud, parsed, workers, record)
    return commands.scp(cloud, parsed, workers, record)


def configure_docker(cloud: Cloud, parsed: Parsed) -> int:
    """`gcloud auth configure-docker HOST[,HOST] --quiet`: gcloud becomes docker's credential helper for them
    (in ~/.docker/config.json, as the real command writes). Without --quiet the real one asks first."""
    if not parsed.get("quiet"):
        raise CloudError(parsed, "this command asks `Do you want to continue (Y/n)?`; the simulator answers no "
                         "prompt: pass --quiet")
    hosts = [h for h in parsed.positionals[0].split(",") if h]
    config = Path(os.environ.get("HOME", ".")) / ".docker" / "config.json"
    data = json.loads(config.read_text()) if config.exists() else {}
    data.setdefault("credHelpers", {}).update({h: "gcloud" for h in hosts})
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(data, indent=2))
    print(f"Adding credentials for: {', '.join(hosts)}", file=sys.stderr, flush=True)
    return 0


HANDLERS = {
    ("tpu-vm", "create"): commands.node_create,
    ("tpu-vm", "describe"): commands.node_describe,
    ("tpu-vm", "list"): commands.node_list,
    ("tpu-vm", "delete"): commands.node_delete,
    ("queued-resources", "create"): commands.queued_create,
    ("queued-resources", "describe"): commands.queued_describe,
    ("queued-resources", "list"): commands.queued_list,
    ("queued-resources", "delete"): commands.queued_delete,
    ("auth", "configure-docker"): configure_docker,
}


def _require_zone(parsed: Parsed) -> None:
    """The simulator has no configured default zone, so a command without --zone fails like gcloud's."""
    if parsed.form.path[0] == "auth":
        return
    if parsed.get("zone") is None:
        resource = "queued_resource" if parsed.form.path[2] == "queued-resources" else "tpu"
        raise CloudError(parsed, f"Error parsing [{resource}].\nThe [{resource}] resource is not properly "
                         "specified.\nFailed to find attribute [zone]. Fix: pass --zone=ZONE")


def main(argv: list[str]) -> int:
    cloud = Cloud.from_env()
    cloud.record_call(argv)
    try:
        parsed = parse(argv)
        _require_zone(parsed)
        handler = HANDLERS.get(parsed.form.path[-2:])
        return handler(cloud, parsed) if handler else _on_workers(cloud, parsed)
    except UsageError as e:
        print(e, file=sys.stderr, flush=True)
        return e.code
    except CloudError as e:
        print(e, file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
