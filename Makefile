# Two entry points for a fresh machine; both create or reuse .venv in the checkout.
#   make demo   the main job (lpsync demo): a two-node cluster on this machine trains a CNN
#               on scikit-learn's digits through the DDP hook, beside one process and gloo
#   make test   lint, format, types and the sanitizer lane beside the whole suite (budget 8 min;
#               7.5-10 min on a fresh 2-core clone, install included, CONTRIBUTING.md)
#   make check  the fast lane for every edit: lint, format, types and the unit tier (budget 60 s;
#               50-57 s)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

# The unit tier, by folder: no daemons, processes or namespaces (CONTRIBUTING.md). A pure test
# goes into its package's unit/ folder (tests/daemon/unit, tests/transport/unit, tests/client/unit).
UNIT := tests/algorithms tests/engine tests/memory tests/daemon/unit tests/transport/unit tests/client/unit \
	tests/native/unit tests/lab/unit
# Workers for the whole suite: with four, the two cores were busy 89% of the run (992 CPU-s in
# 558 s); five took 525 s against four's 558-585 s (2026-12-07 night, CONTRIBUTING.md).
JOBS ?= 5

.PHONY: demo test suite rewrites checks check unit lint bytecode bench fuzz clean image test-deploy test-native test-slurm

# The native engine's sources: the install builds it (pyproject.toml), and an edit to them
# installs again so that the tests never run a stale engine.
NATIVE := lpsync/native/kernels.c lpsync/native/program.c lpsync/native/engine.c lpsync/native/net.c \
	lpsync/native/engine.h lpsync/native/_engine.c
CC ?= gcc

# Every process these targets start writes the bytecode of what it imports, also where
# the environment sets PYTHONDONTWRITEBYTECODE (this project's machines do): else every
# daemon, rank and trainer compiled what it imported from source again (lpsync ~0.1 CPU-s,
# torch ~3) and every pytest worker rewrote every test module's asserts (~6 CPU-s).
export PYTHONDONTWRITEBYTECODE :=

# The install: uv where it installs and resolves, else pip. uv reads none of pip's
# configuration, so pip's find-links (where a machine keeps a local torch wheel, as this
# project's machines do) are handed to it; without them uv would take PyPI's CUDA torch,
# which no ucxx-cu12 resolves beside, and pip installs instead. Neither compiles what it
# installs: the packages' bytecode is written as they are first imported (all of
# site-packages: 35 s, 59 CPU-s on 2 cores; what the suite imports: a few CPU-s). uv: ~15 s
# on a fresh clone, where pip took 68-80 s, compiling.
EXTRAS := '.[test,torch,deploy]'

$(BIN)/.installed: pyproject.toml clients/python/pyproject.toml $(NATIVE)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	set --; for link in $$($(BIN)/python -m pip config get global.find-links 2>/dev/null); do \
		set -- "$$@" --find-links "$$link"; done; \
	{ $(BIN)/python -m pip install -q uv \
	  && $(BIN)/uv pip install -q --python $(BIN)/python "$$@" -e $(EXTRAS) -e clients/python; } \
	|| $(BIN)/python -m pip install -q --no-compile -e $(EXTRAS) -e clients/python
	touch $@

demo: $(BIN)/.installed bytecode
	$(BIN)/lpsync demo

# The checkout's own bytecode, written once before the processes start instead of by
# each of the first ones to import a module at once. Edits are safe: a .pyc records its
# source's mtime and size, and a stale one is ignored.
bytecode: $(BIN)/.installed
	$(BIN)/python -m compileall -q -j 0 lpsync lab clients/python/lpsync_client tests examples

lint: $(BIN)/.installed
	$(BIN)/ruff check lpsync lab tests clients examples scripts protos deploy
	$(BIN)/ruff format --check lpsync lab tests clients examples scripts protos deploy
	$(BIN)/mypy
	cd clients/python && ../../$(BIN)/mypy

# Lint and the unit tier side by side: each is one process, so on two cores the lane takes
# the longer of the two, not their sum; -Otarget prints each one's output whole when it ends.
check: bytecode
	$(MAKE) --no-print-directory -j2 -Otarget lint unit

