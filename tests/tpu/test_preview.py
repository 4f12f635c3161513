"""`make tpu-pod DRY_RUN=1` before gcloud is set up (deploy/tpu/preview.py), against the gcloud simulator: no
account, no project, no gcloud at all. Every command is printed, each read-only question as a `# not asked:` line,
the values gcloud would supply as placeholders; exit 0, and nothing asked of gcloud beyond what showed it cannot
answer."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from tests.launching import explain
from tests.tpu import fake_gcloud
from tests.tpu.harness import ZONE, Cloud

POD = {"TPU_NAME": "pod-p", "ZONE": ZONE, "ACCELERATOR": "v4-16", "DRY_RUN": "1",
       "ARGS": "train --run-dir /mnt/bucket/run"}


def preview(proc: subprocess.CompletedProcess[str]) -> str:
    """What the command printed, without make's echo of its recipe (the first line)."""
    return proc.stdout.partition("\n")[2]


def commands(stdout: str) -> list[list[str]]:
    """The gcloud commands printed, each as its argv (a remote script spans several lines)."""
    return [shlex.split(text) for text in re.findall(r"^gcloud .*?(?=^gcloud |^# |\Z)", stdout, re.M | re.S)]


def test_without_an_account_every_command_is_printed_and_only_the_account_was_asked(cloud: Cloud) -> None:
    fake_gcloud.set_login(cloud.state, [])
    proc = cloud.make("tpu-pod", **POD, QUEUED="1", SLICES="2")
    assert proc.returncode == 0, explain(proc)
    out = preview(proc)
    assert out.startswith("# dry run without gcloud's answers (gcloud account: none: gcloud is not logged in; fix: "
                          "gcloud auth login"), out
    assert (f"# read-only checks skipped: gcloud's account and project, whether {ZONE} offers v4-16 and runtime "
            "version tpu-ubuntu2204-base, the state of slice pod-p (taken as not existing)") in out
    assert ("# values gcloud would supply: the account <ACCOUNT>, the project <PROJECT> (commands without --project "
            "use gcloud's configured project)") in out
    not_asked = re.findall(r"^# not asked: gcloud compute tpus (\S+ \S+ \S+)", out, re.M)
    assert not_asked == ["queued-resources describe pod-p", "tpu-vm describe pod-p-0", "tpu-vm describe pod-p-1",
                         "tpu-vm describe pod-p-0"], out  # the slices' state, then worker 0's address
    printed = [" ".join(c[3:5]) for c in commands(out)]
    assert printed == ["queued-resources create", *["tpu-vm scp"] * 2, *["tpu-vm ssh"] * 2,  # create, ship, set up
                       *["tpu-vm ssh"] * 2, "tpu-vm ssh", *["tpu-vm scp"] * 4], printed  # start, follow, the logs
    assert "MEGASCALE_COORDINATOR_ADDRESS=" in out and "<address of worker 0 of pod-p-0>:8080" in out
    assert cloud.calls() == [["auth", "list", "--filter=status:ACTIVE", "--format=value(account)"]]
    assert "dry run: gcloud cannot be asked" in proc.stderr


def test_without_a_project_the_account_is_shown_and_the_project_is_a_placeholder(cloud: Cloud) -> None:
    fake_gcloud.set_property(cloud.state, "core/project", None)
    proc = cloud.make("tpu-pod", **POD)
    assert proc.returncode == 0, explain(proc)
    assert preview(proc).startswith("# dry run without gcloud's answers (PROJECT (--project): PROJECT empty and no "
                                    "project configured"), proc.stdout
    assert [" ".join(c[3:5]) for c in commands(proc.stdout)][0] == "tpu-vm create"
    assert [c[:2] for c in cloud.calls()] == [["auth", "list"], ["config", "get-value"]]


@pytest.mark.parametrize("target", ["tpu-pod", "tpu-run", "tpu-stop", "tpu-logs"])
def test_without_gcloud_on_path_the_preview_still_prints_and_exits_0(cloud: Cloud, target: str) -> None:
    proc = cloud.make(target, **POD, env=cloud.env(with_gcloud=False))
    assert proc.returncode == 0, explain(proc)
    assert preview(proc).startswith("# dry run without gcloud's answers (gcloud: no `gcloud` on PATH; fix: install "
                                    "the Google Cloud CLI"), proc.stdout
    assert commands(proc.stdout) and cloud.calls() == []


def test_with_credentials_a_dry_run_asks_what_it_did_before_and_prints_no_placeholder(cloud: Cloud) -> None:
    proc = cloud.make("tpu-pod", **POD)
    assert proc.returncode == 0, explain(proc)
    assert "\n# " not in proc.stdout and "<PROJECT>" not in proc.stdout
    assert [" ".join(c[:2]) if c[0] != "compute" else " ".join(c[2:4]) for c in cloud.calls()] == [
        "auth list", "config get-value", "tpu-vm accelerator-types", "tpu-vm versions", "tpu-vm describe"]
