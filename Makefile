# Two entry points for a fresh machine; both create or reuse .venv in the checkout.
#   make demo   the main job: the simulator reproduces and checks the LP paper's claims
#   make test   ruff, then the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: $(BIN)/.installed
	mkdir -p out
	$(BIN)/lpsync claims --plot out/paper-claims.png

test: $(BIN)/.installed
	$(BIN)/ruff check lpsync tests
	$(BIN)/python -m pytest -q

bench: $(BIN)/.installed
	$(BIN)/python -m lpsync.bench.executor --procs 4 --bytes 64MiB --algorithm lp,ring,be,mst

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
