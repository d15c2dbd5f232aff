#!/usr/bin/env bash
# bench/gpu/rehearse.sh --real-size: run.sh's real-size plan on the CPU, with the tiny shape and stand-ins
# (see rehearse.sh), so the one device call cannot fail on a typo. tests/bench/test_gpu_check.py runs it.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD
# shellcheck source=bench/gpu/common.sh
source bench/gpu/common.sh
use_generation exl2
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
SCRATCH=${SCRATCH:-/tmp/tokenspout-real-size-rehearsal}
rm -rf "${SCRATCH:?}" && mkdir -p "$SCRATCH/wheels" "$SCRATCH/prebuilt"
failures=0

# A wheel and an extension to install and test-import where the real run has exllamav2's.
"$PYTHON" - "$SCRATCH/wheels" <<'PY' || exit 2
import pathlib, sys, zipfile
name, info = "tokenspout_rehearsal_stand_in", "tokenspout_rehearsal_stand_in-0.0.0.dist-info"
files = {f"{name}/__init__.py": "", f"{info}/METADATA": "Metadata-Version: 2.1\nName: tokenspout-rehearsal-stand-in\nVersion: 0.0.0\n",
         f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: rehearse\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
with zipfile.ZipFile(pathlib.Path(sys.argv[1]) / f"{name}-0.0.0-py3-none-any.whl", "w") as wheel:
    for path, text in files.items():
        wheel.writestr(path, text)
PY
make_prebuilt "$SCRATCH/prebuilt" stand-in || exit 2

FORMATS="exl2 gptq fp16"
REHEARSAL_ENV=(GPU_CHECK_PLAN=real-size GPU_CHECK_STAND_INS="$ROOT/tests/harness/stand_ins" PYTHON="$PYTHON"
    WHEELS="$SCRATCH/wheels" PREBUILT="$SCRATCH/prebuilt" MODELS="$SCRATCH/models"
    GPU_CHECK_SKIP=preflight REAL_SIZE_SHAPE=tiny REAL_SIZE_PROBE="--probe-mib 16 --probe-reps 2"
    REAL_SIZE_ARGS="--streams 1,4 --tokens 8 --reps 1 --warmup-steps 3 --cache-tokens 2048 --attention-calls 0"
    GPU_CHECK_BUDGET_S=600 GPU_CHECK_SLOWDOWN=2)
rehearse_checks() {  # rehearse_checks OUT EXPECTATIONS: the plan's lines in summary.txt, and no model left behind
    local format
    for format in $FORMATS; do
        [[ "$2" == *"model_$format=ok"* ]] || continue
        grep -q "^$format: " "$1/summary.txt" 2>/dev/null || problems+=("no $format line in summary.txt")
    done
    grep -q "^real size: copy bandwidth [0-9]" "$1/summary.txt" 2>/dev/null || problems+=("no bandwidth in summary.txt")
    [ -e "$SCRATCH/models" ] && problems+=("the models were left behind")
}

all_ok="preflight=SKIP wheels=ok imports=ok extension=ok jit_build=SKIP provider=ok bandwidth=ok"
for format in $FORMATS; do all_ok+=" model_$format=ok direct_$format=ok grpc_$format=ok"; done
echo "rehearsing bench/gpu/run.sh's real-size plan with $("$PYTHON" --version) and stand-ins"
rehearse clean 0 "$all_ok"
grep -A12 "^real size" "$SCRATCH/clean/out/summary.txt"
# A failed stage: the next one still runs (GPTQ and FP16 left out: the clean run proved them).
rehearse fail-direct_exl2 1 "preflight=SKIP provider=ok model_exl2=ok direct_exl2=FAIL grpc_exl2=ok model_fp16=SKIP" \
    GPU_CHECK_FAIL=direct_exl2 GPU_CHECK_SKIP=preflight,model_gptq,direct_gptq,grpc_gptq,model_fp16,direct_fp16,grpc_fp16
echo "real-size rehearsal: $failures failed"
[ "$failures" = 0 ]
