# CPU install path: a virtualenv with the pinned CPU torch, Mooncake (TCP) and the project, plus
# a separate venv with the real sglang-router for the conformance test.
PYTHON      ?= python3
VENV        ?= .venv
BIN         := $(VENV)/bin
ROUTER_VENV ?= .venv-router

.PHONY: setup router-venv test test-unit test-integration test-e2e run clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install_system_deps.sh
	scripts/install_system_deps.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch; a bare "torch" would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,test]'
	touch $@

# sglang-router 0.3.2, the real front door tests/e2e/test_sglang_router.py puts in front of our
# nodes, in a venv of its own so its pins never meet ours; our venv's pip installs it (a fresh
# venv's bundled pip took twice as long). Best effort: if the install fails (no network), the tests
# still run and that one skips, saying why; the next `make test` tries again.
router-venv: $(ROUTER_VENV)/.installed

$(ROUTER_VENV)/.installed: | $(VENV)/.installed
	@rm -rf $(ROUTER_VENV)
	@$(PYTHON) -m venv --without-pip $(ROUTER_VENV) && echo '*' > $(ROUTER_VENV)/.gitignore \
	  && $(BIN)/pip --python $(ROUTER_VENV)/bin/python install -q sglang-router==0.3.2 && touch $@ \
	  || { rm -rf $(ROUTER_VENV); echo "router-venv: installing sglang-router==0.3.2 failed;" \
	       "tests/e2e/test_sglang_router.py will skip" >&2; }

test: setup router-venv
	$(BIN)/python -m pytest -q tests

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

test-integration: setup
	$(BIN)/python -m pytest -q tests/integration

test-e2e: setup router-venv
	$(BIN)/python -m pytest -q tests/e2e

run: setup
	$(BIN)/pdcluster up --demo

clean:
	rm -rf $(VENV) $(ROUTER_VENV)
