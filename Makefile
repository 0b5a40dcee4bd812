# Two entry points for a fresh machine; both create or reuse .venv in the checkout.
#   make demo   the main job (lpsync demo): a two-node cluster on this machine trains a CNN
#               on scikit-learn's digits through the DDP hook, beside one process and gloo
#   make test   ruff, then the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test bench fuzz clean

$(BIN)/.installed: pyproject.toml clients/python/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,torch,deploy]' -e clients/python
	touch $@

demo: $(BIN)/.installed
	$(BIN)/lpsync demo

test: $(BIN)/.installed
	$(BIN)/ruff check lpsync tests clients
	$(BIN)/python -m pytest -q

bench: $(BIN)/.installed
	$(BIN)/python -m lpsync.bench.executor --procs 4 --bytes 64MiB --algorithm lp,ring,be,mst
	$(BIN)/lpsync bench --op allreduce --bytes 4:256MiB --procs 4 --compare gloo
	$(BIN)/python -m lpsync.bench.responsive --seconds 10

# The long fuzz run of docs/reliability.md (the suite runs 300 cases).
fuzz: $(BIN)/.installed
	LPSYNC_FUZZ_EXAMPLES=10000 $(BIN)/python -m pytest -q -s tests/daemon/test_fuzz_control.py

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
