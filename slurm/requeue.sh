# shellcheck shell=bash
# What a Slurm job does once its srun has ended: the one place that says it. Sourced by both batch
# scripts that start the job: slurm/train.sbatch (make submit-slurm VIA=sbatch, or sbatch by hand) and
# the one submitit writes (make submit-slurm), which each call
#
#   watch_srun                       # before srun: keep srun's own messages (which task failed where)
#   after_srun CODE                  # right after srun, CODE its exit status; returns it
#
# after_srun records the attempt, then by its exit code:
#   0   the run completed: nothing more;
#   75  every process saved after a preemption signal (REQUEUE_EXIT_CODE): the job is requeued. It keeps
#       its id and its log, and the requeued run (SLURM_RESTART_COUNT one higher) resumes from that
#       checkpoint. Preemptions never spend the retry budget;
#   2   a configuration error: the same flags would fail again, so it is never retried;
#   else a failure (an exception, a crash, a hang the watchdog ended with 86, a node gone): while the
#       job's retry budget (JOB_RETRIES, RETRIES on make submit-slurm, default 3; 0 turns retries off)
#       lasts, the job is requeued with the node of the task that failed first added to its
#       ExcNodeList, so the next attempt resumes from the newest checkpoint on other nodes. Once spent,
#       the job ends with the failure's code and a line saying so.
#
# The job can change its own ExcNodeList only once it is pending again, which `scontrol requeue`
# makes it at once (state PENDING while it completes): so requeue, then update, with SIGTERM held off
# between them (requeueing signals this script). Each attempt's record is one JSON line in
# JOB_LOG_DIR/JOBID-attempts.jsonl (JOB_ATTEMPTS; process 0 of the run adds its run dir there at its
# start), copied to RUN_DIR/attempts.jsonl where the run dir is a local folder.
# The job needs --requeue (both scripts ask for it) where the cluster's JobRequeue is 0.

REQUEUE_EXIT_CODE=75
BAD_INPUT_EXIT_CODE=2

# before srun: JOB_ATTEMPTS for the tasks, the attempt's start, and srun's stderr kept in a file too
watch_srun() {
    JOB_ATTEMPTS=$(realpath -m -- "${JOB_LOG_DIR:-.}")/${SLURM_JOB_ID}-attempts.jsonl
    export JOB_ATTEMPTS
    mkdir -p -- "${JOB_ATTEMPTS%/*}"
    attempt_began=$(date +%s)
    srun_errors=$(mktemp "${TMPDIR:-/tmp}/srun-$SLURM_JOB_ID.XXXXXX")
    exec 3>&2 2> >(tee -a "$srun_errors" >&3)
}

