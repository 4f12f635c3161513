"""Every gcloud command line the TPU launcher runs, as argv lists (never shell strings).

The forms are those of the Google Cloud CLI (gcloud 528):

    gcloud compute tpus tpu-vm create NAME --zone=Z --accelerator-type=T --version=RUNTIME [--spot]
    gcloud compute tpus queued-resources create NAME --zone=Z --node-id=NAME --accelerator-type=T
        --runtime-version=RUNTIME [--spot]
    gcloud compute tpus tpu-vm describe NAME --zone=Z --format=value(state,acceleratorType)
    gcloud compute tpus tpu-vm scp SRC NAME:DST --zone=Z --worker=all
    gcloud compute tpus tpu-vm ssh NAME --zone=Z --worker=all --command=SCRIPT
    gcloud compute tpus tpu-vm delete NAME --zone=Z --quiet

`--project=P` comes last when a project is given. A remote script travels as
ONE argv element (`--command=...`), so no local shell ever reads it.
"""

from __future__ import annotations

from deploy.tpu_config import TpuConfig

GCLOUD = "gcloud"
TPU_VM = (GCLOUD, "compute", "tpus", "tpu-vm")
QUEUED = (GCLOUD, "compute", "tpus", "queued-resources")
INSTALL_HINT = (
    "install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install, e.g. "
    "`curl https://sdk.cloud.google.com | bash`), then run `gcloud auth login` and "
    "`gcloud config set project PROJECT`, and make sure `gcloud` is on PATH"
)


def _tail(cfg: TpuConfig, *flags: str) -> list[str]:
    return [f"--zone={cfg.zone}", *flags, *([f"--project={cfg.project}"] if cfg.project else [])]


def create_node(cfg: TpuConfig) -> list[str]:
    capacity = ["--spot"] if cfg.spot else []
    return [*TPU_VM, "create", cfg.name, *_tail(
        cfg, f"--accelerator-type={cfg.accelerator}", f"--version={cfg.runtime_version}", *capacity)]


def create_queued(cfg: TpuConfig) -> list[str]:
    capacity = ["--spot"] if cfg.spot else []
    return [*QUEUED, "create", cfg.name, *_tail(
        cfg, f"--node-id={cfg.name}", f"--accelerator-type={cfg.accelerator}",
        f"--runtime-version={cfg.runtime_version}", *capacity)]


def describe_node(cfg: TpuConfig) -> list[str]:
    return [*TPU_VM, "describe", cfg.name, *_tail(cfg, "--format=value(state,acceleratorType)")]


def describe_queued(cfg: TpuConfig) -> list[str]:
    return [*QUEUED, "describe", cfg.name, *_tail(cfg, "--format=value(state.state)")]


def delete_node(cfg: TpuConfig) -> list[str]:
    return [*TPU_VM, "delete", cfg.name, *_tail(cfg, "--quiet")]


def delete_queued(cfg: TpuConfig) -> list[str]:
    """Deletes the queued resource and the slice it holds (`--force`)."""
    return [*QUEUED, "delete", cfg.name, *_tail(cfg, "--force", "--quiet")]


def upload(cfg: TpuConfig, local: str, remote: str) -> list[str]:
    return [*TPU_VM, "scp", local, f"{cfg.name}:{remote}", *_tail(cfg, "--worker=all")]


def download(cfg: TpuConfig, worker: int, remote: str, local: str) -> list[str]:
    return [*TPU_VM, "scp", f"{cfg.name}:{remote}", local, *_tail(cfg, f"--worker={worker}")]


def ssh_all(cfg: TpuConfig, script: str) -> list[str]:
    return [*TPU_VM, "ssh", cfg.name, *_tail(cfg, "--worker=all", f"--command={script}")]
