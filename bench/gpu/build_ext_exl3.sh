#!/usr/bin/env bash
# Builds exllamav3's CUDA extension here, ahead of time, for the lent GPU machine, as build_ext.sh does
# exllamav2's: exllamav3 1.6.5's PyPI wheel holds only sources (177 .cu files) and compiles them on first
# import, which would take most of the device minutes there.
#
#   bash bench/gpu/build_ext_exl3.sh           # long on 2 cores; -> bench/gpu/build/prebuilt/exllamav3_ext.so.gz
#   bash bench/gpu/build_ext_exl3.sh --venv    # only the venv (what rehearse_exl3.sh needs)
#
# The venv is build_ext.sh's (Python 3.12, torch 2.11.0+cu130 with its nvcc 13.0 and Triton 3.6.0, as on
# the lent machine), made the same way if it is not there yet, with exllamav3 and what it imports beside.
# The compile is exllamav3's own JIT build (its ext.py: the same sources and flags it would use there),
# for Hopper only (TORCH_CUDA_ARCH_LIST 9.0; exllamav3 reads no GPU when the list is set).
# Output: exllamav3_ext.so.gz and build-info-exl3.txt (its sha256, the versions it was built with).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD=${BUILD:-$ROOT/bench/gpu/build}
VENV=$BUILD/venv
PREBUILT=$BUILD/prebuilt
EXLLAMAV2=exllamav2==0.3.2  # build_ext.sh's pin: the venv's marker counts it
EXLLAMAV3=(exllamav3==1.6.5 marisa-trie==1.4.1 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0
           typing-inspection==0.4.5)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TORCH_EXTENSIONS_DIR=$BUILD/torch_extensions
stamp() { echo "[$(date -u +%T)] $*"; }

find_python312() {  # as build_ext.sh: the first candidate that really is 3.12 (a pyenv shim can exist and refuse)
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
    stamp "no build venv yet: build_ext.sh's, made the same way (torch with CUDA 13: ~4 GB of wheels)"
    python312=$(find_python312) || { echo "no Python 3.12 here (set PYTHON312)" >&2; exit 1; }
    rm -rf "$VENV"
    "$python312" -m venv "$VENV"
    nice -n 19 "$VENV/bin/pip" install --quiet --disable-pip-version-check -r bench/gpu/requirements-build.txt
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps "$EXLLAMAV2"
    echo "$requirements_hash" >"$VENV/.installed"
fi
exl3_hash=$(echo "${EXLLAMAV3[*]}" | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.installed-exl3" 2>/dev/null)" != "$exl3_hash" ]; then
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps "${EXLLAMAV3[@]}"
    echo "$exl3_hash" >"$VENV/.installed-exl3"
fi
[ "${1:-}" = --venv ] && { stamp "venv ready: $VENV"; exit 0; }
export PATH=$VENV/bin:$PATH
CUDA_HOME=$(python3 -c 'import nvidia, pathlib; print(pathlib.Path(list(nvidia.__path__)[0]) / "cu13")')
export CUDA_HOME
python3 bench/gpu/preflight.py --report "$BUILD/preflight-exl3.txt" --env-file "$BUILD/cuda.env" --scratch "$BUILD/cuda-links"
# shellcheck disable=SC1091
source "$BUILD/cuda.env"

stamp "compiling exllamav3_ext for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST with $MAX_JOBS jobs (nice 19)"
find "$TORCH_EXTENSIONS_DIR" -name lock -type f -print -delete 2>/dev/null || true  # left by a killed build
started=$(date +%s)
# exllamav3.ext alone: the package's __init__ would also touch the CUDA allocator, which needs no GPU but
# gains nothing here.
nice -n 19 python3 -c "
import importlib.util, pathlib, sys
spec = importlib.util.find_spec('exllamav3')
sys.path.insert(0, str(pathlib.Path(spec.origin).parent.parent))
import exllamav3.ext as e
print('built', e.exllamav3_ext.__file__)" 2>&1 | tee "$BUILD/build-exl3.log"
so=$(find "$TORCH_EXTENSIONS_DIR" -name 'exllamav3_ext*.so' | head -1)
[ -n "$so" ] || { echo "no exllamav3_ext.so was built" >&2; exit 1; }
seconds=$(($(date +%s) - started))

stamp "test-importing it alone, as run.sh does there"
check=$BUILD/import-check-exl3
rm -rf "$check" && mkdir -p "$check" && cp "$so" "$check/exllamav3_ext.so"
PYTHONPATH=$check python3 -c "import torch, exllamav3_ext; print('imports:', exllamav3_ext.__file__)"

mkdir -p "$PREBUILT"
gzip -c "$so" >"$PREBUILT/exllamav3_ext.so.gz.tmp" && mv "$PREBUILT/exllamav3_ext.so.gz.tmp" "$PREBUILT/exllamav3_ext.so.gz"
{
    echo "built      $(date -u '+%F %T') UTC on $(uname -m), $(nproc) cores, ${seconds}s"
    echo "sha256     $(sha256sum "$so" | cut -d' ' -f1)"
    echo "size       $(stat -c %s "$so") bytes ($(stat -c %s "$PREBUILT/exllamav3_ext.so.gz") gzipped)"
    echo "arch       TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
    python3 -c "import sys, torch; print('python    ', sys.version.split()[0]); print('torch     ', torch.__version__, 'CUDA', torch.version.cuda, 'CXX11 ABI', int(torch._C._GLIBCXX_USE_CXX11_ABI))"
    echo "exllamav3  $("$VENV/bin/pip" show exllamav3 2>/dev/null | sed -n 's/^Version: //p')"
    echo "nvcc       $(nvcc --version | grep release)"
    echo "gcc        $(gcc --version | head -1)"
} >"$PREBUILT/build-info-exl3.txt"
head -8 "$PREBUILT/build-info-exl3.txt"
stamp "done: $PREBUILT (carry it with .whl)"
