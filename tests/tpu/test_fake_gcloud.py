"""The gcloud simulator itself: strict about forms and flags, stateful, and a faithful set of workers."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.launching import explain
from tests.tpu import fake_gcloud
from tests.tpu.harness import ZONE, Cloud

TPU_VM = ("compute", "tpus", "tpu-vm")
QR = ("compute", "tpus", "queued-resources")
Z = f"--zone={ZONE}"
V = "--version=tpu-ubuntu2204-base"  # a runtime version every TPU zone offers (catalog.py)
RV = "--runtime-version=tpu-ubuntu2204-base"


def create(cloud: Cloud, name: str = "pod-1", accelerator: str = "v4-32", *extra: str) -> None:
    proc = cloud.gcloud(*TPU_VM, "create", name, Z, f"--accelerator-type={accelerator}",
                        "--version=tpu-ubuntu2204-base", *extra)
    assert proc.returncode == 0, explain(proc)


def node_state(cloud: Cloud, name: str = "pod-1") -> str:
    proc = cloud.gcloud(*TPU_VM, "describe", name, Z, "--format=value(state)")
    return proc.stdout.strip() if proc.returncode == 0 else "NOT_FOUND"


# Each row was checked against the real gcloud 528's parser: the same exit code and the same kind of message
# (`start` excepted: real, but not simulated).
@pytest.mark.parametrize(("argv", "code", "says"), [
    (("compute", "tpus", "tpu-vm", "frobnicate", "x", Z), 2, "Invalid choice: 'frobnicate'"),
    (("compute", "tpu", "tpu-vm"), 2, "Invalid choice: 'tpu'"),
    ((*TPU_VM,), 2, "Command name argument expected"),
    ((*TPU_VM, "create", "p", Z, "--version=v", "--bogus"), 2, "unrecognized arguments: --bogus"),
    ((*TPU_VM, "create", "p", Z, "--accelerator-type=v4-8"), 2, "argument --version: Must be specified"),
    ((*TPU_VM, "create", "p", Z, "--runtime-version=v"), 2, "unrecognized arguments: --runtime-version=v"),
    ((*TPU_VM, "create", "p", "q", Z, "--version=v"), 2, "unrecognized arguments: q"),
    ((*TPU_VM, "create", "p", Z, "--version=v", "--spot=yes"), 2,
     "argument --spot: ignored explicit argument 'yes'"),
    ((*TPU_VM, "create", "p", "--accelerator-type=v4-8", "--version=v"), 1, "Error parsing [tpu]"),
    ((*QR, "create", "q", Z, "--node-id=q", "--accelerator-type=v4-8", "--version=v"), 2,
     "unrecognized arguments: --version=v"),
    ((*QR, "create", "q", Z, "--accelerator-type=v4-8", "--runtime-version=v"), 2,
     "Exactly one of (--node-id | [--node-count : --node-prefix]) must be specified."),
    ((*QR, "create", "q", Z, "--node-id=q", "--runtime-version=v"), 2,
     "Exactly one of (--accelerator-type | --topology --type) must be specified."),
    ((*QR, "create", "q", Z, "--node-id=q", "--accelerator-type=v4-8", "--runtime-version=v", "--best-effort"), 2,
     "unrecognized arguments: --best-effort"),
    ((*QR, "create", "q", Z, "--node-id=q", "--accelerator-type=v4-8", "--runtime-version=v",
      "--valid-until-duration=six hours"), 1, "Bad value"),
    ((*TPU_VM, "describe", Z), 2, "Must be specified"),
    ((*TPU_VM, "delete", "p", Z, "--", "-x"), 2, "unrecognized arguments: -- -x"),
    ((*TPU_VM, "scp", "a", "b", Z), 1, "Source(s) must be remote when destination is local"),
    ((*TPU_VM, "start", "p", Z), 2, "does not model"),  # real, but not simulated
    ((*TPU_VM, "create", "p", Z, "--version=v", "--internal-ip"), 2, "unrecognized arguments: --internal-ip"),
    ((*TPU_VM, "create", "p", Z, "--version=v", "--tags=Web_Server"), 2, "argument --tags: Bad value"),
    ((*TPU_VM, "ssh", "p", Z, "--internal-ips", "--command=true"), 2, "unrecognized arguments: --internal-ips"),
    ((*TPU_VM, "scp", "a", "p:b", Z, "--internal-ips"), 2, "unrecognized arguments: --internal-ips"),
    ((*QR, "create", "q", Z, "--node-id=q", "--accelerator-type=v4-8", "--runtime-version=v", "--internal-ip"), 2,
     "unrecognized arguments: --internal-ip"),
    ((*QR, "create", "q", Z, "--node-count=2", "--accelerator-type=v4-8", "--runtime-version=v"), 2,
     "argument --node-prefix: Must be specified."),
    ((*QR, "create", "q", Z, "--node-prefix=q", "--accelerator-type=v4-8", "--runtime-version=v"), 2,
     "Exactly one of (--node-id | [--node-count : --node-prefix]) must be specified."),
    ((*QR, "create", "q", Z, "--node-id=q", "--node-count=2", "--node-prefix=q", "--accelerator-type=v4-8",
      "--runtime-version=v"), 2, "At most one of --node-id | --node-count --node-prefix can be specified."),
    ((*QR, "create", "q", Z, "--node-count=0", "--node-prefix=q", "--accelerator-type=v4-8",
      "--runtime-version=v"), 2, "argument --node-count: Bad value [0]"),
    ((*QR, "create", "q", Z, "--node-id=q", "--accelerator-type=v4-8", "--runtime-version=v", "--spot",
      "--reserved"), 2, "At most one of --guaranteed | --reserved | --spot can be specified."),
])
def test_unknown_forms_and_flags_are_refused_like_the_real_cli(cloud: Cloud, argv: tuple[str, ...], code: int,
                                                               says: str) -> None:
    proc = cloud.gcloud(*argv)
    assert proc.returncode == code, explain(proc)
    assert proc.stderr.startswith("ERROR: (gcloud") and says in proc.stderr, proc.stderr
    assert cloud.calls() == [list(argv)]  # every call is recorded, refused ones too


# The forms added for the doctor, read from the gcloud reference pages (not run through the real parser).
@pytest.mark.parametrize(("argv", "code", "says"), [
    (("auth", "list", "--bogus"), 2, "unrecognized arguments: --bogus"),
    (("auth", "login"), 2, "does not model"),
    (("config", "get-value"), 2, "argument SECTION/PROPERTY: Must be specified."),
    (("config", "get-value", "core/nonsense"), 1, "Section [core] has no property [nonsense]."),
    ((*TPU_VM, "versions", "list", "--format=value(version)"), 1, "Error parsing [zone]"),
    ((*TPU_VM, "accelerator-types", "list", Z, "--limit=0"), 2, "argument --limit: Bad value [0]"),
    ((*TPU_VM, "accelerator-types", "list", Z, "--filter=type~v4"), 2, "models --filter=KEY:VALUE"),
    ((*TPU_VM, "accelerator-types", "describe", "v4-8", Z), 2, "does not model"),
    ((*TPU_VM, "versions", "frobnicate"), 2, "Invalid choice: 'frobnicate'"),
])
def test_the_doctors_questions_are_as_strict_as_the_rest(cloud: Cloud, argv: tuple[str, ...], code: int,
                                                         says: str) -> None:
    proc = cloud.gcloud(*argv)
    assert proc.returncode == code, explain(proc)
    assert proc.stderr.startswith("ERROR: (gcloud") and says in proc.stderr, proc.stderr


def test_login_and_project_are_gclouds_own_and_every_api_call_needs_both(cloud: Cloud) -> None:
    active = cloud.gcloud("auth", "list", "--filter=status:ACTIVE", "--format=value(account)")
    assert (active.returncode, active.stdout) == (0, "tester@example.com\n"), explain(active)
    assert cloud.gcloud("config", "get-value", "project").stdout == "fake-project\n"
    fake_gcloud.set_login(cloud.state, ["a@example.com", "b@example.com"], active="b@example.com")
    both = cloud.gcloud("auth", "list", "--format=value(account,status)")
    assert both.stdout.splitlines() == ["a@example.com\t", "b@example.com\tACTIVE"], explain(both)
    assert cloud.gcloud(*TPU_VM, "list", Z).returncode == 0

    fake_gcloud.set_login(cloud.state, [])
    none = cloud.gcloud("auth", "list", "--filter=status:ACTIVE", "--format=value(account)")
    assert (none.returncode, none.stdout) == (0, "") and "No credentialed accounts." in none.stderr
    refused = cloud.gcloud(*TPU_VM, "create", "pod-1", Z, "--accelerator-type=v4-8", V)
    assert refused.returncode == 1 and "You do not currently have an active account selected" in refused.stderr
    assert "active account" in cloud.gcloud(*TPU_VM, "describe", "pod-1", Z).stderr  # every API call

    fake_gcloud.set_login(cloud.state, ["a@example.com"], active="a@example.com")
    fake_gcloud.set_property(cloud.state, "core/project", None)
    unset = cloud.gcloud("config", "get-value", "project")
    assert (unset.returncode, unset.stdout, unset.stderr.strip()) == (0, "", "(unset)")
    no_project = cloud.gcloud(*TPU_VM, "versions", "list", Z)
    assert no_project.returncode == 1 and "The required property [project] is not currently set" in no_project.stderr
    assert cloud.gcloud(*TPU_VM, "versions", "list", Z, "--project=my-project").returncode == 0
    env = {**cloud.env(), "CLOUDSDK_CORE_PROJECT": "env-project"}  # cloud.env() drops the caller's CLOUDSDK_*
    from_env = subprocess.run([str(fake_gcloud.BIN_DIR / "gcloud"), "config", "get-value", "project"], env=env,
                              capture_output=True, text=True, timeout=60)
    assert from_env.stdout == "env-project\n", explain(from_env)


def test_each_zone_offers_its_own_types_and_versions_and_creates_nothing_else(cloud: Cloud) -> None:
    types = cloud.gcloud(*TPU_VM, "accelerator-types", "list", Z, "--format=value(type)").stdout.split()
    assert types[0] == "v4-8" and types[-1] == "v4-4096" and all(t.startswith("v4-") for t in types)
    west = cloud.gcloud(*TPU_VM, "accelerator-types", "list", "--zone=us-west4-a", "--format=value(type)")
    assert "v5litepod-16" in west.stdout.split() and "v4-8" not in west.stdout
    nowhere = cloud.gcloud(*TPU_VM, "accelerator-types", "list", "--zone=antarctica-south1-a", "--format=json")
    assert (nowhere.returncode, nowhere.stdout.strip()) == (0, "[]")
    one = cloud.gcloud(*TPU_VM, "accelerator-types", "list", Z, "--filter=type:v4-32", "--format=json")
    assert json.loads(one.stdout) == [{"name": f"projects/fake-project/locations/{ZONE}/acceleratorTypes/v4-32",
                                       "type": "v4-32"}]
    versions = cloud.gcloud(*TPU_VM, "versions", "list", Z, "--format=value(version)", "--limit=2").stdout.split()
    assert versions == ["tpu-ubuntu2204-base", "tpu-vm-base"]

    elsewhere = cloud.gcloud(*TPU_VM, "create", "pod-1", Z, "--accelerator-type=v5p-8", V)
    assert elsewhere.returncode == 1 and f"the accelerator v5p-8 was not found in zone {ZONE}" in elsewhere.stderr
    unknown = cloud.gcloud(*QR, "create", "q1", Z, "--node-id=q1", "--accelerator-type=v4-8", "--runtime-version=v")
    assert unknown.returncode == 1 and f"runtime version v was not found in zone {ZONE}" in unknown.stderr
    default_type = cloud.gcloud(*TPU_VM, "create", "pod-1", Z, V)  # gcloud's default type, v2-8: not in us-central2-b
    assert default_type.returncode == 1 and "v2-8 was not found" in default_type.stderr
    assert (node_state(cloud), node_state(cloud, "q1")) == ("NOT_FOUND", "NOT_FOUND")

    fake_gcloud.set_offer(cloud.state, ZONE, runtime_versions=["tpu-vm-base"])
    withdrawn = cloud.gcloud(*TPU_VM, "create", "pod-1", Z, "--accelerator-type=v4-8", V)
    assert withdrawn.returncode == 1 and "runtime version tpu-ubuntu2204-base was not found" in withdrawn.stderr
    offered = cloud.gcloud(*TPU_VM, "create", "pod-1", Z, "--accelerator-type=v4-8", "--version=tpu-vm-base")
    assert offered.returncode == 0 and node_state(cloud) == "READY", explain(offered)


def test_node_lifecycle_and_api_errors(cloud: Cloud) -> None:
    assert node_state(cloud) == "NOT_FOUND"
    create(cloud, "pod-1", "v4-32", "--spot", "--project=my-project")
    assert node_state(cloud) == "NOT_FOUND"  # another project
    proc = cloud.gcloud(*TPU_VM, "describe", "pod-1", Z, "--project=my-project", "--format=json")
    view = json.loads(proc.stdout)
    assert (view["state"], view["acceleratorType"], view["schedulingConfig"]["spot"]) == ("READY", "v4-32", True)
    assert len(view["networkEndpoints"]) == 4
    again = cloud.gcloud(*TPU_VM, "create", "pod-1", Z, V, "--project=my-project")
    assert again.returncode == 1 and "ALREADY_EXISTS" in again.stderr
    bad = cloud.gcloud(*TPU_VM, "create", "pod-2", Z, "--accelerator-type=v4-12", "--version=v")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    assert fake_gcloud.preempt(cloud.state, "pod-1", ZONE, project="my-project")
    assert fake_gcloud.node(cloud.state, "pod-1", ZONE, project="my-project")["state"] == "PREEMPTED"
    ssh = cloud.gcloud(*TPU_VM, "ssh", "pod-1", Z, "--project=my-project", "--command=true")
    assert ssh.returncode == 1 and "not READY" in ssh.stderr
    assert cloud.gcloud(*TPU_VM, "delete", "pod-1", Z, "--quiet", "--project=my-project").returncode == 0
    missing = cloud.gcloud(*TPU_VM, "delete", "pod-1", Z, "--quiet", "--project=my-project")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_creation_takes_time_when_asked(cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_GCLOUD_CREATE_SECONDS", "1.5")
    create(cloud, "pod-1", "v4-8", "--async")
    assert node_state(cloud) == "CREATING"
    time.sleep(1.6)
    assert node_state(cloud) == "READY"


def test_queued_resource_waits_for_capacity_then_suspends_when_preempted(cloud: Cloud,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_GCLOUD_QUEUE_SECONDS", "6")  # each gcloud call starts a python: ~1 s on a busy machine
    proc = cloud.gcloud(*QR, "create", "q1", Z, "--node-id=q1", "--accelerator-type=v4-16", RV, "--spot",
                        "--valid-until-duration=6h")
    assert proc.returncode == 0, explain(proc)

    def qr_state() -> str:
        return cloud.gcloud(*QR, "describe", "q1", Z, "--format=value(state.state)").stdout.strip()

    assert (qr_state(), node_state(cloud, "q1")) == ("ACCEPTED", "NOT_FOUND")
    until = time.monotonic() + 30
    while qr_state() == "ACCEPTED" and time.monotonic() < until:
        time.sleep(0.5)
    assert (qr_state(), node_state(cloud, "q1")) == ("ACTIVE", "READY")
    assert fake_gcloud.preempt(cloud.state, "q1", ZONE)
    assert (qr_state(), node_state(cloud, "q1")) == ("SUSPENDED", "PREEMPTED")
    refused = cloud.gcloud(*QR, "delete", "q1", Z, "--quiet")
    assert refused.returncode == 1 and "--force" in refused.stderr
    assert cloud.gcloud(*QR, "delete", "q1", Z, "--quiet", "--force").returncode == 0
    assert (node_state(cloud, "q1"), cloud.gcloud(*QR, "list", Z, "--format=json").stdout.strip()) == ("NOT_FOUND", "[]")


def test_ssh_runs_one_tpu_worker_per_host_each_in_its_own_home(cloud: Cloud) -> None:
    create(cloud)
    script = ('echo "$TPU_WORKER_ID|$TPU_WORKER_HOSTNAMES|$JOB_COORDINATOR_PORT|$JAX_PLATFORMS|$XLA_FLAGS|$HOME|$PWD|'
              '$(command -v python3)|$(python3 -c "import importlib.util as u; print(bool(u.find_spec(\'jax\')))")"')
    first = cloud.gcloud(*TPU_VM, "ssh", "pod-1", Z, "--worker=all", f"--command={script}")
    assert first.returncode == 0, explain(first)
    rows = sorted(line.split("|") for line in first.stdout.splitlines())
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert {r[1] for r in rows} == {"127.0.0.1,127.0.0.1,127.0.0.1,127.0.0.1"}
    assert len({r[2] for r in rows}) == 1 and {r[3] for r in rows} == {"cpu"}
    assert {r[4] for r in rows} == {"--xla_force_host_platform_device_count=1"}
    assert len({r[5] for r in rows}) == 4 and all(r[5] == r[6] for r in rows)
    assert all(r[7].startswith(str(cloud.state)) and r[8] == "True" for r in rows)  # the VM's python has jax
    second = cloud.gcloud(*TPU_VM, "ssh", "pod-1", Z, "--worker=all", f"--command={script}")
    assert second.stdout.split("|")[2] == rows[0][2]  # one coordinator port per node (its network), every session


def test_ssh_worker_selection_and_exit_status(cloud: Cloud) -> None:
    create(cloud)
    script = "--command=echo $TPU_WORKER_ID; exit $TPU_WORKER_ID"
    some = cloud.gcloud(*TPU_VM, "ssh", "pod-1", Z, "--worker=1,3", script)
    assert (some.returncode, sorted(some.stdout.split())) == (1, ["1", "3"])
    assert cloud.gcloud(*TPU_VM, "ssh", "pod-1", Z, "--worker=0-2", "--command=exit 0").returncode == 0
    out_of_range = cloud.gcloud(*TPU_VM, "ssh", "pod-1", Z, "--worker=4", "--command=true")
    assert out_of_range.returncode == 1 and "workers 0-3" in out_of_range.stderr
    malformed = cloud.gcloud(*TPU_VM, "ssh", "pod-1", Z, "--worker=first", "--command=true")
    assert malformed.returncode == 1 and "Invalid value for [--worker]" in malformed.stderr
    interactive = cloud.gcloud(*TPU_VM, "ssh", "pod-1", Z)
    assert interactive.returncode == 1 and "--command" in interactive.stderr


def test_preemption_terms_the_workers_and_drops_the_connection(cloud: Cloud) -> None:
    create(cloud, "pod-1", "v4-16")
    fake_gcloud.schedule_preemption(cloud.state, "pod-1", ZONE, after_s=1.0)
    script = "trap 'echo saved >term-$TPU_WORKER_ID; exit 75' TERM; while :; do sleep 0.05; done"
    proc = cloud.gcloud(*TPU_VM, "ssh", "pod-1", Z, "--worker=all", f"--command={script}")
    assert proc.returncode == 255 and "closed by remote host" in proc.stderr, explain(proc)
    assert node_state(cloud) == "PREEMPTED"
    homes = cloud.state / "homes" / "fake-project" / ZONE / "pod-1"
    assert sorted(p.name for p in homes.glob("worker-*/term-*")) == ["term-0", "term-1"]
    assert fake_gcloud.kill_leftovers(cloud.state) == []


def test_scp_uploads_to_every_worker_and_downloads_from_one(cloud: Cloud, tmp_path: Path) -> None:
    create(cloud, "pod-1", "v4-16")
    (tmp_path / "code.tar.gz").write_text("archive")
    up = cloud.gcloud(*TPU_VM, "scp", str(tmp_path / "code.tar.gz"), "pod-1:code.tar.gz", Z, "--worker=all")
    assert up.returncode == 0, explain(up)
    homes = cloud.state / "homes" / "fake-project" / ZONE / "pod-1"
    assert [(h / "code.tar.gz").read_text() for h in sorted(homes.iterdir())] == ["archive", "archive"]
    folder = tmp_path / "folder"
    folder.mkdir()
    refused = cloud.gcloud(*TPU_VM, "scp", str(folder), "pod-1:~/", Z, "--worker=0")
    assert refused.returncode == 1 and "--recurse" in refused.stderr
    down = cloud.gcloud(*TPU_VM, "scp", "pod-1:~/code.tar.gz", str(tmp_path / "back"), Z, "--worker=1")
    assert down.returncode == 0 and (tmp_path / "back").read_text() == "archive"
    outside = cloud.gcloud(*TPU_VM, "scp", "pod-1:/etc/passwd", str(tmp_path / "x"), Z, "--worker=0")
    assert outside.returncode == 1 and "home" in outside.stderr


NETWORK = ("--internal-ips", "--network=my-vpc", "--subnetwork=my-subnet",
           "--service-account=job@my-project.iam.gserviceaccount.com", "--tags=tpu,train", "--scopes=cloud-platform",
           "--labels=team=ml", "--metadata=k=v", "--data-disk=source=d,mode=read-only")


def test_every_capacity_and_network_flag_of_the_real_cli_is_accepted_and_kept(cloud: Cloud) -> None:
    create(cloud, "pod-1", "v4-16", "--reserved", *NETWORK)
    view = json.loads(cloud.gcloud(*TPU_VM, "describe", "pod-1", Z, "--format=json").stdout)
    assert view["schedulingConfig"]["reserved"] and view["tags"] == ["tpu", "train"]
    assert view["networkConfig"] == {"network": "my-vpc", "subnetwork": "my-subnet", "enableExternalIps": False}
    assert view["serviceAccount"]["email"] == "job@my-project.iam.gserviceaccount.com"
    ssh = cloud.gcloud(*TPU_VM, "ssh", "pod-1", Z, "--worker=all", "--internal-ip", "--command=echo $TPU_WORKER_ID")
    assert ssh.returncode == 0 and sorted(ssh.stdout.split()) == ["0", "1"], explain(ssh)
    down = cloud.gcloud(*TPU_VM, "scp", "pod-1:~/", str(cloud.local), Z, "--worker=0", "--internal-ip", "--recurse")
    assert down.returncode == 0, explain(down)
    queued = cloud.gcloud(*QR, "create", "q1", Z, "--node-id=q1", "--accelerator-type=v4-8", RV, "--reserved",
                          *NETWORK, "--valid-until-duration=6h", "--async")
    assert queued.returncode == 0, explain(queued)
    assert json.loads(cloud.gcloud(*TPU_VM, "describe", "q1", Z, "--format=json").stdout)["tags"] == ["tpu", "train"]


def test_node_count_and_prefix_create_several_slices_named_prefix_dash_index(cloud: Cloud) -> None:
    proc = cloud.gcloud(*QR, "create", "multi", Z, "--node-count=3", "--node-prefix=ms", "--accelerator-type=v4-16",
                        "--runtime-version=tpu-ubuntu2204-base", "--spot")
    assert proc.returncode == 0, explain(proc)
    listed = cloud.gcloud(*TPU_VM, "list", Z, "--format=value(name,state)").stdout.split()
    nodes = f"projects/fake-project/locations/{ZONE}/nodes"
    assert listed == [f"{nodes}/ms-0", "READY", f"{nodes}/ms-1", "READY", f"{nodes}/ms-2", "READY"]
    view = json.loads(cloud.gcloud(*QR, "describe", "multi", Z, "--format=json").stdout)
    assert view["tpu"]["nodeSpec"][0]["multisliceParams"] == {"nodeCount": 3, "nodeIdPrefix": "ms"}
    assert fake_gcloud.preempt(cloud.state, "ms-1", ZONE)
    assert cloud.gcloud(*QR, "describe", "multi", Z, "--format=value(state.state)").stdout.strip() == "SUSPENDED"
    assert cloud.gcloud(*QR, "delete", "multi", Z, "--force", "--quiet").returncode == 0
    assert [node_state(cloud, f"ms-{i}") for i in range(3)] == ["NOT_FOUND"] * 3


def test_a_stockout_fails_a_create_and_fails_a_queued_resource_with_its_reason(cloud: Cloud) -> None:
    fake_gcloud.schedule_capacity_failures(cloud.state, ZONE, [fake_gcloud.STOCKOUT_MESSAGE, "Quota exceeded"])
    refused = cloud.gcloud(*TPU_VM, "create", "pod-1", Z, "--accelerator-type=v4-8", V, "--spot")
    assert refused.returncode == 1 and node_state(cloud) == "NOT_FOUND"
    assert refused.stderr.startswith("ERROR: (gcloud.compute.tpus.tpu-vm.create) {\"code\": 8, ")
    assert f'There is no more capacity in the zone \\"{ZONE}\\"' in refused.stderr
    proc = cloud.gcloud(*QR, "create", "q1", Z, "--node-id=q1", "--accelerator-type=v4-8", RV)
    assert proc.returncode == 0, explain(proc)
    fmt = "--format=value(state.state,state.failedData.error.message)"
    assert cloud.gcloud(*QR, "describe", "q1", Z, fmt).stdout.strip().split("\t") == ["FAILED", "Quota exceeded"]
    assert node_state(cloud, "q1") == "NOT_FOUND"
    create(cloud, "pod-1", "v4-8")  # no more failures scheduled
