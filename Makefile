# grpo-mesh developer entry points. Everything runs from the project virtualenv (.venv), which
# `make install` creates and keeps in sync with pyproject.toml (scripts/install.sh; a no-op when current).
#
#   make demo [MODEL=smollm2] [STEPS=N] [RUN_DIR=runs/x] [ARGS="--secure --resume ..."]
#                                                        end-to-end run on this machine (grpo-mesh demo)
#   make test [PYTEST_ARGS="-m 'not slow'"]             the test suite (CI: .ci/run), integrations included
#   make integrations                                   atropos, OpenEnv and verifiers (docs/ecosystem.md)
#   make up [PROFILE=gpu|gpu-nccl] [GRPO_MESH_CONFIG=tiny.toml]   the four services in Docker Compose
#   make compose-test                                   build, run, stop and resume the compose deployment
#   make soak [SOAK_ARGS="--seed 1 --duration 600"]     a long demo under random kill -9 and SIGSTOP, then checks
#   make studio                                         the web studio on http://127.0.0.1:7860 (runs under runs/)
#
# Every other command line is `.venv/bin/grpo-mesh <command>` (`grpo-mesh --help` lists them: serve,
# status, audit, check-env, prepare, certs); booleans are a bare `--flag` / `--no-flag` everywhere.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV := .venv
PY := $(VENV)/bin/python
RUFF := $(VENV)/bin/ruff
BUF := $(VENV)/bin/buf
PROFILE ?= cpu
PY_DIRS := services tests scripts bench integrations examples

# Passed to the launcher only when set, so its own defaults apply otherwise.
DEMO_FLAGS := $(if $(MODEL),--model $(MODEL)) $(if $(STEPS),--steps $(STEPS)) $(if $(RUN_DIR),--run-dir $(RUN_DIR)) $(ARGS)

.PHONY: help install integrations demo test proto lint format up compose-test clean gpu-check gpu-wheels soak studio

help: ## List the targets.
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 10

install: ## Create/refresh .venv (idempotent; CPU or GPU build chosen by nvidia-smi).
	bash scripts/install.sh

integrations: install ## atroposlib and the OpenEnv client into .venv; openenv and verifiers into .venvs/ (docs/ecosystem.md).
	bash scripts/install_integrations.sh

demo: install ## Train end to end on this machine (MODEL=smollm2, STEPS=, RUN_DIR=, ARGS="--flag ...").
	$(VENV)/bin/grpo-mesh demo $(DEMO_FLAGS)

studio: install ## The web studio: start, watch and inspect runs, chat with the policy (docs/studio.md).
	$(VENV)/bin/grpo-mesh studio

test: install integrations ## Run the test suite (the ecosystem integrations installed first); collecting no tests is a failure.
	@rc=0; $(PY) -m pytest $(PYTEST_ARGS) || rc=$$?; \
	if [[ $$rc -eq 5 ]]; then echo "make test: pytest collected no tests" >&2; rc=1; fi; \
	exit $$rc

proto: ## Regenerate grpo/ from protos/ and lint the protos.
	$(PY) scripts/gen_protos.py
	cd protos && ../$(BUF) lint

lint: ## ruff check, ruff format --check, buf lint.
	$(RUFF) check $(PY_DIRS)
	$(RUFF) format --check $(PY_DIRS)
	cd protos && ../$(BUF) lint

format: ## Apply ruff fixes and formatting.
	$(RUFF) check --fix $(PY_DIRS)
	$(RUFF) format $(PY_DIRS)

soak: install ## Long 2-rollout demo under random kill -9 and SIGSTOP faults, then PASS/FAIL checks (SOAK_ARGS="--duration 600 ...").
	$(PY) bench/soak.py $(SOAK_ARGS)

gpu-check: ## On an NVIDIA GPU machine: GPU tests, cuda_ipc two-process check, weight-transport benchmark; one report.
	bash scripts/gpu_check.sh

gpu-wheels: ## Download into .whl/ the wheels gpu-check needs on the GPU image (Python 3.12).
	bash scripts/gpu_wheels.sh

up: ## docker compose up --build (PROFILE=cpu|gpu|gpu-nccl; GRPO_MESH_CONFIG=tiny.toml: no model download).
	PROFILE=$(PROFILE) bash scripts/compose-up.sh $(ARGS)

compose-test: install ## Build, start, grpcurl, train, stop and resume the CPU compose run (needs a Docker daemon).
	PROFILE=cpu bash scripts/compose-up.sh --prepare-only
	$(PY) -m pytest -m docker -p no:cacheprovider tests/e2e/test_compose_up.py $(PYTEST_ARGS)

clean: ## Remove caches and build artefacts (keeps .venv and runs/).
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -rf .pytest_cache .ruff_cache build
