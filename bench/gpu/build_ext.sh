#!/usr/bin/env bash
# Builds exllamav2's CUDA extension here, ahead of time, for the lent GPU machine, so the GPU check
# spends none of its 15 device minutes compiling (the JIT build there takes 3-4 of them).
#
#   bash bench/gpu/build_ext.sh      # ~12 min on 2 cores; -> bench/gpu/build/prebuilt/ (git ignores build/)
#
# That machine runs Python 3.12, torch 2.11.0+cu130 and nvcc 13.0; so does this build: a Python 3.12
# venv with the pins in requirements-build.txt (torch from PyPI is the CUDA 13.0 build, and its
# cuda-toolkit 13.0.2 brings nvcc 13.0.88 and the headers), no GPU needed. The compile is exllamav2's
# own JIT build (the same sources and flags it would use there), for Hopper only (TORCH_CUDA_ARCH_LIST
# 9.0). preflight.py finds the CUDA root and headers and sets CUDA_HOME, CPATH and LIBRARY_PATH
# exactly as run.sh does for its fallback build there.
#
# Output: exllamav2_ext.so.gz (~14 MB; the .so is ~39 MiB, too much to carry beside the wheels) and
# build-info.txt (its sha256, the versions it was built with, the venv's pip freeze).
# PYTHON312 names the interpreter if `python3.12` is not on PATH; BUILD moves the work folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD=${BUILD:-$ROOT/bench/gpu/build}
VENV=$BUILD/venv
PREBUILT=$BUILD/prebuilt
EXLLAMAV2=exllamav2==0.3.2
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TORCH_EXTENSIONS_DIR=$BUILD/torch_extensions
stamp() { echo "[$(date -u +%T)] $*"; }

find_python312() {  # the first candidate that really is 3.12 (a pyenv shim can exist and refuse)
    local candidate
    for candidate in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 \
        /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
        [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null &&
            { command -v "$candidate"; return 0; }
    done
    return 1
}

mkdir -p "$BUILD"
requirements_hash=$(cat bench/gpu/requirements-build.txt <(echo "$EXLLAMAV2") | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.installed" 2>/dev/null)" != "$requirements_hash" ]; then
    python312=$(find_python312) || { echo "no Python 3.12 here (set PYTHON312)" >&2; exit 1; }
    stamp "venv with $("$python312" --version) and the lent machine's pins (torch with CUDA 13: ~4 GB of wheels)"
    rm -rf "$VENV"
    "$python312" -m venv "$VENV"
    nice -n 19 "$VENV/bin/pip" install --quiet --disable-pip-version-check -r bench/gpu/requirements-build.txt
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps "$EXLLAMAV2"
    echo "$requirements_hash" >"$VENV/.installed"
fi
export PATH=$VENV/bin:$PATH  # ninja, and python3 for the preflight
# The pinned nvcc from the venv, not whatever toolkit this machine has: the build must not depend on it.
CUDA_HOME=$(python3 -c 'import nvidia, pathlib; print(pathlib.Path(list(nvidia.__path__)[0]) / "cu13")')
export CUDA_HOME

stamp "preflight"
python3 bench/gpu/preflight.py --report "$BUILD/preflight.txt" --env-file "$BUILD/cuda.env" --scratch "$BUILD/cuda-links"
# shellcheck disable=SC1091
source "$BUILD/cuda.env"

stamp "compiling exllamav2_ext for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST with $MAX_JOBS jobs (nice 19)"
find "$TORCH_EXTENSIONS_DIR" -name lock -type f -print -delete 2>/dev/null || true  # left by a killed build
started=$(date +%s)
nice -n 19 python3 -c "import exllamav2.ext as e; print('built', e.exllamav2_ext.__file__)" 2>&1 | tee "$BUILD/build.log"
so=$(find "$TORCH_EXTENSIONS_DIR" -name exllamav2_ext.so | head -1)
[ -n "$so" ] || { echo "no exllamav2_ext.so was built" >&2; exit 1; }
seconds=$(($(date +%s) - started))

stamp "test-importing it alone, as run.sh does there"
check=$BUILD/import-check
rm -rf "$check" && mkdir -p "$check" && cp "$so" "$check/"
PYTHONPATH=$check python3 -c "import torch, exllamav2_ext; print('imports:', exllamav2_ext.__file__)"

mkdir -p "$PREBUILT"
gzip -c "$so" >"$PREBUILT/exllamav2_ext.so.gz.tmp" && mv "$PREBUILT/exllamav2_ext.so.gz.tmp" "$PREBUILT/exllamav2_ext.so.gz"
{
    echo "built      $(date -u '+%F %T') UTC on $(uname -m), $(nproc) cores, ${seconds}s"
    echo "sha256     $(sha256sum "$so" | cut -d' ' -f1)"
    echo "size       $(stat -c %s "$so") bytes ($(stat -c %s "$PREBUILT/exllamav2_ext.so.gz") gzipped)"
    echo "arch       TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
    python3 -c "import sys, torch, exllamav2; print('python    ', sys.version.split()[0]); print('torch     ', torch.__version__, 'CUDA', torch.version.cuda, 'CXX11 ABI', int(torch._C._GLIBCXX_USE_CXX11_ABI)); print('exllamav2 ', exllamav2.__version__)"
    echo "nvcc       $(nvcc --version | grep release)"
    echo "gcc        $(gcc --version | head -1)"
    echo "CUDA_HOME  $CUDA_HOME"
    echo "--- pip freeze"
    pip freeze --disable-pip-version-check
} >"$PREBUILT/build-info.txt"
cat "$PREBUILT/build-info.txt" | head -9
stamp "done: $PREBUILT (carry it with .whl)"
