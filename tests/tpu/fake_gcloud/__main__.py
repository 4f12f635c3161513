"""`gcloud ...` for the simulator (the `gcloud` shell shim runs `python -m tests.tpu.fake_gcloud`)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
import urllib.parse
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
    ("accelerator-types", "list"): commands.accelerator_types_list,
    ("versions", "list"): commands.versions_list,
    ("auth", "configure-docker"): configure_docker,
    ("auth", "list"): commands.auth_list,
    ("config", "get-value"): commands.config_get_value,
}
# What the real CLI says when a command that calls the API has no project, or no account to call it with.
NO_PROJECT = ("The required property [project] is not currently set.\nIt can be set on a per-command basis by "
              "re-running your command with the [--project] flag.\n\nYou may set it for your current workspace by "
              "running:\n\n  $ gcloud config set project VALUE\n\nor it can be set temporarily by the environment "
              "variable [CLOUDSDK_CORE_PROJECT]")
NO_ACCOUNT = ("You do not currently have an active account selected.\nPlease run:\n\n  $ gcloud auth login\n\nto "
              "obtain new credentials.\n\nIf you have already logged in with a different account, run:\n\n  $ gcloud "
              "config set account ACCOUNT\n\nto select an already authenticated account to use.")
NO_CREDENTIALS = ("Your current active account [{account}] does not have any valid credentials\nPlease run:\n\n  $ "
                  "gcloud auth login\n\nto obtain new credentials.")


def _require_zone(parsed: Parsed) -> None:
    """The simulator has no configured default zone, so a command without --zone fails like gcloud's."""
    if parsed.form.path[0] != "compute":
        return
    if parsed.get("zone") is None:
        group, command = parsed.form.path[2:4]
        resource = ("zone" if command in ("accelerator-types", "versions")  # these list what a location offers
                    else "queued_resource" if group == "queued-resources" else "tpu")
        raise CloudError(parsed, f"Error parsing [{resource}].\nThe [{resource}] resource is not properly "
                         "specified.\nFailed to find attribute [zone]. Fix: pass --zone=ZONE")


def _signed_in(cloud: Cloud, parsed: Parsed) -> Parsed:
    """A command that calls the Cloud TPU API needs a project (--project, CLOUDSDK_CORE_PROJECT or the configured
    one: checked first, as gcloud resolves it while parsing) and an account with credentials (--account or the
    active one). `parsed` with the project filled in."""
    if parsed.form.path[0] != "compute":
        return parsed
    project = parsed.get("project") or cloud.property("core/project")
    if not project:
        raise CloudError(parsed, NO_PROJECT)
    account = parsed.get("account") or cloud.property("core/account")
    if not account:
        raise CloudError(parsed, NO_ACCOUNT)
    if account not in cloud.config()["accounts"]:
        raise CloudError(parsed, NO_CREDENTIALS.format(account=account))
    return dataclasses.replace(parsed, flags={**parsed.flags, "project": project})


# The Cloud TPU API's endpoint from gcloud's environment (api_endpoint_overrides/tpu): when set, a command that
# calls the API connects there first, as the real CLI does; unset, the simulated API is always reachable.
API_OVERRIDE = "CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU"
RETRY_WAITS_S = (1, 2, 4, 8, 16)  # gcloud 528's retries of a connection that fails (apitools: 2 ** attempt)
RESOURCES = {"accelerator-types": "acceleratorTypes", "versions": "runtimeVersions",
             "queued-resources": "queuedResources"}


def _reach_api(parsed: Parsed) -> str | None:
    """A command that calls the API, with API_OVERRIDE set: connect to it; when that fails, retry as gcloud does
    (about 30 s) and then crash: its ConnectionError's message, for stderr and exit code 1 (as measured on gcloud
    528 with the endpoint a closed port, and with no network at all). None when it connects."""
    endpoint = os.environ.get(API_OVERRIDE)
    if parsed.form.path[0] != "compute" or not endpoint:
        return None
    url = urllib.parse.urlsplit(endpoint)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    for wait in (*RETRY_WAITS_S, None):
        try:
            socket.create_connection((host, port), timeout=10).close()
            return None
        except OSError as exc:
            error = exc
        if wait is not None:
            time.sleep(wait)
    group = parsed.form.path[3] if parsed.form.path[2] == "tpu-vm" else parsed.form.path[2]
    path = (f"/v2/projects/{parsed.get('project')}/locations/{parsed.get('zone')}/"
            f"{RESOURCES.get(group, 'nodes')}?alt=json")
    pool = "HTTPSConnectionPool" if url.scheme == "https" else "HTTPConnectionPool"
    return (f"ERROR: gcloud crashed (ConnectionError): {pool}(host='{host}', port={port}): Max retries exceeded "
            f"with url: {path} (Caused by NewConnectionError('<urllib3.connection.HTTPConnection object>: Failed to "
            f"establish a new connection: [Errno {error.errno}] {error.strerror}'))\n\nIf you would like to report "
            "this issue, please run the following command:\n  gcloud feedback\n\nTo check gcloud for common "
            "problems, please run the following command:\n  gcloud info --run-diagnostics")


def main(argv: list[str]) -> int:
    cloud = Cloud.from_env()
    cloud.record_call(argv)
    try:
        parsed = parse(argv)
        _require_zone(parsed)
        parsed = _signed_in(cloud, parsed)
        crashed = _reach_api(parsed)
        if crashed is not None:
            print(crashed, file=sys.stderr, flush=True)
            return 1
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
