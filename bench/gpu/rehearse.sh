#!/usr/bin/env bash
# The GPU check rehearsed here, on the CPU, in an environment like the lent machine's: run.sh's
# stages that need no GPU for real, then once more with each of them failing or hanging on purpose,
# to prove that every failure is caught, reported and packed, and that the stages after it still run.
#
#   bash bench/gpu/fetch_wheels.sh && bash bench/gpu/build_ext.sh   # first: the wheels and the prebuilt
#   bash bench/gpu/rehearse.sh                                       # 11-16 min on 2 busy cores
#
# python3 is build_ext.sh's venv (Python 3.12 with torch 2.11.0+cu130, transformers 5.17.0 and the
# rest pinned as on that machine); the GPU stages are skipped, as run.sh does with no GPU. Real: the
# preflight, the wheel install, the imports and paged_smoke.py's self-check, the prebuilt extension's
# test import (a CUDA torch imports it without a GPU), exllamav2 imported through tokenspout's
# attention provider (paged on sdpa), tiny_llama.py, the model in transformers, the report and the archive.
# Until build_ext.sh has built the real extension, a stand-in (an empty C module of that name,
# built in a second) takes its place, so run.sh's prebuilt path is still rehearsed; the last line
# says so. A missing and a corrupt prebuilt are always rehearsed: its stage fails, the rest runs.
#
#   bash bench/gpu/build_ext.sh exl3 --venv && bash bench/gpu/rehearse.sh --exl3   # ~8 min
#
# --exl3 rehearses the exllamav3 variant (GPU_CHECK_PLAN=exl3) the same way. Real: the preflight, the wheel
# install, the imports (tokenspout's exllamav3 engine, check.py), exllamav3 itself imported over the prebuilt
# extension (build_ext.sh exl3's, or the stand-in), tiny_llama.py, exllamav3's own classes taking what the
# binding gives them (binding_exl3.py), the report and the archive.
#
#   bash bench/gpu/rehearse.sh --real-size                           # ~2 min, in the project's .venv
#
# --real-size rehearses the real-size plan (GPU_CHECK_PLAN=real-size, bench/gpu/README.md) with the tiny
# shape instead, in this project's own venv: a stand-in exllamav2 package (tests/harness/stand_ins: 0.3.2's
# attention detection, the model files checked, the provider called for every paged step, Triton's kernel
# in its interpreter), a stand-in wheel and extension, and the scripted engine behind `tokenspout serve`.
# Every stage runs and must pass, then once more with direct_exl2 failing: the stages after it still run.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD
case "$*" in
    --real-size) exec bash "$ROOT/bench/gpu/rehearse_real_size.sh" ;;
    --exl3) generation=exl3 ;;
    "") generation=exl2 ;;
    *) echo "usage: bash bench/gpu/rehearse.sh [--exl3 | --real-size]" >&2; exit 2 ;;
esac
# shellcheck source=bench/gpu/common.sh
source bench/gpu/common.sh
use_generation "$generation"
VENV=${VENV:-$ROOT/bench/gpu/build/venv}
PREBUILT=${PREBUILT:-$ROOT/bench/gpu/build/prebuilt}
SCRATCH=${SCRATCH:-/tmp/tokenspout-gpu-rehearsal-$GEN}
[ -x "$VENV/bin/python3" ] || { echo "no venv at $VENV: run bench/gpu/build_ext.sh $GEN --venv first" >&2; exit 2; }
export PATH=$VENV/bin:$PATH
[ "$GEN" = exl3 ] && export GPU_CHECK_PLAN=exl3
# What the machine's image holds beyond build_ext.sh's pins and tokenspout imports (attrs, wrapt, ...).
pip install --quiet --disable-pip-version-check -r bench/gpu/requirements-image.txt || exit 2
unset CUDA_HOME CPATH LIBRARY_PATH PYTHONPATH
export GPU_CHECK_SLOWDOWN=${GPU_CHECK_SLOWDOWN:-3}  # run.sh's limits are sized for the GPU machine's 16 cores
REHEARSAL_ENV=()
failures=0
rm -rf "${SCRATCH:?}" && mkdir -p "$SCRATCH"

