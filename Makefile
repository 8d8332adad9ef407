# hal0d: `make run` serves the demo on 127.0.0.1:8080, `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PREFIX ?= /usr/local
DESTDIR ?=
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck bench clean install uninstall venv

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/hal0d serve --config etc/hal0d.toml

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check hal0d tests

typecheck: $(STAMP)
	$(BIN)/mypy hal0d

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
