# shellcheck shell=bash
# What a Slurm job does around its srun: sourced by both batch scripts that start the job
# (slurm/train.sbatch, and the one submitit writes for make submit-slurm). It makes the script's
# `srun ...` line run through the job's supervisor (deploy/slurm/supervise.py), which runs the step,
# and after every attempt applies the one attempt policy (deploy/policy.py): a failure restarts in
# the same allocation on a spare node (SPARES), or is requeued away from the failed node, within the
# retry budget (JOB_RETRIES); a preemption (75) is requeued without spending it; a configuration
# error (2) is never retried. Every attempt is recorded in JOB_LOG_DIR/JOBID-attempts.jsonl and the
# run dir's attempts.jsonl. Bash keeps only this: a function that hands srun's words over.
#
# Variables: JOB_SUPERVISOR_PYTHON (the supervisor's interpreter: the one make submit-slurm ran in;
# python3 where that is not on the node: it needs only the standard library and this checkout),
# JOB_NODES, JOB_RETRIES, JOB_LOG_DIR (read by the supervisor).

JOB_CHECKOUT=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)

# the checkout first on the supervisor's path only: the step's tasks get the job's environment as it is
srun() {
    local python=${JOB_SUPERVISOR_PYTHON:-python3}
    command -v "$python" >/dev/null || python=python3  # the submitting interpreter may not be on this node
    "$python" -c 'import sys; sys.path.insert(0, sys.argv.pop(1)); from deploy.slurm.supervise import main; sys.exit(main())' \
        "$JOB_CHECKOUT" -- "$@"
}

# Kept for batch scripts written against the earlier interface: the supervisor has already acted.
watch_srun() { :; }
after_srun() { return "$1"; }
requeue_if_preempted() { return "$1"; }