stand_in=""
if [ ! -f "$PREBUILT/$EXT.so.gz" ]; then
    make_prebuilt "$SCRATCH/stand-in" stand-in || exit 2
    export PREBUILT=$SCRATCH/stand-in
    stand_in="a STAND-IN for the extension (build_ext.sh $GEN has not built the real one)"
    echo "note: $stand_in"
fi
make_prebuilt "$SCRATCH/corrupt" corrupt

# What a clean run reports here (ok: the stages that need no GPU), and the stages a failed one leaves
# skipped (FAILED:SKIPPED), in the plan's order.
if [ "$GEN" = exl2 ]; then
    all_ok="preflight=ok wheels=ok imports=ok extension=ok jit_build=SKIP provider=ok tiny_model=ok paged_smoke=SKIP"
    all_ok+=" serve_gptq=SKIP convert_exl2=SKIP paged_smoke_exl2=SKIP serve_exl2=SKIP model_check=ok serve_fp16=SKIP"
    all_ok+=" speculation=SKIP"
    skipped_after="wheels:imports wheels:extension wheels:provider wheels:tiny_model wheels:model_check"
    skipped_after+=" extension:provider tiny_model:model_check"
else
    all_ok="preflight=ok wheels=ok imports_exl3=ok extension_exl3=ok jit_build_exl3=SKIP tiny_model=ok binding_exl3=ok"
    all_ok+=" serve_fp16_exl3=SKIP convert_exl3=SKIP serve_exl3=SKIP speculation_exl3=SKIP"
    skipped_after="wheels:imports_exl3 wheels:extension_exl3 wheels:tiny_model wheels:binding_exl3"
    skipped_after+=" extension_exl3:binding_exl3 tiny_model:binding_exl3"
fi
expect_after_failure() {  # the expectations when stage $1 fails: what needs it is skipped, the rest runs
    local failed=$1 expectation stage result=""
    for expectation in $all_ok; do
        stage=${expectation%%=*}
        if [ "$stage" = "$failed" ]; then result+=" $stage=FAIL"
        elif [[ " $skipped_after " == *" $failed:$stage "* ]]; then result+=" $stage=SKIP"
        else result+=" $expectation"; fi
    done
    echo "$result"
}

echo "rehearsing ${GPU_CHECK_PLAN:+GPU_CHECK_PLAN=$GPU_CHECK_PLAN }bench/gpu/run.sh with $(python3 --version) from $VENV"
rehearse clean 0 "$all_ok"
[ "$GEN" = exl2 ] && grep -E "min_margin|bos_ok" "$SCRATCH/clean/work/report/model-check.json" 2>/dev/null | tr -d ' ,'
for expectation in $all_ok; do
    stage=${expectation%%=*}
    [ "${expectation#*=}" = ok ] && rehearse "fail-$stage" 1 "$(expect_after_failure "$stage")" GPU_CHECK_FAIL="$stage"
done
rehearse hang-tiny_model 1 "$(expect_after_failure tiny_model | sed 's/tiny_model=FAIL/tiny_model=TIMEOUT/')" GPU_CHECK_HANG=tiny_model
rehearse no-prebuilt 1 "$(expect_after_failure "extension$SUFFIX")" PREBUILT="$SCRATCH/none"
rehearse corrupt-prebuilt 1 "$(expect_after_failure "extension$SUFFIX")" PREBUILT="$SCRATCH/corrupt"
rehearse no-wheels 1 "$(expect_after_failure wheels)" WHEELS="$SCRATCH/none"
rehearse short-budget 1 "" GPU_CHECK_BUDGET_S=40 GPU_CHECK_SLOWDOWN=1  # the preflight runs, the wheels have too little left
grep -q "no time left" "$SCRATCH/short-budget/work/report/stages.tsv" ||
    { echo "FAIL short-budget: no stage was skipped for want of time"; failures=$((failures + 1)); }
no_gpu=$(for expectation in $all_ok; do [ "${expectation#*=}" = SKIP ] && printf ' %s' "${expectation%%=*}"; done)
echo "rehearsal: $failures failed (stages with no GPU:$no_gpu skipped throughout)${stand_in:+; with $stand_in}"
[ "$failures" = 0 ]