# a JSON string of $1: backslashes and quotes escaped, control characters dropped
json_string() {
    local text=${1//\\/\\\\}
    text=${text//\"/\\\"}
    printf '"%s"' "${text//[$'\001'-$'\037']/}"
}

# the task that ended first with an error, from srun's own messages: "NODE TASK CAUSE" (empty when none says)
first_failure() {
    local line pattern='^srun: error: ([^: ]+): tasks? ([0-9,-]+): (.*)$'
    [[ -f ${srun_errors:-} ]] || return 0
    while IFS= read -r line; do
        if [[ $line =~ $pattern ]]; then
            echo "${BASH_REMATCH[1]} ${BASH_REMATCH[2]%%[,-]*} ${BASH_REMATCH[3]}"
            return 0
        fi
        if [[ $line =~ ^srun:\ error:\ Node\ failure\ on\ ([^ ]+) ]]; then
            echo "${BASH_REMATCH[1]} - node failure"
            return 0
        fi
    done <"$srun_errors"
}

# the failed attempts on record for this job (its retries spent so far)
failures_so_far() {
    [[ -f $JOB_ATTEMPTS ]] || { echo 0; return 0; }
    grep -c '"outcome": "failed"' "$JOB_ATTEMPTS" || true
}

# the run dir process 0 wrote at its start, where it is a local folder
recorded_run_dir() {
    [[ -f $JOB_ATTEMPTS ]] || return 0
    sed -n 's/^{"event": "started".*"run_dir": "\([^"\\]*\)".*$/\1/p' "$JOB_ATTEMPTS" | tail -n 1
}

record_attempt() {
    local record=$1 run_dir
    echo "$record" >>"$JOB_ATTEMPTS"
    run_dir=$(recorded_run_dir)
    if [[ -n $run_dir && $run_dir != *://* && -d $run_dir ]]; then
        echo "$record" >>"$run_dir/attempts.jsonl" ||
            echo "attempts: expected to append to $run_dir/attempts.jsonl, found it refused; the record stays in $JOB_ATTEMPTS" >&2
    fi
}

# the job's ExcNodeList with node $1 added; empty (and why, on stderr) when too few nodes of its partition
# would be left for it: it would wait in the queue for ever
excluded_with() {
    local node=$1 now excluded usable
    now=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.*ExcNodeList=\([^ ]*\).*/\1/p' | head -n 1)
    [[ -z $now || $now == "(null)" ]] && excluded=$node || excluded="$now,$node"
    usable=$(sinfo -h -p "${SLURM_JOB_PARTITION:-}" -N -o %N 2>/dev/null | sort -u |
        grep -cvxF -f <(scontrol show hostnames "$excluded") || true)
    if ((usable < ${SLURM_JOB_NUM_NODES:-1})); then
        echo "requeue: excluding $excluded would leave $usable node(s) of partition ${SLURM_JOB_PARTITION:-?} for $SLURM_JOB_NUM_NODES: requeued without excluding $node" >&2
        return 0
    fi
    echo "$excluded"
}

after_srun() {
    local code=$1 budget=${JOB_RETRIES:-3} outcome action node=- task=- cause="" failure spent attempt excluded=""
    if [[ -z ${JOB_ATTEMPTS:-} ]]; then  # no watch_srun before srun: the record still goes to the log folder
        JOB_ATTEMPTS=$(realpath -m -- "${JOB_LOG_DIR:-.}")/${SLURM_JOB_ID}-attempts.jsonl
        mkdir -p -- "${JOB_ATTEMPTS%/*}"
    fi
    [[ $budget =~ ^[0-9]+$ ]] || budget=3
    attempt=$((${SLURM_RESTART_COUNT:-0} + 1))
    if ((code != 0)); then
        sleep 0.5  # tee's last lines
        failure=$(first_failure)
        if [[ -n $failure ]]; then
            node=${failure%% *}
            failure=${failure#* }
            task=${failure%% *}
            cause=${failure#* }
        fi
        # srun's own status is the last task's (143 once it stopped the others): the first's is the job's
        [[ ! $cause =~ ^Exited\ with\ exit\ code\ ([0-9]+)$ ]] || code=${BASH_REMATCH[1]}
    fi
    case $code in
        0) outcome=completed action="none" ;;
        "$REQUEUE_EXIT_CODE") outcome=preempted action="requeued (a preemption spends no retry)" ;;
        "$BAD_INPUT_EXIT_CODE") outcome="configuration error" action="not retried: the same flags would fail again" ;;
        *)
            outcome=failed
            spent=$(failures_so_far)
            if ((spent < budget)); then
                action="retry $((spent + 1)) of $budget"
                [[ $node == - ]] || excluded=$(excluded_with "$node")
                [[ -z $excluded ]] || action+=", excluding $node"
            else
                action="not retried: the retry budget is spent ($budget of $budget)"
            fi
            ;;
    esac
    record_attempt "{\"event\": \"ended\", \"job\": $(json_string "$SLURM_JOB_ID"), \"attempt\": $attempt, \"began\": ${attempt_began:-0}, \"ended\": $(date +%s), \"code\": $code, \"outcome\": $(json_string "$outcome"), \"node\": $(json_string "$node"), \"process\": $(json_string "$task"), \"cause\": $(json_string "$cause"), \"action\": $(json_string "$action")}"
    [[ -z ${srun_errors:-} ]] || rm -f -- "$srun_errors"
    case $outcome in
        preempted)
            echo "job $SLURM_JOB_ID saved its state after a preemption signal: requeueing (restart $attempt)"
            requeue_job
            ;;
        failed)
            echo "job $SLURM_JOB_ID attempt $attempt failed with exit code $code${cause:+ (process $task on $node: $cause)}: $action"
            if [[ $action == retry* ]]; then
                requeue_job "$excluded"
            else
                echo "job $SLURM_JOB_ID ends with exit code $code: $action. Fix: read the log above; submit the same command again to resume from the newest checkpoint" >&2
            fi
            ;;
        "configuration error")
            echo "job $SLURM_JOB_ID attempt $attempt ended with exit code $code (a configuration error${cause:+, process $task on $node}): $action" >&2
            ;;
    esac
    return "$code"
}

# requeue this job; with an ExcNodeList, set it once the job is pending again
requeue_job() {
    local excluded=${1:-}
    trap '' TERM  # requeueing signals this script; the update must still run
    if ! scontrol requeue "$SLURM_JOB_ID"; then
        echo "requeue: expected scontrol requeue $SLURM_JOB_ID to requeue the job, found it refused (above); its checkpoint is kept. Fix: submit the same command again to resume from it (and ask for --requeue where JobRequeue=0)" >&2
        return 0
    fi
    if [[ -n $excluded ]] && ! scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$excluded"; then
        echo "requeue: expected to keep $excluded out of the next attempt, found scontrol update refused (above); it may run there again" >&2
    fi
}

# The name this step had before retries (it requeued a preempted job only): a fork's own batch script
# that calls it gets the whole step, retries included.
requeue_if_preempted() {
    after_srun "$@"
}
