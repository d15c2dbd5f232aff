#!/usr/bin/env bash
# Unpacks exllamav2 0.3.2's and exllamav3 1.6.5's PyPI wheels (pure Python: their source; nothing is
# installed or imported) under ~/.cache/tokenspout/sources/, where the signature tests read them
# (tests/backend/exllamav2/test_signatures.py, tests/backend/exllamav3/test_signatures.py): the
# keyword arguments the engines give those libraries are checked against the libraries' own source.
#
#   bash tools/exllama_sources.sh      # ~4 MB from PyPI, once per machine
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
SOURCES=${SOURCES:-$HOME/.cache/tokenspout/sources}
mkdir -p "$SOURCES"
for pin in exllamav2==0.3.2 exllamav3==1.6.5; do
    name=${pin%%==*} version=${pin##*==}
    target=$SOURCES/$name-$version
    [ -f "$target/$name/version.py" ] && continue
    download=$(mktemp -d)
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$download" "$pin"
    rm -rf "$target" && mkdir -p "$target"
    "$PYTHON" -m zipfile -e "$download"/*.whl "$target"
    rm -rf "$download"
    grep -q "\"$version\"" "$target/$name/version.py" || { echo "$target holds no $pin" >&2; exit 1; }
    echo "$pin unpacked into $target"
done
