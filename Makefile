# The front door. `make help` lists every target.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# FLAVOR: cpu (the default; .venv from requirements.lock) or cuda (.venv-cuda from docker/requirements-cuda.lock,
# the interpreter GPU jobs on Slurm run); also the image flavour of docker-build (cpu, cuda or tpu).
FLAVOR ?= cpu
CUDA_VENV := .venv-cuda
CUDA_LOCK := docker/requirements-cuda.lock
NPROC ?= 4
DEVICES ?= 2
ARGS ?= train --run-dir runs/local
PYTEST_ARGS ?=
# the test targets' pytest workers (pytest-xdist): two, each test file on one of them (its module fixtures made
# once); the Slurm and container tiers' tests one at a time (tests/conftest.py). TEST_WORKERS= runs in one process.
TEST_WORKERS ?= -n 2 --dist loadfile
BENCH_ARGS ?=

.DEFAULT_GOAL := help
# $(call quote,VAR): VAR's value as one shell word, exactly as given: $(value) skips make's own
# expansion and the single quotes (inner ones escaped) skip the shell's, so ARGS='--name "a b; $(id)"'
# or PARTITION="it's" reach the program verbatim.
quote = '$(subst ','\'',$(value $(1)))'
NODES ?= 4
SLURM_ENV := /var/tmp/jax-job-slurm/env.sh
# `=`, not `:=` (also DOCKER_ARGS): expanded only when a recipe runs, so `make -n` never expands ARGS.
# ARGS given on the command line reach the job as shell-style words (never run); otherwise deploy.slurm.submit's default
SLURM_ARGS = $(if $(filter command line,$(origin ARGS)),--args=$(call quote,ARGS))

.PHONY: help venv run-local test-local test-unit test-smoke coverage lint bench rerun plot runs lock clean slurm-up slurm-down submit-slurm doctor

help: ## list every target
	@awk 'BEGIN {FS = ":.*## "} /^[a-z][a-z0-9-]*:.*## / {printf "  make %-17s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# What a venv was made with ("3.12.1 /usr"): recorded in its stamp, compared by `make venv PYTHON=...`.
INTERPRETER := import sys; print(sys.version.split()[0], sys.base_prefix)
# $(call make_venv,DIR,LOCK): DIR from LOCK with $(PYTHON). The locks are universal (markers per Python):
# Python 3.11 gets JAX 0.10.2, Python 3.12 and newer JAX 0.12.
define make_venv
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 || { \
	    echo "make venv: expected PYTHON to be Python 3.11 or newer, found PYTHON="$(call quote,PYTHON)" ($$($(PYTHON) --version 2>/dev/null || echo not found)). Fix: make venv PYTHON=python3.12 (any interpreter path)" >&2; exit 2; }
	$(PYTHON) -m venv --clear $(1)
	$(1)/bin/pip install --quiet --disable-pip-version-check -r $(2)
	$(1)/bin/pip install --quiet --disable-pip-version-check --no-deps -e .
	@$(1)/bin/python -c '$(INTERPRETER)' > $(1)/bin/.installed
endef

# `make venv PYTHON=...`: a venv made with another interpreter (its stamp says which) is made again.
# Only for the venv goal: submit-slurm's PYTHON names the compute nodes' interpreter, not .venv's.
ifneq ($(and $(filter venv,$(MAKECMDGOALS)),$(filter command line environment,$(origin PYTHON))),)
WANT_INTERPRETER := $(shell $(PYTHON) -c '$(INTERPRETER)' 2>/dev/null)
stale = $(shell [ -f $(1) ] && [ "$$(cat $(1))" != "$(WANT_INTERPRETER)" ] && \
	echo "make venv: $(1:/bin/.installed=) was made with Python $$(cut -d' ' -f1 $(1)); making it again with $(PYTHON)" >&2 && echo FORCE)
endif

$(BIN)/.installed: requirements.lock pyproject.toml $(if $(filter cpu,$(FLAVOR)),$(call stale,$(BIN)/.installed))
	$(call make_venv,$(VENV),requirements.lock)

$(CUDA_VENV)/bin/.installed: $(CUDA_LOCK) pyproject.toml $(if $(filter cuda,$(FLAVOR)),$(call stale,$(CUDA_VENV)/bin/.installed))
	$(call make_venv,$(CUDA_VENV),$(CUDA_LOCK))

