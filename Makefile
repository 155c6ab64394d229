# Set-up is two commands: `make serve` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint bench install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test]"
	$(BIN)/hyprefix build-kernels
	touch $(STAMP)

install: $(STAMP)

SERVE_ARGS ?=

serve: $(STAMP)
	$(BIN)/hyprefix serve --host 127.0.0.1 --port 8000 $(SERVE_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) lint
	$(BIN)/python tools/models/fetch_test_models.py
	bash tools/browser/ensure_browser.sh
	$(BIN)/hyprefix build-kernels --strict
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/hyprefix bench --workload throughput --repeats 3 --out bench-out/throughput.json
	$(BIN)/python tools/bench/bench_targets.py bench-out/throughput.json

clean:
	rm -rf $(VENV)
