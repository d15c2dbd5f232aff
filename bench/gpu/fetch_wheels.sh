#!/usr/bin/env bash
# Downloads, here, the wheels the GPU check installs there (Python 3.12, x86-64 Linux,
# no network there) into .whl/, which git ignores. The GPU image already holds torch,
# safetensors, tokenizers, transformers, pandas, numpy, jinja2 and the rest, so only
# what it lacks (or holds at another version) travels.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
PLATFORMS=()
for n in 5 17 24 27 28 31 34 35 39; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
rm -rf .whl && mkdir .whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --dest .whl \
    exllamav2==0.3.2 fastparquet==2026.9.0 cramjam==2.14.0 websockets==17.4 \
    exllamav3==1.6.5 marisa-trie==1.4.1 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \
    typing-inspection==0.4.5 \
    grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-status==1.85.1 \
    googleapis-common-protos==1.76.0 protobuf==7.36.2 llguidance==1.9.1 \
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
    opentelemetry-instrumentation==0.66b2 opentelemetry-instrumentation-grpc==0.66b2 opentelemetry-proto==1.45.2 \
    opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2 \
    opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-prometheus==0.66b2 \
    opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2 \
    pyzmq==27.3.0 msgpack==1.2.4 msgspec==0.23.0
du -sh .whl