VENV_FOR_cpu := $(BIN)/.installed
VENV_FOR_cuda := $(CUDA_VENV)/bin/.installed

.PHONY: FORCE
FORCE:

venv: $(VENV_FOR_$(FLAVOR)) ## make .venv from the lock (targets do it); PYTHON=python3.12 remakes it; FLAVOR=cuda: .venv-cuda
	@[ -n "$(VENV_FOR_$(FLAVOR))" ] || { echo "make venv: expected FLAVOR=cpu or FLAVOR=cuda, found FLAVOR="$(call quote,FLAVOR)". Fix: make venv FLAVOR=cuda (or no FLAVOR)" >&2; exit 2; }

run-local: $(BIN)/.installed ## the example job on NPROC (4) local processes x DEVICES (2); ARGS=...; SWEEP=... runs in turn
	JAX_PLATFORMS=cpu $(if $(value SWEEP),$(BIN)/python -m deploy.local.sweep --sweep=$(call quote,SWEEP) -n $(NPROC) \
		--devices-per-process $(DEVICES) --dry-run=$(call quote,DRY_RUN) --,$(BIN)/python -m job.launch -n $(NPROC) \
		--devices-per-process $(DEVICES) -- $(BIN)/python -m job) $(ARGS)

test-local: $(BIN)/.installed ## the whole test suite: unit, multi-process, Slurm, TPU-simulator and container tiers
	$(BIN)/python -m pytest $(TEST_WORKERS) $(PYTEST_ARGS)

test-unit: $(BIN)/.installed ## only the fast single-process tests (under a minute on 2 cores)
	$(BIN)/python -m pytest $(TEST_WORKERS) tests/unit $(PYTEST_ARGS)

test-smoke: $(BIN)/.installed ## the unit tier and a multi-process smoke (train, bitwise resume, one fault): CI's second Python
	$(BIN)/python -m pytest $(TEST_WORKERS) tests/unit tests/multiprocess -m "smoke or not multiprocess" $(PYTEST_ARGS)

# coverage's data files (one per process), combined into COVERAGE_DIR/data; the report is printed and kept beside them
COVERAGE_DIR ?= $(CURDIR)/.coverage-data
coverage: $(BIN)/.installed ## line coverage of job/ and deploy/ over the whole suite, every process the tests start measured
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[coverage]'
	rm -rf $(COVERAGE_DIR) && mkdir -p $(COVERAGE_DIR)
	COVERAGE_CORE=$$($(BIN)/python -c 'import sys; print("sysmon" if sys.version_info >= (3, 12) else "ctrace")') \
	    COVERAGE_FILE=$(COVERAGE_DIR)/data $(BIN)/python -m coverage run -m pytest $(TEST_WORKERS) $(PYTEST_ARGS); status=$$?; \
	    COVERAGE_FILE=$(COVERAGE_DIR)/data $(BIN)/python -m coverage combine --quiet $(COVERAGE_DIR) && \
	    COVERAGE_FILE=$(COVERAGE_DIR)/data $(BIN)/python -m coverage report | tee $(COVERAGE_DIR)/report.txt | tail -n 3; exit $$status

# mypy reads pyproject.toml's [tool.mypy] (job/ and deploy/, for Python 3.11); its cache beside the venv whose
# libraries it read (ignored by git, removed with the venv)
lint: $(BIN)/.installed ## the type check of job/ and deploy/ (mypy, as CI runs it); VENV=.venv-py3.11 on that venv
	$(BIN)/mypy --cache-dir $(VENV)/.mypy_cache

bench: $(BIN)/.installed ## benchmarks vs hand-written JAX (~10-15 min on 2 cores): bench/RESULTS.md; BENCH_ARGS=--quick
	$(BIN)/python -m bench $(BENCH_ARGS)

rerun: $(BIN)/.installed ## replay RUN_DIR's recorded command into NEW, saying first what changed (docs/outputs.md)
	$(BIN)/python -m job rerun $(call quote,RUN_DIR) $(if $(NEW),$(call quote,NEW))

plot: $(BIN)/.installed ## a run's loss, lr and throughput as a PNG: RUN_DIR=runs/local (a sweep folder: every eval loss)
	$(BIN)/python -m job plot $(call quote,RUN_DIR)

