"""Every gcloud command line the TPU launcher runs, as argv lists (never shell strings).

The forms are those of the Google Cloud CLI (gcloud 528):

    gcloud compute tpus tpu-vm create NAME --zone=Z --accelerator-type=T --version=RUNTIME
        [--spot|--reserved] [--internal-ips] [--network=N] [--subnetwork=S] [--service-account=E] [--tags=A,B]
    gcloud compute tpus queued-resources create NAME --zone=Z (--node-id=NAME | --node-count=N --node-prefix=NAME)
        --accelerator-type=T --runtime-version=RUNTIME [--spot|--reserved] [the same network flags]
    gcloud compute tpus queued-resources describe NAME --zone=Z
        --format=value(state.state,state.failedData.error.message)
    gcloud compute tpus tpu-vm describe NODE --zone=Z --format=value(state,acceleratorType)
    gcloud compute tpus tpu-vm scp SRC NODE:DST --zone=Z --worker=all [--internal-ip]
    gcloud compute tpus tpu-vm ssh NODE --zone=Z --worker=all --command=SCRIPT [--internal-ip]
    gcloud compute tpus tpu-vm delete NODE --zone=Z --quiet

and the read-only questions of `doctor` (deploy/tpu/doctor.py), asked before anything is created:

    gcloud auth list --filter=status:ACTIVE --format=value(account)     the active account, or nothing
    gcloud config get-value project                                       the configured project ("(unset)" on stderr)
    gcloud compute tpus tpu-vm accelerator-types list --zone=Z --format=value(type)
    gcloud compute tpus tpu-vm versions list --zone=Z --format=value(version)

NODE is NAME, or one of NAME-0 .. NAME-(N-1) with SLICES=N (`cfg.slice_names`).
Create commands take `--internal-ips` (plural), ssh and scp `--internal-ip`.
`--project=P` comes last when a project is given. A remote script travels as
ONE argv element (`--command=...`), so no local shell ever reads it.
"""

from __future__ import annotations

from deploy.tpu.config import TpuConfig

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


def _options(cfg: TpuConfig) -> list[str]:
    """Capacity and network flags, the same on both create commands."""
    return [
        *(["--spot"] if cfg.spot else []), *(["--reserved"] if cfg.reserved else []),
        *(["--internal-ips"] if cfg.internal_ip else []),
        *([f"--network={cfg.network}"] if cfg.network else []),
        *([f"--subnetwork={cfg.subnetwork}"] if cfg.subnetwork else []),
        *([f"--service-account={cfg.service_account}"] if cfg.service_account else []),
        *([f"--tags={','.join(cfg.tags)}"] if cfg.tags else []),
    ]


def _connect(cfg: TpuConfig) -> list[str]:
    """ssh and scp: reach the workers through their internal addresses with INTERNAL_IP=1."""
    return ["--internal-ip"] if cfg.internal_ip else []


def active_account() -> list[str]:
    return [GCLOUD, "auth", "list", "--filter=status:ACTIVE", "--format=value(account)"]


def configured_project() -> list[str]:
    return [GCLOUD, "config", "get-value", "project"]


def accelerator_types(cfg: TpuConfig) -> list[str]:
    """One accelerator type the zone offers a line (v4-8, v4-16, ...)."""
    return [*TPU_VM, "accelerator-types", "list", *_tail(cfg, "--format=value(type)")]


def runtime_versions(cfg: TpuConfig) -> list[str]:
    """One TPU software version the zone offers a line (tpu-ubuntu2204-base, ...)."""
    return [*TPU_VM, "versions", "list", *_tail(cfg, "--format=value(version)")]


def create_node(cfg: TpuConfig) -> list[str]:
    return [*TPU_VM, "create", cfg.name, *_tail(
        cfg, f"--accelerator-type={cfg.accelerator}", f"--version={cfg.runtime_version}", *_options(cfg))]


def create_queued(cfg: TpuConfig) -> list[str]:
    nodes = ([f"--node-id={cfg.name}"] if cfg.slices == 1
             else [f"--node-count={cfg.slices}", f"--node-prefix={cfg.name}"])
    return [*QUEUED, "create", cfg.name, *_tail(
        cfg, *nodes, f"--accelerator-type={cfg.accelerator}", f"--runtime-version={cfg.runtime_version}",
        *_options(cfg))]


def describe_node(cfg: TpuConfig, node: str | None = None) -> list[str]:
    return [*TPU_VM, "describe", node or cfg.name, *_tail(cfg, "--format=value(state,acceleratorType)")]


def describe_queued(cfg: TpuConfig) -> list[str]:
    """State, then (when FAILED) the reason, tab-separated."""
    return [*QUEUED, "describe", cfg.name, *_tail(cfg, "--format=value(state.state,state.failedData.error.message)")]


def delete_node(cfg: TpuConfig, node: str | None = None) -> list[str]:
    return [*TPU_VM, "delete", node or cfg.name, *_tail(cfg, "--quiet")]


def delete_queued(cfg: TpuConfig) -> list[str]:
    """Deletes the queued resource and every slice it holds (`--force`)."""
    return [*QUEUED, "delete", cfg.name, *_tail(cfg, "--force", "--quiet")]


def upload(cfg: TpuConfig, local: str, remote: str, node: str | None = None) -> list[str]:
    return [*TPU_VM, "scp", local, f"{node or cfg.name}:{remote}", *_tail(cfg, "--worker=all", *_connect(cfg))]


def download(cfg: TpuConfig, worker: int, remote: str, local: str, node: str | None = None) -> list[str]:
    return [*TPU_VM, "scp", f"{node or cfg.name}:{remote}", local, *_tail(cfg, f"--worker={worker}", *_connect(cfg))]


def ssh_all(cfg: TpuConfig, script: str, node: str | None = None) -> list[str]:
    return [*TPU_VM, "ssh", node or cfg.name, *_tail(cfg, "--worker=all", *_connect(cfg), f"--command={script}")]
