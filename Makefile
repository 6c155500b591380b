# CPU install path: a virtualenv with exactly the versions of requirements/cpu.lock (the CPU torch
# 2.13.0 build, Mooncake over TCP, the test tools) and the project, plus a separate venv with the
# real sglang-router for the conformance test. `make lock` re-resolves the locks (scripts/lock.sh).
PYTHON      ?= python3
VENV        ?= .venv
BIN         := $(VENV)/bin
ROUTER_VENV ?= .venv-router
LOCK        := requirements/cpu.lock
# Where torch==2.13.0+cpu comes from when no find-links directory has it (this machine's pip
# config points at one): e.g. make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PIP_SOURCES := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))

.PHONY: setup router-venv test-deps lock test test-unit test-integration test-e2e run chaos soak fuzz shared-room grammar-acceptance multiturn-acceptance clean

setup: $(VENV)/.installed

# A new lock rebuilds the venv from scratch (--clear), so nothing outside the lock lingers.
# --no-deps everywhere: the lock is the whole set, pip resolves nothing; pip check proves it whole.
$(VENV)/.installed: pyproject.toml $(LOCK) scripts/install_system_deps.sh
	scripts/install_system_deps.sh
	$(PYTHON) -m venv --clear $(VENV)
	$(BIN)/pip install -q "$$(grep '^pip==' $(LOCK))"
	$(BIN)/pip install -q --no-deps $(PIP_SOURCES) -r $(LOCK)
	# setuptools and wheel come from the lock: build without isolation, so none is fetched unpinned.
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip check
	touch $@

lock:
	scripts/lock.sh

# sglang-router 0.3.2 (requirements/sglang-router.lock), the real front door tests/e2e/test_sglang_router.py
# puts in front of our nodes, in a venv of its own so its pins never meet ours; our venv's pip
# installs it (a fresh venv's bundled pip took twice as long). Best effort: if the install fails
# (no network), the tests still run and that one skips, saying why; the next `make test` tries again.
router-venv: $(ROUTER_VENV)/.installed

$(ROUTER_VENV)/.installed: requirements/sglang-router.lock | $(VENV)/.installed
	@rm -rf $(ROUTER_VENV)
	@$(PYTHON) -m venv --without-pip $(ROUTER_VENV) && echo '*' > $(ROUTER_VENV)/.gitignore \
	  && $(BIN)/pip --python $(ROUTER_VENV)/bin/python install -q --no-deps -r requirements/sglang-router.lock \
	  && $(BIN)/pip --python $(ROUTER_VENV)/bin/python check && touch $@ \
	  || { rm -rf $(ROUTER_VENV); echo "router-venv: installing requirements/sglang-router.lock failed;" \
	       "tests/e2e/test_sglang_router.py will skip" >&2; }

# Debian's chromium, for the test that loads the router's live page (tests/e2e/test_dashboard.py).
# Best effort, like router-venv: without it (no apt, no network) that test skips, saying why.
test-deps:
	@scripts/install_test_deps.sh || echo "test-deps: installing chromium failed; tests/e2e/test_dashboard.py will skip" >&2

test: setup router-venv test-deps
	$(BIN)/python -m pytest -q tests

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

test-integration: setup
	$(BIN)/python -m pytest -q tests/integration

test-e2e: setup router-venv test-deps
	$(BIN)/python -m pytest -q tests/e2e

run: setup
	$(BIN)/pdcluster up --demo

# Reliability runs (docs/RELIABILITY.md): 1000 requests under client and node faults through our
# router over 2 prefill + 2 decode nodes; a 10-minute soak at saturation with RSS sampled.
CHAOS_REQUESTS ?= 1000
SOAK_S ?= 600
chaos: setup
	$(BIN)/python -m tests.chaos --requests $(CHAOS_REQUESTS)

soak: setup
	$(BIN)/python -m tests.chaos --soak-s $(SOAK_S)

FUZZ_EXAMPLES ?= 500
fuzz: setup
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q tests/e2e/test_fuzz_http.py tests/unit/test_fuzz_control_plane.py

# Two requests sharing a bootstrap room, one and two decodes, random timing (CI runs 8 trials).
SHARED_ROOM_TRIALS ?= 200
shared-room: setup
	SHARED_ROOM_TRIALS=$(SHARED_ROOM_TRIALS) $(BIN)/python -m pytest -q -p no:cacheprovider tests/e2e/test_shared_room.py

# Structured-output acceptance (tests/e2e/grammar_schemas.py): GRAMMAR_REQUESTS requests over 20
# JSON schemas on each topology (2P2D behind our router, a 1P1D pair, sglang-router).
GRAMMAR_REQUESTS ?= 200
grammar-acceptance: setup router-venv
	GRAMMAR_REQUESTS=$(GRAMMAR_REQUESTS) $(BIN)/python -m pytest -q tests/e2e/test_structured_pd.py \
		tests/e2e/test_sglang_router.py -k structured tests/e2e/test_router_cluster.py::test_structured_outputs_validate_and_greedy_match_hf

# Multi-turn acceptance on decodes with their prefix cache: a prefill + decode pair driven directly
# (tests/e2e/test_decode_pd.py), and 2P2D behind two routers of ours, one sending next turns to their
# decode alone (tests/e2e/test_multiturn_routed.py). Each turn's answer equals HF greedy and reports
# the decode's reuse of the previous turn (decode_reused_tokens) as its metrics count it. CI runs
# 2 x 3 and 3 x 4 (the qwen3 pair keeps no decode cache: only the llama one runs here).
MULTITURN_CONVERSATIONS ?= 32
MULTITURN_TURNS ?= 6
multiturn-acceptance: setup
	MULTITURN_CONVERSATIONS=$(MULTITURN_CONVERSATIONS) MULTITURN_TURNS=$(MULTITURN_TURNS) $(BIN)/python -m pytest \
		-q tests/e2e/test_decode_pd.py tests/e2e/test_multiturn_routed.py -k "multiturn and (llama or routed)"

clean:
	rm -rf $(VENV) $(ROUTER_VENV) .venv-tools