runs: $(BIN)/.installed ## one table of a sweep's runs (or one run): SWEEP_DIR=runs/sweep1 [BY=eval_accuracy MAX=1]
	$(BIN)/python -m job runs $(call quote,SWEEP_DIR) $(if $(BY),--by=$(call quote,BY)) $(if $(filter 1,$(MAX)),--max)

slurm-up: ## start a real Slurm cluster on this machine (NODES=4 slurmd, slurmctld, munge; root)
	bash slurm/local-cluster.sh up $(NODES)

slurm-down: ## stop the local Slurm cluster and remove its folder
	bash slurm/local-cluster.sh down

# submit-slurm's and doctor's flags: the same make variables mean the same request to both
SLURM_FLAGS = --nodes $(call quote,NODES) --partition $(call quote,PARTITION) \
	--time $(call quote,TIME) --gpus-per-node $(call quote,GPUS_PER_NODE) \
	--tasks-per-node $(call quote,TASKS_PER_NODE) --gpu-type $(call quote,GPU_TYPE) \
	--cpus-per-task $(call quote,CPUS_PER_TASK) --mem $(call quote,MEM) --constraint $(call quote,CONSTRAINT) \
	--account $(call quote,ACCOUNT) --qos $(call quote,QOS) --image $(call quote,IMAGE) \
	--container-runtime $(call quote,CONTAINER_RUNTIME) --via $(call quote,VIA) \
	--gres=$(call quote,GRES) --exclusive=$(call quote,EXCLUSIVE) --dry-run=$(call quote,DRY_RUN) \
	$(if $(filter command line,$(origin PYTHON)),--python=$(call quote,PYTHON)) \
	--sbatch-args=$(call quote,SBATCH_ARGS) --wait=$(call quote,WAIT) \
	--sweep=$(call quote,SWEEP) --sweep-parallel=$(call quote,SWEEP_PARALLEL) --retries=$(call quote,RETRIES) \
	--spares=$(call quote,SPARES) $(SLURM_ARGS)

submit-slurm: $(BIN)/.installed ## submit the job to Slurm: NODES=4 [GPUS_PER_NODE ... ARGS=... SWEEP=... SPARES] (docs/slurm.md)
	@if [ -f $(SLURM_ENV) ]; then . $(SLURM_ENV); fi; \
	$(BIN)/python -m deploy.slurm $(SLURM_FLAGS)

# make doctor: WHERE=slurm (the default with sbatch on PATH), tpu (the default with TPU_NAME) or local
WHERE ?=
QUICK ?=
PROBE_WAIT ?=
# ARGS or SWEEP given: every doctor checks that run too (its task, config, global batch over the devices asked)
DOCTOR_RUN = --check-run=$(if $(filter command line,$(origin ARGS) $(origin SWEEP)),1,0)

doctor: $(BIN)/.installed ## what would fail, before anything starts: a line per check, ARGS' run too; WHERE=local|slurm|tpu
	@if [ -f $(SLURM_ENV) ]; then . $(SLURM_ENV); fi; \
	where=$(call quote,WHERE) why=given; \
	if [ -n "$$where" ]; then :; \
	elif [ -n $(call quote,TPU_NAME) ]; then where=tpu why="TPU_NAME is set; WHERE=slurm or WHERE=local to choose"; \
	elif command -v sbatch >/dev/null; then where=slurm why="sbatch is on PATH; WHERE=local or WHERE=tpu to choose"; \
	else where=local why="no TPU_NAME, no sbatch on PATH; WHERE=slurm or WHERE=tpu to choose"; fi; \
	case $$where in \
		local|slurm|tpu) echo "make doctor: WHERE=$$where ($$why)" ;; \
		*) echo "make doctor: expected WHERE=local, slurm or tpu, found WHERE=$$where. Fix: WHERE=slurm, or leave it unset (TPU_NAME set: tpu; sbatch on PATH: slurm; else local)" >&2; exit 2 ;; \
	esac; \
	case $$where in \
		slurm) $(BIN)/python -m deploy.slurm.doctor $(SLURM_FLAGS) --quick=$(call quote,QUICK) \
			--probe-wait=$(call quote,PROBE_WAIT) --wheelhouse=$(call quote,WHEELHOUSE) $(DOCTOR_RUN) ;; \
		tpu) $(TPU_CLI) doctor $(TPU_FLAGS) $(DOCTOR_RUN) ;; \
		local) JAX_PLATFORMS=cpu $(BIN)/python -m deploy.local.doctor -n $(call quote,NPROC) \
			--devices-per-process $(call quote,DEVICES) --python $(BIN)/python --args=$(call quote,ARGS) \
			--sweep=$(call quote,SWEEP) $(DOCTOR_RUN) ;; \
	esac

