"""Capacity, network and multislice options: checked before any gcloud call, sent as the real flags,
stock-outs retried until CREATE_DEADLINE, a FAILED queued resource's reason shown, several slices as one set."""

from __future__ import annotations

import argparse
import json

import pytest

from deploy.tpu import cli as tpu
from deploy.tpu.capacity import BACKOFF_CAP_S, backoff_s, is_stockout
from deploy.tpu.cli import duration_seconds, tag_list
from deploy.tpu.config import TpuConfig, slice_names
from deploy.tpu.slice import Slice, TpuError
from job.errors import ConfigError
from tests.launching import explain
from tests.tpu import fake_gcloud
from tests.tpu.harness import ROOT, ZONE, Cloud
from tests.tpu.sim_runner import SimRunner

GOOD = {"name": "pod-1", "zone": ZONE, "accelerator": "v4-8", "source_dir": str(ROOT)}
BASE_ARGV = ("--name=pod-1", f"--zone={ZONE}", "--accelerator=v4-8")
FAST = ("--poll-seconds=0.05", "--stockout-backoff=0.05")  # the stock-out waits of a test: tiny


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(("change", "what", "says"), [
    ({"spot": True, "reserved": True}, "RESERVED", "not both"),
    ({"tags": ("Web",)}, "TAGS", "RFC 1035"), ({"tags": ("a_b",)}, "TAGS", "RFC 1035"),
    ({"tags": ("ok", "")}, "TAGS", "RFC 1035"), ({"tags": tuple(f"t{i}" for i in range(65))}, "TAGS", "at most 64"),
    ({"service_account": "my-sa"}, "SERVICE_ACCOUNT", "email"),
    ({"service_account": "a b@x.com"}, "SERVICE_ACCOUNT", "email"),
    ({"network": "My VPC"}, "NETWORK", "network name"), ({"subnetwork": "sub;net"}, "SUBNETWORK", "subnetwork"),
    ({"slices": 0}, "SLICES", ">= 1"), ({"slices": 2}, "SLICES", "QUEUED=1"),
    ({"slices": 12, "queued": True, "name": "p" * 61}, "TPU_NAME", "NAME-11"),
    ({"create_deadline_s": 0.0}, "CREATE_DEADLINE", "duration > 0"),
    ({"stockout_backoff_s": float("inf")}, "--stockout-backoff", "finite"),
])
def test_bad_capacity_and_network_values_name_the_variable_expected_and_fix(change: dict, what: str,
                                                                            says: str) -> None:
    with pytest.raises(ConfigError) as info:
        TpuConfig(**{**GOOD, **change})
    message = str(info.value)
    assert what in message and says in message and "Fix:" in message, message


def test_good_values_pass_and_slices_are_named_prefix_dash_index() -> None:
    cfg = TpuConfig(**GOOD, reserved=True, internal_ip=True, network="projects/p-1/global/networks/vpc",
                    subnetwork="projects/p-1/regions/us-central2/subnetworks/sub", tags=("tpu", "a-1"),
                    service_account="job@my-project.iam.gserviceaccount.com", queued=True, slices=3)
    assert cfg.slice_names == ("pod-1-0", "pod-1-1", "pod-1-2")
    assert TpuConfig(**GOOD).slice_names == ("pod-1",) == slice_names("pod-1", 1)


@pytest.mark.parametrize(("text", "seconds"), [("2h", 7200), ("30m", 1800), ("90s", 90), ("1d", 86400),
                                               ("900", 900), ("1.5h", 5400)])
def test_create_deadline_reads_durations(text: str, seconds: float) -> None:
    assert duration_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "2 hours", "-1h", "h", "1w", "inf"])
