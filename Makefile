# The front door. `make help` lists every target.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
NPROC ?= 4
DEVICES ?= 2
ARGS ?= train --run-dir runs/local
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
NODES ?= 4
SLURM_ENV := /var/tmp/jax-job-slurm/env.sh
SLURM_ARGS := $(if $(filter command line,$(origin ARGS)),$(ARGS),train --run-dir runs/slurm)

.PHONY: help venv run-local test-local test-unit lock clean slurm-up slurm-down submit-slurm

help: ## list every target
	@awk 'BEGIN {FS = ":.*## "} /^[a-z][a-z0-9-]*:.*## / {printf "  make %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(BIN)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.lock
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

venv: $(BIN)/.installed ## create .venv from the lock file (the other targets do this themselves)

run-local: $(BIN)/.installed ## the example job on NPROC (4) local CPU processes x DEVICES (2); ARGS=... passes arguments
	JAX_PLATFORMS=cpu $(BIN)/python -m job.launch -n $(NPROC) --devices-per-process $(DEVICES) -- $(BIN)/python -m job $(ARGS)

test-local: $(BIN)/.installed ## the whole test suite: unit and real multi-process JAX tests
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: $(BIN)/.installed ## only the fast single-process tests
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

slurm-up: ## start a real Slurm cluster on this machine (NODES=4 slurmd, slurmctld, munge; root)
	bash slurm/local-cluster.sh up $(NODES)

slurm-down: ## stop the local Slurm cluster and remove its folder
	bash slurm/local-cluster.sh down

submit-slurm: $(BIN)/.installed ## submit the job: NODES=4 [PARTITION TIME GPUS_PER_NODE CPUS_PER_TASK ACCOUNT QOS IMAGE VIA=sbatch WAIT=1 ARGS=...]
	@if [ -f $(SLURM_ENV) ]; then . $(SLURM_ENV); fi; \
	$(BIN)/python -m deploy.slurm --nodes '$(NODES)' --partition '$(PARTITION)' --time '$(TIME)' \
		--gpus-per-node '$(GPUS_PER_NODE)' --cpus-per-task '$(CPUS_PER_TASK)' --account '$(ACCOUNT)' \
		--qos '$(QOS)' --image '$(IMAGE)' --via '$(VIA)' $(if $(filter 1,$(WAIT)),--wait) -- $(SLURM_ARGS)

lock: ## re-resolve requirements.lock from pyproject.toml (needs uv)
	uv pip compile pyproject.toml --extra test --python-version 3.11 --python-platform x86_64-manylinux_2_28 -o requirements.lock

clean: ## remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache build *.egg-info
