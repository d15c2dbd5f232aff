#!/usr/bin/env bash
# Builds exllama's CUDA extension here, ahead of time, for the lent GPU machine, so the GPU check spends
# none of its 15 device minutes compiling: exllamav2's JIT build takes 3-4 of them there, and exllamav3
# 1.6.5's PyPI wheel holds only sources (177 .cu files) that it compiles on first import.
#
#   bash bench/gpu/build_ext.sh              # exllamav2: ~12 min on 2 cores -> bench/gpu/build/prebuilt/ (git ignores build/)
#   bash bench/gpu/build_ext.sh exl3         # exllamav3: longer -> the same folder
#   bash bench/gpu/build_ext.sh exl3 --venv  # only the venv (what rehearse.sh --exl3 needs; plain --venv: rehearse.sh's)
#
# That machine runs Python 3.12, torch 2.11.0+cu130 and nvcc 13.0; so does this build: a Python 3.12
# venv with the pins in requirements-build.txt (torch from PyPI is the CUDA 13.0 build, and its
# cuda-toolkit 13.0.2 brings nvcc 13.0.88 and the headers), no GPU needed; exl3 adds exllamav3 and what
# it imports beside. The compile is the package's own JIT build (the same sources and flags it would use
# there), for Hopper only (TORCH_CUDA_ARCH_LIST 9.0; exllamav3 reads no GPU when the list is set).
# preflight.py finds the CUDA root and headers and sets CUDA_HOME, CPATH and LIBRARY_PATH exactly as
# run.sh does for its fallback build there.
#
# Output: exllamav2_ext.so.gz (~14 MB; the .so is ~39 MiB, too much to carry beside the wheels) and
# build-info.txt (its sha256, the versions it was built with, the venv's pip freeze); for exl3
# exllamav3_ext.so.gz and build-info-exl3.txt.
# PYTHON312 names the interpreter if `python3.12` is not on PATH; BUILD moves the work folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=bench/gpu/common.sh
source bench/gpu/common.sh
case "$*" in
    "" | --venv) use_generation exl2 ;;
    exl2 | exl3 | "exl2 --venv" | "exl3 --venv") use_generation "$1" && shift ;;
    *) echo "usage: bash bench/gpu/build_ext.sh [exl2|exl3] [--venv]" >&2; exit 2 ;;
esac
ROOT=$PWD
BUILD=${BUILD:-$ROOT/bench/gpu/build}
VENV=$BUILD/venv
PREBUILT=$BUILD/prebuilt
EXLLAMAV2=exllamav2==0.3.2
EXLLAMAV3=(exllamav3==1.6.5 marisa-trie==1.4.1 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0
           typing-inspection==0.4.5)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TORCH_EXTENSIONS_DIR=$BUILD/torch_extensions

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
exl3_hash=$(echo "${EXLLAMAV3[*]}" | sha256sum | cut -c1-16)
if [ "$GEN" = exl3 ] && [ "$(cat "$VENV/.installed-exl3" 2>/dev/null)" != "$exl3_hash" ]; then
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps "${EXLLAMAV3[@]}"
    echo "$exl3_hash" >"$VENV/.installed-exl3"
fi
[ "${1:-}" = --venv ] && { stamp "venv ready: $VENV"; exit 0; }
export PATH=$VENV/bin:$PATH  # ninja, and python3 for the preflight
# The pinned nvcc from the venv, not whatever toolkit this machine has: the build must not depend on it.
CUDA_HOME=$(python3 -c 'import nvidia, pathlib; print(pathlib.Path(list(nvidia.__path__)[0]) / "cu13")')
export CUDA_HOME

stamp "preflight"
python3 bench/gpu/preflight.py --report "$BUILD/preflight-$GEN.txt" --env-file "$BUILD/cuda.env" --scratch "$BUILD/cuda-links"
# shellcheck disable=SC1091
source "$BUILD/cuda.env"

stamp "compiling $EXT for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST with $MAX_JOBS jobs (nice 19)"
find "$TORCH_EXTENSIONS_DIR" -name lock -type f -print -delete 2>/dev/null || true  # left by a killed build
started=$(date +%s)
# site-packages ahead of the working directory (the repository root), so nothing here shadows the package.
nice -n 19 python3 -c "
import importlib.util, pathlib, sys
spec = importlib.util.find_spec('$MODULE')
sys.path.insert(0, str(pathlib.Path(spec.origin).parent.parent))
import $MODULE.ext as e
print('built', e.$EXT.__file__)" 2>&1 | tee "$BUILD/build-$GEN.log"
so=$(find "$TORCH_EXTENSIONS_DIR" -name "$EXT*.so" | head -1)
[ -n "$so" ] || { echo "no $EXT.so was built" >&2; exit 1; }
seconds=$(($(date +%s) - started))

stamp "test-importing it alone, as run.sh does there"
check=$BUILD/import-check-$GEN
rm -rf "$check" && mkdir -p "$check" && cp "$so" "$check/$EXT.so"
PYTHONPATH=$check python3 -c "import torch, $EXT; print('imports:', $EXT.__file__)"

mkdir -p "$PREBUILT"
gzip -c "$so" >"$PREBUILT/$EXT.so.gz.tmp" && mv "$PREBUILT/$EXT.so.gz.tmp" "$PREBUILT/$EXT.so.gz"
{
    echo "built      $(date -u '+%F %T') UTC on $(uname -m), $(nproc) cores, ${seconds}s"
    echo "sha256     $(sha256sum "$so" | cut -d' ' -f1)"
    echo "size       $(stat -c %s "$so") bytes ($(stat -c %s "$PREBUILT/$EXT.so.gz") gzipped)"
    echo "arch       TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
    python3 -c "import sys, torch; print('python    ', sys.version.split()[0]); print('torch     ', torch.__version__, 'CUDA', torch.version.cuda, 'CXX11 ABI', int(torch._C._GLIBCXX_USE_CXX11_ABI))"
    echo "$MODULE  $(pip show "$MODULE" 2>/dev/null | sed -n 's/^Version: //p')"
    echo "nvcc       $(nvcc --version | grep release)"
    echo "gcc        $(gcc --version | head -1)"
    echo "CUDA_HOME  $CUDA_HOME"
    echo "--- pip freeze"
    pip freeze --disable-pip-version-check
} >"$PREBUILT/$INFO"
sed '/^--- pip freeze/q' "$PREBUILT/$INFO"
stamp "done: $PREBUILT (carry it with .whl)"
