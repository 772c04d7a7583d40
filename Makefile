# `make serve` and `make test` are all a fresh machine needs: both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: serve test lint install bench bench-tools clean

$(BIN)/.installed: pyproject.toml tools/debian-fetch.sh tools/criu-fetch.sh
	$(PY) -m venv $(VENV)
	# torch first: a package that depends on it would otherwise pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# etcd for the etcd discovery test, from Debian's packages, unpacked into the venv.
	tools/debian-fetch.sh bookworm $(VENV)/debian etcd-server
	ln -sf ../debian/root/usr/bin/etcd $(BIN)/etcd
	# CRIU 4.1.1 from Debian trixie with its own loader and libc, unpacked into the venv (bookworm's
	# 3.17 fails on recent kernels): $(BIN)/criu runs it.
	tools/criu-fetch.sh $(VENV)/criu $(BIN)/criu
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/dynamo serve graphs/elastic:Frontend $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install
	$(BIN)/python -m bench.decode $(ARGS)

# aiperf (and matplotlib) for bench.slo, in their own venv: aiperf's pins conflict with the project's.
$(VENV)/aiperf/bin/aiperf: bench/requirements-aiperf.txt | $(BIN)/.installed
	$(PY) -m venv $(VENV)/aiperf
	$(VENV)/aiperf/bin/pip install -q -r bench/requirements-aiperf.txt
	touch $@

bench-tools: $(VENV)/aiperf/bin/aiperf

clean:
	rm -rf $(VENV)
