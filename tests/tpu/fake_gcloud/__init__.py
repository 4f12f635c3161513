"""A strict gcloud simulator for the Cloud TPU tests: put `tests/tpu/fake_gcloud` first on PATH.

    PATH=tests/tpu/fake_gcloud:$PATH FAKE_GCLOUD_STATE=/tmp/cloud gcloud compute tpus tpu-vm create ...

It accepts only the command forms and flags in `grammar.py` (those of the
real CLI) and refuses anything else with exit code 2; keeps TPU nodes and
queued resources in the state folder (CREATING, READY, PREEMPTED, deleted);
keeps gcloud's own login and configured project (`auth list`, `config
get-value`; a command that calls the API fails without them, as the real one
does) and what each zone offers (catalog.py: a creation of anything else fails);
and runs `tpu-vm ssh --worker=all --command=...` as one local process per
worker that `job.initialize` sees as a TPU pod's worker (see `ssh.py`).
Variables: FAKE_GCLOUD_STATE (required), FAKE_GCLOUD_PYTHON (the interpreter
that runs it and the workers' python3), FAKE_GCLOUD_CREATE_SECONDS,
FAKE_GCLOUD_QUEUE_SECONDS, FAKE_GCLOUD_PREEMPT_GRACE_SECONDS,
FAKE_GCLOUD_DEVICES_PER_WORKER; and gcloud's own
CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU: a command that calls the API connects
there first and, when it cannot, retries and crashes as the real CLI does.
"""

from pathlib import Path

from tests.tpu.fake_gcloud.state import (
    STOCKOUT_MESSAGE, calls, kill_leftovers, node, preempt, queued, schedule_capacity_failures, schedule_preemption,
    set_login, set_offer, set_property,
)

BIN_DIR = Path(__file__).resolve().parent  # holds the `gcloud` executable

__all__ = ["BIN_DIR", "STOCKOUT_MESSAGE", "calls", "kill_leftovers", "node", "preempt", "queued",
           "schedule_capacity_failures", "schedule_preemption", "set_login", "set_offer", "set_property"]