# make rehearse ARGS='train --task mypkg.tasks:TASK ...': deploy/rehearse.py; STEPS: each run's steps (default 6)
STEPS ?=
.PHONY: rehearse

rehearse: $(BIN)/.installed ## ARGS proven on local CPU before a queue: losses on 2x2 = 1x4, bitwise resume, eval; STEPS=6
	@JAX_PLATFORMS=cpu $(BIN)/python -m deploy.rehearse $(if $(value STEPS),--steps=$(call quote,STEPS)) \
		--args=$(call quote,ARGS)

# ------------------------------------------------------------------ Cloud TPU pods (deploy/tpu/cli.py)
# make tpu-pod TPU_NAME=my-pod ZONE=us-central2-b ACCELERATOR=v4-32 ARGS='train --run-dir /mnt/BUCKET/run1'
TPU_NAME ?=
ZONE ?=
ACCELERATOR ?= v4-8
RUNTIME ?=
PROJECT ?=
SPOT ?= 0
QUEUED ?= 0
IMAGE ?=
# RETRIES: how many times a failed run (any exit but 0, 2 = a configuration error, 75 = preempted and saved) is
# rerun from its newest checkpoint; 0: never. A preemption never spends one and is always resumed.
RETRIES ?= 3
DRY_RUN ?= 0
BUCKET ?=
TPU_LOCAL_DIR ?= runs/tpu
TPU_FLAGS = --name=$(call quote,TPU_NAME) --zone=$(call quote,ZONE) \
	--accelerator=$(call quote,ACCELERATOR) --runtime=$(call quote,RUNTIME) \
	--project=$(call quote,PROJECT) --spot=$(call quote,SPOT) --queued=$(call quote,QUEUED) \
	--image=$(call quote,IMAGE) --retries=$(call quote,RETRIES) --dry-run=$(call quote,DRY_RUN) \
	--local-dir=$(call quote,TPU_LOCAL_DIR) --bucket=$(call quote,BUCKET) --args=$(call quote,ARGS) \
	--sweep=$(call quote,SWEEP)
# Capacity, network and multislice (docs/tpu.md "Capacity, network and several slices")
RESERVED ?= 0
INTERNAL_IP ?= 0
NETWORK ?=
SUBNETWORK ?=
SERVICE_ACCOUNT ?=
TAGS ?=
SLICES ?= 1
CREATE_DEADLINE ?= 2h
TPU_FLAGS += --reserved=$(call quote,RESERVED) --internal-ip=$(call quote,INTERNAL_IP) \
	--network=$(call quote,NETWORK) --subnetwork=$(call quote,SUBNETWORK) \
	--service-account=$(call quote,SERVICE_ACCOUNT) --tags=$(call quote,TAGS) --slices=$(call quote,SLICES) \
	--create-deadline=$(call quote,CREATE_DEADLINE)
# SHIP: more paths of the checkout to ship (each task's package ships by itself); WHEELHOUSE: install from it, no index
SHIP ?=
TPU_FLAGS += --also-ship=$(call quote,SHIP) --wheelhouse=$(call quote,WHEELHOUSE)
TPU_CLI = $(BIN)/python -m deploy.tpu

.PHONY: tpu-pod tpu-create tpu-run tpu-logs tpu-stop tpu-delete tpu-status tpu-doctor

tpu-pod: $(BIN)/.installed ## Cloud TPU: create/reuse TPU_NAME, run ARGS on all workers, follow, resume, retry (docs/tpu.md)
	$(TPU_CLI) pod $(TPU_FLAGS)

tpu-doctor: $(BIN)/.installed ## Cloud TPU: with tpu-pod's variables, one line per check; exit 1 if any fails
	$(TPU_CLI) doctor $(TPU_FLAGS)

