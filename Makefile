# `make serve` and `make test` are all a fresh machine needs: both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: serve test install bench clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first: a package that depends on it would otherwise pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/dynamo serve graphs/elastic:Frontend $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(ARGS)

bench: install
	$(BIN)/python -m bench.decode $(ARGS)

clean:
	rm -rf $(VENV)
