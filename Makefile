# CPU install path: a virtualenv with the pinned CPU torch, Mooncake (TCP) and the project.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
MODEL  ?= .cache/tiny-qwen3

.PHONY: setup test test-unit test-integration test-e2e run clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install_system_deps.sh
	scripts/install_system_deps.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch; a bare "torch" would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,test]'
	touch $@

test: setup
	$(BIN)/python -m pytest -q tests

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

run: setup
	$(BIN)/pdcluster up --demo

clean:
	rm -rf $(VENV) .cache
