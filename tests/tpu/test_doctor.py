"""`python -m deploy.tpu doctor` and the quick part `tpu-pod` runs first, against the gcloud simulator: each
broken case made real (no account, no project, a type or version the zone does not offer, a bucket that
cannot be written: a Cloud Storage emulator), one line naming it and the fix; nothing created. The run's
check: ARGS' task, config and global batch on the slice's devices."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from deploy.tpu import doctor
from deploy.tpu.config import TpuConfig
from tests.gcs_emulator import Emulator, client_env
from tests.launching import explain
from tests.records import check_lines
from tests.tpu import fake_gcloud
from tests.tpu.harness import ROOT, ZONE, Cloud

RUN_DIR = "train --run-dir /mnt/bucket/run1"
SLICE = ("--name=pod-x", f"--zone={ZONE}", "--accelerator=v4-16", f"--args={RUN_DIR}")
CHECKS = ("request", "run", "code", "gcloud", "account", "project", "accelerator type", "runtime version", "slice",
          "fit")


def changes(cloud: Cloud) -> list[list[str]]:
    """gcloud calls that would change something or reach a VM."""
    return [c for c in cloud.calls() if any(verb in c for verb in ("create", "delete", "ssh", "scp"))]


def test_all_checks_pass_for_a_request_the_zone_can_serve(cloud: Cloud) -> None:
    proc = cloud.make("tpu-doctor", TPU_NAME="pod-x", ZONE=ZONE, ACCELERATOR="v4-16", ARGS=RUN_DIR)
    assert proc.returncode == 0, explain(proc)
    found = check_lines(proc.stdout)
    assert list(found) == list(CHECKS), proc.stdout
    assert all(line.startswith("ok    ") for name, line in found.items() if name != "fit"), proc.stdout  # fit: below
    assert found["run"] == "ok    run: task lm: global batch 32 splits over 8 devices (v4-16: 8 chips)"
    assert found["account"] == "ok    account: tester@example.com"
    assert found["project"].startswith("ok    project: fake-project (gcloud's configured project")
    assert found["accelerator type"] == f"ok    accelerator type: v4-16 is offered in {ZONE}"
    assert found["runtime version"] == ("ok    runtime version: tpu-ubuntu2204-base (the v4 default) is offered in "
                                        f"{ZONE}")
    assert "pod-x does not exist yet" in found["slice"]
    assert found["fit"].startswith(("ok    fit: the train step needs ", "skip  fit: libtpu is not installed"))
    assert changes(cloud) == []


@pytest.mark.gcs
def test_a_bucket_run_dir_this_machine_can_write_passes(cloud: Cloud, gcs: Emulator) -> None:
    proc = cloud.cli("doctor", *SLICE[:3], "--args=train", f"--bucket=gs://{gcs.bucket}/run1",
                     env={**cloud.env(), **gcs.env})
    assert proc.returncode == 0, explain(proc)
    line = check_lines(proc.stdout)["run dir"]
    assert line.startswith(f"ok    run dir: this machine can write gs://{gcs.bucket}/run1")
    assert gcs.objects("run1/") == []  # the probe object is gone again


@pytest.mark.gcs
def test_a_bucket_that_cannot_be_written_is_one_line_with_the_fix(cloud: Cloud, gcs: Emulator) -> None:
    proc = cloud.cli("doctor", *SLICE[:3], "--args=train", "--bucket=gs://no-such-bucket/run1",
                     env={**cloud.env(), **gcs.env})
    assert proc.returncode == 1, explain(proc)
    line = check_lines(proc.stdout)["run dir"]
    assert line.startswith("FAIL  run dir: run dir (BUCKET or ARGS --run-dir): expected a bucket folder this "
                           "machine's credentials"), line
    assert "found 'gs://no-such-bucket/run1: bucket does not exist (404)'" in line
    assert "Fix: create it (gcloud storage buckets create gs://no-such-bucket)" in line
    assert all(check_lines(proc.stdout)[name].startswith("ok ") for name in CHECKS)  # the rest is fine
    assert proc.stdout.rstrip().endswith("1 check(s) failed: fix them before submitting")


CLOSED = "http://127.0.0.1:9"  # nothing listens: a connection is refused at once, as with no network


def test_make_tpu_doctor_without_network_is_one_fail_line_per_service_in_seconds_and_no_traceback(
        cloud: Cloud) -> None:
    """The Cloud TPU API (gcloud's endpoint override) and Cloud Storage both a closed port: gcloud retries for about
    30 s and the storage client for about a minute, printing a traceback each time. Each is one FAIL line naming the
    service, where it was looked for and the fix; the zone's other questions are not asked; the rest is checked."""
    offline = {"CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU": f"{CLOSED}/", **client_env(CLOSED)}
    argv = cloud.make_argv("tpu-doctor", TPU_NAME="pod-x", ZONE=ZONE, ACCELERATOR="v4-16", ARGS="train",
                           BUCKET="gs://my-bucket/run1")
    began, lines, came = time.monotonic(), [], {}  # came: each check's line, seconds after the start
    with subprocess.Popen(argv, cwd=ROOT, env=cloud.env(**offline), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as doctor:
        assert doctor.stdout is not None and doctor.stderr is not None
        for line in doctor.stdout:
            lines.append(line)
            came.update((name, round(time.monotonic() - began, 1)) for name in check_lines(line))
        proc = subprocess.CompletedProcess(argv, doctor.wait(timeout=120), "".join(lines), doctor.stderr.read())
    took = time.monotonic() - began
    assert proc.returncode != 0 and "tpu-doctor] Error 1" in proc.stderr, explain(proc)
    # the services' lines (the run dir's is the last) within 15 s; then only the fit's compile, which runs alongside
    # them (CPU work, the same with the network or without: several seconds more on a busy machine) and says how long
    assert came["run dir"] < 15, f"{came}\n{explain(proc)}"
    compiled = re.search(r"compiled ahead of time by libtpu \S+ in (\d+) s\)", proc.stdout)
    assert took < 15 + (int(compiled.group(1)) if compiled else 0), f"took {took:.1f} s, {came}\n{explain(proc)}"
    assert "Traceback" not in proc.stdout + proc.stderr, explain(proc)
    found = check_lines(proc.stdout)
    assert [name for name, line in found.items() if line.startswith("FAIL")] == ["accelerator type", "run dir"], \
        proc.stdout
    assert found["accelerator type"] == (
        "FAIL  accelerator type: gcloud (the Cloud TPU API): expected an answer within 4 s, found 'none: cannot reach "
        "127.0.0.1:9: Connection refused'; not asked: runtime version, slice. Fix: connect this machine to a network "
        "that reaches it (DNS, firewall; gcloud takes a proxy from HTTPS_PROXY or gcloud config set proxy/address), "
        "then run make tpu-doctor again")
    assert found["run dir"] == (
        "FAIL  run dir: Cloud Storage: expected an answer within 4 s, found 'none: cannot reach 127.0.0.1:9: "
        "Connection refused'. Fix: connect this machine to a network that reaches it (DNS, firewall: its client "
        "takes no proxy), then run make tpu-doctor again")
    assert list(found) == [name for name in CHECKS if name not in ("runtime version", "slice")][:-1] + \
        ["run dir", "fit"], proc.stdout
    assert [c[:4] for c in cloud.tpu_calls()] == [["compute", "tpus", "tpu-vm", "accelerator-types"]]  # asked once


def test_tpu_pod_without_network_stops_in_seconds_naming_the_api_and_creates_nothing(cloud: Cloud) -> None:
    began = time.monotonic()
    proc = cloud.cli("pod", *SLICE, env=cloud.env(CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU=f"{CLOSED}/"))
    assert proc.returncode == 2 and time.monotonic() - began < 15, explain(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: gcloud (the Cloud TPU API): expected an answer within 4 s, found 'none: cannot reach "
                      "127.0.0.1:9: Connection refused'. Fix: connect this machine to a network that reaches it (DNS, "
                      "firewall; gcloud takes a proxy from HTTPS_PROXY or gcloud config set proxy/address), then run "
                      "make tpu-doctor again"], proc.stderr
    assert changes(cloud) == []


def refuse_state(cloud: Cloud, case: str) -> tuple[str, ...]:
    """Make `case` real in the simulated cloud; the flags that go with it."""
    if case == "not logged in":
        fake_gcloud.set_login(cloud.state, [])
    elif case == "logged out of the active account":
        fake_gcloud.set_login(cloud.state, ["other@example.com"], active="me@example.com")
    elif case == "no project":
        fake_gcloud.set_property(cloud.state, "core/project", None)
    elif case == "accelerator type not in the zone":
        return ("--accelerator=v5p-8",)
    elif case == "unknown runtime version":
        return ("--runtime=tpu-ubuntu2404-nope",)
    elif case == "the zone withdrew the default runtime":
        fake_gcloud.set_offer(cloud.state, ZONE, runtime_versions=["tpu-vm-base", "tpu-vm-v4-base"])
    return ()


# case: (the failing check, what its line says)
BROKEN = {
    "not logged in": ("account", "gcloud account: expected an active account with credentials (`gcloud auth list` "
                      "marks it ACTIVE), found 'none: gcloud is not logged in'. Fix: gcloud auth login"),
    "logged out of the active account": ("account", "found 'none: gcloud is not logged in'"),
    "no project": ("project", "PROJECT (--project): expected a Google Cloud project: PROJECT, or gcloud's configured "
                   "project, found 'PROJECT empty and no project configured (`gcloud config get-value project`: "
                   "(unset))'. Fix: PROJECT=my-project, or once for every command: gcloud config set project"),
    "accelerator type not in the zone": (
        "accelerator type", f"ACCELERATOR (--accelerator): expected an accelerator type offered in {ZONE} "
        "(v4-8 .. v4-4096 (10 sizes)), found 'v5p-8'. Fix: a ZONE that offers v5p "
        "(https://cloud.google.com/tpu/docs/regions-zones)"),
    "unknown runtime version": (
        "runtime version", f"RUNTIME (--runtime): expected a TPU software version offered in {ZONE} "
        "(tpu-ubuntu2204-base, tpu-vm-base, "),
    "the zone withdrew the default runtime": (
        "runtime version", "found 'tpu-ubuntu2204-base (the v4 default)'. Fix: RUNTIME=one of those that suits v4"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_each_broken_case_is_one_failing_line_naming_the_value_and_the_fix(cloud: Cloud, case: str) -> None:
    flags = refuse_state(cloud, case)
    proc = cloud.cli("doctor", *SLICE, *flags)
    assert proc.returncode == 1, explain(proc)
    check, says = BROKEN[case]
    found = check_lines(proc.stdout)
    assert found[check].startswith(f"FAIL  {check}: ") and says in found[check], found[check]
    assert "Fix: " in found[check]
    assert [name for name, line in found.items() if line.startswith("FAIL")] == [check], proc.stdout
    if check in ("account", "project"):  # the zone is not asked without an account and a project
        assert "accelerator type" not in found and "slice" not in found
    assert changes(cloud) == []


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_tpu_pod_refuses_each_quick_check_failure_before_creating_anything(cloud: Cloud, case: str) -> None:
    flags = refuse_state(cloud, case)
    proc = cloud.cli("pod", *SLICE, *flags)
    assert proc.returncode == 2, explain(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].count("Fix: ") == 1, proc.stderr
    assert BROKEN[case][1].split(". Fix:")[0].split("found ")[-1] in errors[0], errors[0]
    assert changes(cloud) == [] and not any(c[2:4] == ["tpu-vm", "describe"] for c in cloud.calls())  # nor the slice


def test_make_tpu_pod_refuses_a_type_the_zone_does_not_offer(cloud: Cloud) -> None:
    proc = cloud.make("tpu-pod", TPU_NAME="pod-x", ZONE=ZONE, ACCELERATOR="v6e-8", ARGS=RUN_DIR)
    assert proc.returncode != 0 and "tpu-pod] Error 2" in proc.stderr, explain(proc)
    assert re.search(r"^error: ACCELERATOR \(--accelerator\): expected an accelerator type offered in us-central2-b "
                     r".*found 'v6e-8'\. Fix: a ZONE that offers v6e", proc.stderr, re.M), proc.stderr
    assert changes(cloud) == []


def test_an_existing_slice_of_another_type_fails_the_slice_check(cloud: Cloud) -> None:
    made = cloud.gcloud("compute", "tpus", "tpu-vm", "create", "pod-x", f"--zone={ZONE}", "--accelerator-type=v4-8",
                        "--version=tpu-ubuntu2204-base")
    assert made.returncode == 0, explain(made)
    proc = cloud.cli("doctor", *SLICE)
    assert proc.returncode == 1, explain(proc)
    line = check_lines(proc.stdout)["slice"]
    assert "ACCELERATOR (--accelerator): expected v4-8, the type of the existing slice pod-x" in line, line
    assert "Fix: use ACCELERATOR=v4-8, another TPU_NAME, or `make tpu-delete` first" in line
    same = cloud.cli("doctor", *SLICE[:2], "--accelerator=v4-8", f"--args={RUN_DIR}")
    assert check_lines(same.stdout)["slice"] == "ok    slice: pod-x is READY: make tpu-pod reuses it", same.stdout


def test_without_gcloud_only_the_request_is_checked(cloud: Cloud) -> None:
    proc = cloud.make("tpu-doctor", TPU_NAME="pod-x", ZONE=ZONE, ARGS=RUN_DIR, env=cloud.env(with_gcloud=False))
    assert proc.returncode != 0
    found = check_lines(proc.stdout)
    assert list(found) == ["request", "run", "code", "gcloud", "fit"] and found["request"].startswith("ok "), proc.stdout
    assert found["gcloud"].startswith("FAIL  gcloud: gcloud: expected the Google Cloud CLI on PATH")
    assert "https://cloud.google.com/sdk/docs/install" in found["gcloud"]


def test_a_bad_request_fails_its_line_and_the_rest_is_still_checked(cloud: Cloud) -> None:
    proc = cloud.cli("doctor", *SLICE[:3], "--args=train --run-dir runs/on-each-worker")
    assert proc.returncode == 1, explain(proc)
    found = check_lines(proc.stdout)
    assert found["request"].startswith("FAIL  request: ARGS --run-dir: expected a folder every one of the 2 workers")
    assert [name for name, line in found.items() if line.startswith("FAIL")] == ["request"]


# ---------------------------------------------------------------------------------------------------- the run
def test_make_doctor_says_it_chose_tpu_and_fails_a_batch_the_chips_do_not_split(cloud: Cloud) -> None:
    proc = cloud.make("doctor", TPU_NAME="pod-x", ZONE=ZONE, ACCELERATOR="v4-16",
                      ARGS=f"{RUN_DIR} --data.global-batch 30")
    assert proc.returncode != 0, explain(proc)
    first = proc.stdout.splitlines()[0]
    assert first == "make doctor: WHERE=tpu (TPU_NAME is set; WHERE=slurm or WHERE=local to choose)", proc.stdout
    found = check_lines(proc.stdout)
    assert found["run"] == ("FAIL  run: --data.global-batch: expected a multiple of the data-parallel size 8 = 8, "
                            "found 30 on 8 devices (v4-16: 8 chips). Fix: use --data.global-batch 32")
    assert [name for name, line in found.items() if line.startswith("FAIL")] == ["run"], proc.stdout
    assert changes(cloud) == []


def test_a_task_that_does_not_import_is_the_runs_fail_line_and_the_rest_is_still_checked(cloud: Cloud) -> None:
    proc = cloud.cli("doctor", *SLICE[:3], f"--args={RUN_DIR} --task nosuch.mod:TASK")
    assert proc.returncode == 1, explain(proc)
    found = check_lines(proc.stdout)
    assert found["run"] == ("FAIL  run: --task: expected an importable module nosuch.mod, found \"nosuch.mod:TASK (No "
                            "module named 'nosuch')\". Fix: pass --task PACKAGE.MODULE:ATTR with the module importable "
                            "(installed, or on PYTHONPATH)")
    # nor can what does not exist be shipped: the code line names the package the workers would miss
    assert found["code"].startswith("FAIL  code: ARGS --task nosuch.mod:TASK: expected its top-level package nosuch")
    assert found["fit"] == ("skip  fit: ARGS does not pass the run's check (its line says why). To run it: ARGS that "
                            "pass the run's check"), proc.stdout  # not compiled: never an ok
    assert all(found[name].startswith("ok ") for name in CHECKS if name not in ("run", "code", "fit")), proc.stdout


def test_make_doctor_without_args_says_the_run_was_not_checked(cloud: Cloud) -> None:
    proc = cloud.make("doctor", TPU_NAME="pod-x", ZONE=ZONE, ACCELERATOR="v5litepod-16")
    assert check_lines(proc.stdout)["run"] == (
        "skip  run: no ARGS given. To run it: ARGS='train ...' (its task, config and global batch on 16 devices "
        "(v5litepod-16: 16 chips) are checked)"), explain(proc)


@pytest.mark.parametrize(("accelerator", "slices", "devices"), [
    ("v3-32", 1, "32 devices (v3-32: 32 TensorCores)"), ("v4-32", 1, "16 devices (v4-32: 16 chips)"),
    ("v5p-16", 1, "8 devices (v5p-16: 8 chips)"), ("v6e-8", 1, "8 devices (v6e-8: 8 chips)"),
    ("v4-8", 2, "8 devices (v4-8: 4 chips x 2 slices)"),
])
def test_the_runs_devices_are_the_slices_jax_devices(accelerator: str, slices: int, devices: str) -> None:
    cfg = TpuConfig(name="pod-x", zone=ZONE, accelerator=accelerator, slices=slices, queued=slices > 1)
    assert str(doctor.devices(cfg)) == devices