# Three workers on two cores: a few unit tests wait (threads, timeouts), and three took 76-84 s
# where two took 89-92 s (2026-12-07).
unit: $(BIN)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 3 --dist loadfile $(UNIT)

# The checks and the sanitizer lane beside the suite: each is one process for about a
# minute, which the suite's workers absorb, instead of a minute before the suite starts; a
# failed check fails `make test` when the suite ends. The suite prints as it goes; each
# check prints its output whole when it ends (-Otarget).
test: bytecode
	$(MAKE) --no-print-directory -j3 suite checks

checks:
	$(MAKE) --no-print-directory -Otarget lint test-native

suite: $(BIN)/.installed bytecode rewrites
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile --no-loadscope-reorder --durations=30

# On a fresh clone the suite's five workers would each rewrite every test module's asserts
# at once (~7 CPU-s each), and compile what they import (torch, hypothesis, grpc): one
# collection writes both first, beside lint. Skipped once the rewritten modules are there
# (pytest rewrites an edited module again by itself).
rewrites: bytecode
	$(if $(wildcard tests/__pycache__/conftest.*-pytest-*.pyc),,\
		$(BIN)/python -m pytest -q --collect-only -p no:cacheprovider >/dev/null)

# The native engine alone under AddressSanitizer and UndefinedBehaviorSanitizer: programs
# against a reference, the doorbell with threads as clients (fallbacks, disarm, deadline,
# stop), and its program parser fuzzed with 200 000 corrupted programs (~10 s).
test-native: $(NATIVE) tests/native/engine_test.c
	mkdir -p out
	$(CC) -O1 -g -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -fsanitize=address,undefined \
		-fno-sanitize-recover=all -fno-omit-frame-pointer lpsync/native/kernels.c lpsync/native/program.c \
		lpsync/native/engine.c lpsync/native/net.c \
		tests/native/engine_test.c -o out/engine_test -lpthread -lm
	out/engine_test 200000

bench: $(BIN)/.installed
	$(BIN)/python -m lab.executor --procs 4 --bytes 64MiB --algorithm lp,ring,be,mst
	$(BIN)/lpsync bench --op allreduce --bytes 4:256MiB --procs 4 --compare gloo
	$(BIN)/python -m lab.responsive --seconds 10

# The long fuzz run of docs/reliability.md (the suite runs 300 cases).
fuzz: $(BIN)/.installed
	LPSYNC_FUZZ_EXAMPLES=10000 $(BIN)/python -m pytest -q -s tests/daemon/test_fuzz_control.py

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis

# The images without a registry or index (docs/deploy.md): wheelhouse, debootstrap base,
# lpsync:dev, lpsync-trainer:dev, lpsync-prometheus:dev. Root and a Docker engine.
image:
	scripts/build_images.sh

# docker-compose.yml end to end on a Docker engine (builds the images; skips with the
# reason where no engine answers; .ci/run starts dockerd for it). ~6 min warm.
test-deploy: $(BIN)/.installed
	LPSYNC_DEPLOY_E2E=1 $(BIN)/python -m pytest -q -s -m deploy_e2e tests/deploy/test_compose_e2e.py

# deploy/slurm/lpsync-train.sbatch on a real one-node Slurm: Debian's slurm-wlm and munge,
# started and stopped by the test in a temporary directory (root). A training run, scancel
# in the middle, the time limit, failing trainers (docs/deploy.md, "Slurm"); skips with the
# reason where Slurm is not installed or does not start. ~3.5 min.
test-slurm: $(BIN)/.installed
	LPSYNC_SLURM_E2E=1 $(BIN)/python -m pytest -q tests/deploy/test_slurm_real.py

# PyTorch's own distributed tests (torch's DistributedTest suite, in the torch wheel) on
# gloo and on lpsync (a local daemon), world sizes 2 and 3; fails on a test that passes on
# gloo and not on lpsync unless tests/torch_suite/known_gaps.toml lists it with its reason
# (docs/training.md, "PyTorch's own test suite"). `make test` runs a selection of it.
.PHONY: torch-suite
torch-suite: $(BIN)/.installed
	$(BIN)/python -m tests.torch_suite.runner --world-sizes 2,3
