# The README's two commands. Both run the idempotent set-up first (seconds once it has run).
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
# Open MPI refuses root without these; harmless as any other user.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export TF_CPP_MIN_LOG_LEVEL := 3
export PATH := $(BIN):$(PATH)
# The jobs run in the activated venv, as a user's shell would: its Open MPI parameter file gives
# every mpirun and horovodrun a short keepalive, so a job whose node went silent ends.
ACTIVATED := . $(VENV)/bin/activate &&

.PHONY: setup train test lint
setup:
	@bash scripts/setup.sh

## The main job: 2-rank Horovod data-parallel training on the embedded digits data.
train: setup
	$(ACTIVATED) horovodrun -np 2 -H localhost:2 ringtrain train --strategy data

## Lint, then the whole test suite (several tests start mpirun, horovodrun and a real Slurm).
test: setup lint
	$(ACTIVATED) pytest

lint:
	ruff check .
	ruff format --check .
	lint-imports

## The docs site (mkdocs.yml): build it into site/, or serve it while you edit.
.PHONY: docs docs-serve
docs: setup
	NO_MKDOCS_2_WARNING=1 mkdocs build --strict
docs-serve: setup
	NO_MKDOCS_2_WARNING=1 mkdocs serve