tpu-create: $(BIN)/.installed ## Cloud TPU: create the slice (or reuse a READY one) and wait for READY (docs/tpu.md)
	$(TPU_CLI) create $(TPU_FLAGS)

tpu-run: $(BIN)/.installed ## Cloud TPU: ship the code (or pull IMAGE), set up and run ARGS on every worker of a READY slice
	$(TPU_CLI) run $(TPU_FLAGS)

tpu-logs: $(BIN)/.installed ## Cloud TPU: copy every worker's log to TPU_LOCAL_DIR/TPU_NAME/logs, print worker 0's end
	$(TPU_CLI) logs $(TPU_FLAGS)

tpu-stop: $(BIN)/.installed ## Cloud TPU: stop the job (SIGTERM: it saves a checkpoint; SIGKILL after 60 s)
	$(TPU_CLI) stop $(TPU_FLAGS)

tpu-delete: $(BIN)/.installed ## Cloud TPU: delete the slice (and its queued resource with QUEUED=1)
	$(TPU_CLI) delete $(TPU_FLAGS)

tpu-status: $(BIN)/.installed ## Cloud TPU: print the slice's state (READY, PREEMPTED, NOT_FOUND, ...)
	$(TPU_CLI) status $(TPU_FLAGS)

# ---- wheels for machines without a package index (deploy/wheelhouse.py, docs/dependencies.md)
# WHEELHOUSE given to tpu-pod, tpu-run or doctor: the workers (compute nodes) install from it. The lock: FLAVOR's.
WHEELHOUSE ?=
WHEEL_PYTHON ?=
WHEEL_PLATFORM ?=
WHEEL_LOCK ?= $(if $(filter tpu,$(FLAVOR)),docker/requirements-tpu.lock,$(if $(filter cuda,$(FLAVOR)),$(CUDA_LOCK),requirements.lock))
.PHONY: wheelhouse

wheelhouse: $(BIN)/.installed ## the lock's wheels for WHEEL_PYTHON, WHEEL_PLATFORM in WHEELHOUSE; FLAVOR=tpu: libtpu's
	$(BIN)/python -m deploy.wheelhouse --dest=$(if $(value WHEELHOUSE),$(call quote,WHEELHOUSE),wheelhouse) \
		--lock='$(WHEEL_LOCK)' --python=$(call quote,WHEEL_PYTHON) --platform=$(call quote,WHEEL_PLATFORM) \
		--dry-run=$(call quote,DRY_RUN)

# ---- containers (docker/) ----
# not `IMAGE ?=`: IMAGE given to submit-slurm / tpu-* must stay empty by default
DOCKER_IMAGE = $(or $(IMAGE),jax-cluster-job:$(FLAVOR))
DOCKER_ARGS = $(if $(filter command line,$(origin ARGS)),$(ARGS),train --run-dir runs/docker)

.PHONY: docker-build docker-run-local

docker-build: ## build the image: FLAVOR=cpu|cuda|tpu [IMAGE=... BASE=...]; docker, else podman
	bash docker/build.sh '$(FLAVOR)' '$(DOCKER_IMAGE)' $(if $(BASE),'--build-arg=BASE=$(BASE)')

docker-run-local: docker-build $(BIN)/.installed ## the example job as NPROC (4) containers x DEVICES (2), one cluster; IMAGE=... ARGS=...
	$(BIN)/python docker/run_local.py -n $(NPROC) --devices-per-process $(DEVICES) --image '$(DOCKER_IMAGE)' -- $(DOCKER_ARGS)

# uv: the venv's (the test extra has it), else the one on PATH. LOCK_ARGS=--upgrade moves every pin to the newest.
UV = $(if $(wildcard $(BIN)/uv),$(BIN)/uv,uv)
LOCK_ARGS ?=
lock: ## re-resolve requirements.lock and the docker locks for Python 3.11+; LOCK_ARGS=--upgrade
	$(UV) pip compile pyproject.toml --universal --python-version 3.11 --extra test --extra bench $(LOCK_ARGS) -o requirements.lock
	$(UV) pip compile pyproject.toml --universal --python-version 3.11 --extra cuda $(LOCK_ARGS) -o docker/requirements-cuda.lock
	$(UV) pip compile pyproject.toml --universal --python-version 3.11 --extra tpu $(LOCK_ARGS) -o docker/requirements-tpu.lock

clean: ## remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache build *.egg-info
