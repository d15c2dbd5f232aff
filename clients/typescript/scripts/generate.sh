#!/usr/bin/env bash
# Regenerates src/gen from protos/ and from google.rpc's error_details.proto,
# which the Python package googleapis-common-protos ships (PYTHON names a
# Python that has it; the repository's venv by default).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-../../.venv/bin/python}
rm -rf src/gen
node_modules/.bin/buf generate ../../protos --template buf.gen.yaml
rpc_dir=$("$PYTHON" -c 'import pathlib, google.rpc.error_details_pb2 as m; print(pathlib.Path(m.__file__).parent)')
third_party=$(mktemp -d)
trap 'rm -rf "$third_party"' EXIT
mkdir -p "$third_party/google/rpc"
cp "$rpc_dir/error_details.proto" "$third_party/google/rpc/"
node_modules/.bin/buf generate "$third_party" --template buf.gen.yaml
