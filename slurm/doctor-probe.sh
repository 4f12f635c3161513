#!/usr/bin/env bash
# `make doctor`'s probe: one task on a compute node, started by deploy/slurm/doctor.py through srun
# with this file's text as `bash -c`'s script, so it needs nothing of the checkout on the node. It
# reports one `doctor:KEY=VALUE` line per finding; the login node decides what is wrong.
#
#   srun --nodes=1 --ntasks=1 ... bash -c "$(cat slurm/doctor-probe.sh)" doctor-probe RUN_DIR TOKEN PYTHON IMAGE RUNTIME
#
#   RUN_DIR  the job's run dir (absolute; the login node made it): TOKEN goes to RUN_DIR/.doctor-TOKEN
#            ('' for a gs:// run dir: nothing to check here)
#   PYTHON   the tasks' interpreter, run with `import job, jax` ('' with IMAGE)
#   IMAGE    the job's image ('' without)
#   RUNTIME  with IMAGE: apptainer or podman, the program slurm/train.sbatch would run on the node
#            ('' for pyxis, which the login node finds in `srun --help`)
set -u

run_dir=$1 token=$2 python=$3 image=$4 runtime=$5
# What the interpreter prints: its version, jax's, whether jax's CUDA plugin is there (1/0), where job is.
IMPORT='import importlib.util, sys, job, jax
print(sys.version.split()[0], jax.__version__, int(importlib.util.find_spec("jax_cuda12_plugin") is not None), job.__file__)'

say() { printf 'doctor:%s=%s\n' "$1" "$2"; }
last_line() { local text=$1; text=${text%$'\n'}; printf '%s' "${text##*$'\n'}"; }

say node "${SLURMD_NODENAME:-$(hostname -s)}"
say cwd "$(pwd -P)"

if [[ -z $run_dir ]]; then
    :
elif [[ ! -d $run_dir ]]; then
    say run_dir missing
elif ! printf '%s\n' "$token" 2>/dev/null >"$run_dir/.doctor-$token"; then
    say run_dir unwritable
else
    say run_dir written
fi

if [[ -n $python ]]; then
    if ! command -v -- "$python" >/dev/null 2>&1; then
        say python missing
    elif out=$("$python" -c "$IMPORT" 2>&1); then
        say python "ok $(last_line "$out")"
    else
        say python "failed $? $(last_line "$out")"
    fi
fi

if [[ -n $image && -n $runtime ]]; then
    if ! where=$(command -v -- "$runtime" 2>/dev/null); then
        say runtime missing
    else
        say runtime "ok $where"
        if [[ $runtime == podman ]]; then
            if podman image exists "$image" 2>/dev/null; then say image present; else say image absent; fi
        elif [[ $image == *://* ]]; then
            say image remote  # apptainer pulls docker://, oras://, library:// images itself
        elif [[ -r $image ]]; then
            say image present
        else
            say image missing
        fi
    fi
fi
