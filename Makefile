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
# The pin lives in pyproject.toml; llama.cpp's CPU level: AVX2/FMA on x86-64 (every server CPU of the last
# decade), its generic build elsewhere.
LLAMA_CPP := $(shell grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)
LLAMA_CMAKE_ARGS ?= $(if $(filter x86_64,$(shell uname -m)),-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
LLAMA_WHEELS := $(HOME)/.cache/tokenspout/wheels/$(shell echo '$(LLAMA_CPP) $(LLAMA_CMAKE_ARGS) $(shell uname -m) $(shell $(PYTHON) -V 2>&1)' | sha256sum | cut -c1-16)
# The benchmarks' reference, llama-server, built at the same level (`make llama-server`).
LLAMA_SERVER := $(subst /wheels/,/llama-server/,$(LLAMA_WHEELS))/llama-server

.PHONY: help venv tools deploy-tools client-tools clients model proto release-protos lint check run test test-fast bench llama-server clean

help:
	@echo "make run    - create the environment, fetch the model, serve it and stream an answer"
	@echo "make test   - run the test suite against a real server and model"
	@echo "make test-fast - run only the tests that need no model (the service on a fake engine; minutes)"
	@echo "make check - lint (ruff, buf) and type-check (mypy, strict on backend/ and service/)"
	@echo "make proto  - regenerate the Python and TypeScript code from protos/"
	@echo "make bench  - run the streaming benchmark"
	@echo "make llama-server - build the benchmarks' reference, llama.cpp's llama-server, once, and print its path"
	@echo "make clients - generate and build the Go, Java and C++ examples (clients/README.md)"

$(VENV)/.installed: pyproject.toml clients/python/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	# llama-cpp-python compiles llama.cpp (10-15 min) for a fixed x86-64 level, not -march=native: a native
	# build on a CPU with AMX crashes in llama_decode where the OS does not grant AMX state (seen on these
	# machines). pip's wheel cache keys a wheel by its sdist, not by these flags, so the wheel is built apart
	# and kept under a key of its own (version, flags, machine, Python): a later clone installs it in seconds.
	[ -n "$$(ls $(LLAMA_WHEELS)/*.whl 2>/dev/null)" ] || CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
	  $(PY) -m pip wheel --quiet --no-deps --no-cache-dir --wheel-dir $(LLAMA_WHEELS) $(LLAMA_CPP)
	$(PY) -m pip install --quiet $(LLAMA_WHEELS)/*.whl
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
	# Envoy's JSON transcoder: the same plus google.rpc's error types (docs/deployment.md, "HTTP/JSON and Server-Sent Events").
	$(PY) deploy/envoy/descriptor_set.py

# At a release: record the committed proto as the baseline of the breaking-change test.
release-protos: tools
	$(BUF) build '.git#ref=HEAD' --exclude-source-info -o '-#format=json' | $(PY) -m json.tool --indent 1 > protos/released/tokenspout-v1.json

lint: tools
	$(BUF) lint

# Static gates, run before every test run: ruff over the Python tree, mypy strict on backend/ and service/.
check: venv $(BUF)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(BUF) lint

run: venv model
	LISTEN=$(LISTEN) tools/run_demo.sh

# Deployment checks (tests/deploy/): schema validators,
# checkov, hadolint and envoy in their own venv, and Debian's HAProxy as the real gRPC proxy.
$(DEPLOY_VENV)/.installed: deploy/requirements-tools.txt
	$(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/pip install --quiet -r deploy/requirements-tools.txt
	touch $@

deploy-tools: $(DEPLOY_VENV)/.installed
	# openssl: docs/getting-started.md's keys and certificate, run as written by tests/test_docs_examples.py.
	command -v haproxy >/dev/null && command -v curl >/dev/null && command -v openssl >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends haproxy curl openssl)

# Generated clients in Go, Java and C++ (tests/clients/test_clients_generated.py, clients/README.md): Debian's
# toolchains, protoc plugins and gRPC libraries. `NAME=VERSION*` pins bookworm's upstream version and
# still takes Debian's security revisions of it (an exact revision vanishes from the archive when the
# next one lands).
CLIENT_DEBS := protobuf-compiler=3.21.12* cmake=3.25.1* \
  golang-go=2:1.19* protoc-gen-go=1.28.1* protoc-gen-go-grpc=1.33.3* golang-google-grpc-dev=1.33.3* \
  golang-google-protobuf-dev=1.28.1* golang-github-golang-protobuf-1-5-dev=1.5.2* \
  golang-google-genproto-dev=0.0~git20200413* \
  default-jdk-headless=2:1.17* protobuf-compiler-grpc-java-plugin=1.41.3* libgrpc-java=1.41.3* \
  libprotobuf-java=3.21.12* libnetty-java=1:4.1.48* libperfmark-java=0.21.0* libgoogle-gson-java=2.10* \
  libgeronimo-annotation-1.3-spec-java=1.3* \
  protobuf-compiler-grpc=1.51.1* libgrpc++-dev=1.51.1* libprotobuf-dev=3.21.12*
CLIENT_DEB_NAMES := $(foreach deb,$(CLIENT_DEBS),$(firstword $(subst =, ,$(deb))))

client-tools:
	@missing=$$(dpkg-query -W -f='$${Status}\n' $(CLIENT_DEB_NAMES) 2>&1 | grep -vc '^install ok installed$$'); \
	  [ "$$missing" = 0 ] || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends $(foreach deb,$(CLIENT_DEBS),'$(deb)'))

clients: client-tools venv $(BUF)
	for language in go java cpp; do $(MAKE) -C clients/$$language PYTHON=$(CURDIR)/$(PY) || exit 1; done

# The test files run side by side in TEST_WORKERS processes (pytest-xdist; each file whole in one, so a module's
# servers start once; the slowest files first, tests/conftest.py), each worker and the servers it starts kept to
# its own share of the CPUs. On 2 cores: 11m23s in two against 15m12s in one (unpinned, four took 29 minutes against
# 31, most likely threads spinning for each other's cores). `TEST_WORKERS=0` runs one process.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The benchmarks' smoke tests (tests/bench/test_smoke.py) run the reference, llama-server, too.
test: check tools model deploy-tools client-tools $(LLAMA_SERVER)
	TOKENSPOUT_LLAMA_SERVER=$(LLAMA_SERVER) $(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# Every test that needs no model (tests/conftest.py marks the others `model` by the fixtures they ask for).
test-fast: check tools deploy-tools
	$(PY) -m pytest -m "not model" $(PYTEST_PARALLEL) $(PYTEST_ARGS)

bench: venv model
	$(PY) -m bench streaming $(BENCH_ARGS)

# The benchmarks' reference: llama.cpp's own llama-server, built once (about 7 minutes on 2 cores) from the source
# vendored in the pinned llama-cpp-python sdist, at the same CPU level as the engine's wheel; prints its path
# (`--llama-server PATH`).
llama-server: $(LLAMA_SERVER)
	@echo $(LLAMA_SERVER)

$(LLAMA_SERVER): | $(VENV)/.installed
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	  $(PY) -m pip download --quiet --no-deps --no-binary :all: --dest "$$tmp" $(LLAMA_CPP); \
	  tar -xzf "$$tmp"/*.tar.gz -C "$$tmp"; \
	  cmake -S "$$tmp"/llama_cpp_python-*/vendor/llama.cpp -B "$$tmp/build" -DCMAKE_BUILD_TYPE=Release \
	    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF $(LLAMA_CMAKE_ARGS) >/dev/null; \
	  cmake --build "$$tmp/build" --target llama-server -j "$$(nproc)" >/dev/null; \
	  mkdir -p $(@D); cp "$$tmp/build/bin/llama-server" $@

clean:
	rm -rf $(VENV) $(DEPLOY_VENV) node_modules .pytest_cache build/clients clients/go/gen clients/java/gen clients/cpp/gen
