# Two entry points, both safe on a fresh machine (see README):
#   make demo   set up, then run the main job
#   make test   set up, then run the test suite (also under python -O) and ruff
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# Until `kvstate demo` exists, the main job replays the shipped example
# journals: one clean run and two seeded bugs (exit 1 is the expected verdict).
demo: setup
	$(BIN)/kvstate replay examples/clean.jsonl
	$(BIN)/kvstate replay examples/poisoned_read.jsonl || test $$? -eq 1
	$(BIN)/kvstate replay examples/stale_generation.jsonl || test $$? -eq 1

# ruff first, so the last line CI prints is pytest's summary.
test: setup
	$(BIN)/ruff check .
	$(BIN)/python -O -m pytest -p no:cacheprovider -W ignore::pytest.PytestConfigWarning
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python benchmarks/bench_hot_path.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
