# The README's two commands. Both run the idempotent set-up first (seconds once it has run).
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
# Open MPI refuses root without these; harmless as any other user.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export TF_CPP_MIN_LOG_LEVEL := 3
export PATH := $(BIN):$(PATH)

.PHONY: setup train test lint
setup:
	@bash scripts/setup.sh

## The main job: 2-rank Horovod data-parallel training on the embedded digits data.
train: setup
	horovodrun -np 2 -H localhost:2 ringtrain train --strategy data

## Lint, then the whole test suite (several tests start mpirun, horovodrun and a real Slurm).
test: setup lint
	pytest

lint:
	ruff check .
	ruff format --check .