def test_create_deadline_refuses_what_is_not_a_duration(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a duration"):
        duration_seconds(text)


def test_stockout_messages_are_recognised_and_others_are_not() -> None:
    assert is_stockout('{"code": 8, "message": "There is no more capacity in the zone \\"us-central2-b\\""}')
    assert is_stockout("RESOURCE_EXHAUSTED: Stockout in us-central2-b")
    assert is_stockout(fake_gcloud.STOCKOUT_MESSAGE)
    assert not is_stockout("PERMISSION_DENIED: the service account cannot act as job@p.iam.gserviceaccount.com")
    assert not is_stockout(None)


def test_backoff_doubles_and_is_capped() -> None:
    assert [backoff_s(60, r) for r in range(1, 6)] == [60, 120, 240, 480, BACKOFF_CAP_S]
    assert backoff_s(60, 50) == BACKOFF_CAP_S
    assert backoff_s(0.05, 3) == pytest.approx(0.2)


def test_command_line_maps_the_new_variables() -> None:
    _, cfg = tpu.parse_args(["create", *BASE_ARGV, "--reserved=1", "--internal-ip=1", "--network=vpc",
                             "--subnetwork=sub", "--service-account=job@p-1.iam.gserviceaccount.com",
                             "--tags=tpu,train", "--queued=1", "--slices=2", "--create-deadline=30m"])
    assert (cfg.reserved, cfg.internal_ip, cfg.network, cfg.subnetwork, cfg.service_account, cfg.tags, cfg.slices,
            cfg.create_deadline_s) == (True, True, "vpc", "sub", "job@p-1.iam.gserviceaccount.com",
                                       ("tpu", "train"), 2, 1800.0)
    _, plain = tpu.parse_args(["create", *BASE_ARGV, "--reserved=", "--network=", "--tags=", "--slices=1"])
    assert (plain.reserved, plain.network, plain.tags, plain.create_deadline_s) == (False, None, (), 7200.0)
    assert tag_list("a, b") == ("a", "b")


@pytest.mark.parametrize("argv", [["--spot=1", "--reserved=1"], ["--tags=Web"], ["--slices=2"],
                                  ["--service-account=nobody"], ["--queued=1", "--slices=2", "--name=" + "p" * 62]])
def test_bad_options_fail_before_any_gcloud_call(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    runner = SimRunner()
    assert tpu.main(["create", *BASE_ARGV, *argv], runner=runner) == 2
    assert runner.calls == []
    assert capsys.readouterr().err.startswith("error: ")


def test_stockout_waits_double_up_to_the_cap_and_stop_at_the_deadline() -> None:
    stockout = 'ERROR: (gcloud.compute.tpus.tpu-vm.create) {"code": 8, "message": "There is no more capacity"}'
    cfg = TpuConfig(**GOOD, spot=True, stockout_backoff_s=100.0)
    runner, sleeps = SimRunner(create_errors=[stockout] * 7), []
    assert Slice(cfg, runner, sleep=sleeps.append).ensure_ready() == "created"
    assert sleeps == [100, 200, 400, 600, 600, 600, 600] and runner.node == "READY"
    now = iter(range(0, 10**6, 1000))  # each clock reading is 1000 s later: the 2 h deadline comes at once
    late = Slice(cfg, SimRunner(create_errors=[stockout] * 99), sleep=lambda s: None, clock=lambda: float(next(now)))
    with pytest.raises(TpuError, match=r"within CREATE_DEADLINE \(7200 s, [0-9] attempts\); last reason: .*capacity"):
        late.ensure_ready()


# ---------------------------------------------------------------------- against the simulator
def created(cloud: Cloud) -> list[list[str]]:
    return [c for c in cloud.tpu_calls() if c[3] == "create"]


def test_network_options_reach_the_slice_through_make(cloud: Cloud) -> None:
    proc = cloud.make("tpu-create", TPU_NAME="pod-1", ZONE=ZONE, ACCELERATOR="v4-16", RESERVED="1", INTERNAL_IP="1",
                      NETWORK="my-vpc", SUBNETWORK="my-subnet", TAGS="tpu,train",
                      SERVICE_ACCOUNT="job@my-project.iam.gserviceaccount.com")
    assert proc.returncode == 0, explain(proc)
    view = json.loads(cloud.gcloud("compute", "tpus", "tpu-vm", "describe", "pod-1", f"--zone={ZONE}",
                                   "--format=json").stdout)
    assert (view["state"], view["tags"], view["schedulingConfig"]["reserved"]) == ("READY", ["tpu", "train"], True)
    assert view["networkConfig"] == {"network": "my-vpc", "subnetwork": "my-subnet", "enableExternalIps": False}
    assert view["serviceAccount"]["email"] == "job@my-project.iam.gserviceaccount.com"
    refused = cloud.make("tpu-create", TPU_NAME="pod-2", ZONE=ZONE, SPOT="1", RESERVED="1")
    assert refused.returncode != 0 and "not both" in refused.stderr
    assert [c[4] for c in created(cloud)] == ["pod-1"]


def test_spot_creation_retries_stockouts_then_succeeds(cloud: Cloud) -> None:
    fake_gcloud.schedule_capacity_failures(cloud.state, ZONE, [fake_gcloud.STOCKOUT_MESSAGE] * 2)
    proc = cloud.cli("create", *BASE_ARGV, "--spot=1", *FAST)
    assert proc.returncode == 0, explain(proc)
    retries = [line for line in proc.stderr.splitlines() if "stock-out creating pod-1" in line]
    assert len(retries) == 2 and all("There is no more capacity in the zone" in line for line in retries), proc.stderr
    assert "attempt 1" in retries[0] and "attempt 2" in retries[1]
    assert len(created(cloud)) == 3 and fake_gcloud.node(cloud.state, "pod-1", ZONE)["state"] == "READY"


def test_on_demand_stockout_is_one_clear_error(cloud: Cloud) -> None:
    fake_gcloud.schedule_capacity_failures(cloud.state, ZONE, [fake_gcloud.STOCKOUT_MESSAGE])
    proc = cloud.cli("create", *BASE_ARGV, *FAST)
    assert proc.returncode == 1 and "no capacity for v4-8" in proc.stderr and "QUEUED=1" in proc.stderr, explain(proc)
    assert len(created(cloud)) == 1


def test_stockouts_past_the_deadline_are_one_clear_error(cloud: Cloud) -> None:
    fake_gcloud.schedule_capacity_failures(cloud.state, ZONE, [fake_gcloud.STOCKOUT_MESSAGE] * 100)
    proc = cloud.cli("create", *BASE_ARGV, "--spot=1", "--poll-seconds=0.05", "--stockout-backoff=0.2",
                     "--create-deadline=1s")
    assert proc.returncode == 1, explain(proc)
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: no capacity for v4-8 x 1") and "CREATE_DEADLINE" in error, proc.stderr
    assert "There is no more capacity in the zone" in error
    assert 1 <= len(created(cloud)) < 10 and fake_gcloud.node(cloud.state, "pod-1", ZONE) is None


def test_a_queued_resource_failed_by_a_stockout_is_deleted_and_created_again(cloud: Cloud) -> None:
    fake_gcloud.schedule_capacity_failures(cloud.state, ZONE, [fake_gcloud.STOCKOUT_MESSAGE])
    proc = cloud.cli("create", *BASE_ARGV, "--queued=1", *FAST)
    assert proc.returncode == 0, explain(proc)
    assert "stock-out creating pod-1 (attempt 1)" in proc.stderr and "no more capacity" in proc.stderr
    verbs = [" ".join(c[2:4]) for c in cloud.tpu_calls() if c[3] in ("create", "delete")]
    assert verbs == ["queued-resources create", "queued-resources delete", "queued-resources create"]
    assert fake_gcloud.queued(cloud.state, "pod-1", ZONE)["state"] == "ACTIVE"


def test_a_queued_resource_failed_for_another_reason_is_an_error_with_that_reason(cloud: Cloud) -> None:
    reason = "Subnetwork projects/fake-project/regions/us-central2/subnetworks/sub is not found"
    fake_gcloud.schedule_capacity_failures(cloud.state, ZONE, [reason])
    proc = cloud.cli("create", *BASE_ARGV, "--queued=1", *FAST)
    assert proc.returncode == 1, explain(proc)
    assert f"error: queued resource pod-1 FAILED: {reason}" in proc.stderr
    assert len(created(cloud)) == 1
    status = cloud.cli("status", *BASE_ARGV, "--queued=1")
    assert f"queued resource FAILED: {reason}" in status.stdout, explain(status)


def test_a_queued_resource_still_waiting_for_capacity_at_the_deadline_is_left_in_line(
        cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_GCLOUD_QUEUE_SECONDS", "600")
    proc = cloud.cli("create", *BASE_ARGV, "--queued=1", *FAST, "--create-deadline=1")
    assert proc.returncode == 1, explain(proc)
    assert "error: queued resource pod-1 is still ACCEPTED after CREATE_DEADLINE (1 s)" in proc.stderr
    assert fake_gcloud.queued(cloud.state, "pod-1", ZONE)["state"] == "ACCEPTED"


def test_two_slices_are_created_checked_recreated_and_deleted_as_one_set(cloud: Cloud) -> None:
    two = {"TPU_NAME": "ms", "ZONE": ZONE, "ACCELERATOR": "v4-16", "QUEUED": "1", "SLICES": "2"}
    proc = cloud.make("tpu-create", **two)
    assert proc.returncode == 0, explain(proc)
    assert created(cloud)[0][4:8] == ["ms", f"--zone={ZONE}", "--node-count=2", "--node-prefix=ms"]
    assert [fake_gcloud.node(cloud.state, f"ms-{i}", ZONE)["state"] for i in range(2)] == ["READY", "READY"]
    status = cloud.make("tpu-status", **two)
    assert "ms: READY (ms-0 READY, ms-1 READY) (queued resource ACTIVE)" in status.stdout, explain(status)
    assert fake_gcloud.preempt(cloud.state, "ms-1", ZONE)
    status = cloud.make("tpu-status", **two)
    assert "PREEMPTED (ms-0 READY, ms-1 PREEMPTED) (queued resource SUSPENDED)" in status.stdout, explain(status)
    again = cloud.make("tpu-create", **two)
    assert again.returncode == 0, explain(again)
    assert "deleting it to create it again" in again.stderr
    assert [fake_gcloud.node(cloud.state, f"ms-{i}", ZONE)["state"] for i in range(2)] == ["READY", "READY"]
    assert len(created(cloud)) == 2
    gone = cloud.make("tpu-delete", **two)
    assert gone.returncode == 0, explain(gone)
    assert [fake_gcloud.node(cloud.state, f"ms-{i}", ZONE) for i in range(2)] == [None, None]
    assert fake_gcloud.queued(cloud.state, "ms", ZONE) is None
