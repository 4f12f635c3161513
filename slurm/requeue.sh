# shellcheck shell=bash
# How a Slurm job that saved after a preemption signal is requeued: the one place that says it.
# Sourced by both batch scripts that start the job: slurm/train.sbatch (make submit-slurm VIA=sbatch,
# or sbatch by hand) and the one submitit writes (make submit-slurm), which each call
#
#   requeue_if_preempted CODE        # CODE: srun's exit status; returns it
#
# right after srun. Slurm sends USR2 to every task before the time limit (--signal=USR2@SECONDS, or
# `scancel --signal=USR2 JOBID`); every process saves the state and exits REQUEUE_EXIT_CODE (75,
# job.runtime.preemption.REQUEUE_EXIT_CODE), so srun ends with it, and this requeues the job: it keeps its
# id and its log, and the requeued run (SLURM_RESTART_COUNT one higher) resumes from that checkpoint.
# The job needs --requeue (both scripts ask for it) where the cluster's JobRequeue is 0.

REQUEUE_EXIT_CODE=75

requeue_if_preempted() {
    local code=$1
    if ((code == REQUEUE_EXIT_CODE)); then
        echo "job $SLURM_JOB_ID saved its state after a preemption signal: requeueing (restart $((${SLURM_RESTART_COUNT:-0} + 1)))"
        if ! scontrol requeue "$SLURM_JOB_ID"; then
            echo "requeue: expected scontrol requeue $SLURM_JOB_ID to requeue the job, found it refused (above); its checkpoint is kept. Fix: submit the same command again to resume from it (and ask for --requeue where JobRequeue=0)" >&2
        fi
    fi
    return "$code"
}
