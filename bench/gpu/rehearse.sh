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
# says so. A corrupt prebuilt is always rehearsed: its stage fails, the rest runs.
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
if [ "${1:-}" = --real-size ]; then
    exec bash "$ROOT/bench/gpu/rehearse_real_size.sh"
fi
VENV=${VENV:-$ROOT/bench/gpu/build/venv}
PREBUILT=${PREBUILT:-$ROOT/bench/gpu/build/prebuilt}
SCRATCH=${SCRATCH:-/tmp/tokenspout-gpu-rehearsal}
[ -x "$VENV/bin/python3" ] || { echo "no venv at $VENV: run bench/gpu/build_ext.sh first" >&2; exit 2; }
export PATH=$VENV/bin:$PATH
# What the machine's image holds beyond build_ext.sh's pins and tokenspout imports (attrs, wrapt, ...).
pip install --quiet --disable-pip-version-check -r bench/gpu/requirements-image.txt || exit 2
unset CUDA_HOME CPATH LIBRARY_PATH PYTHONPATH
export GPU_CHECK_SLOWDOWN=${GPU_CHECK_SLOWDOWN:-3}  # run.sh's limits are sized for the GPU machine's 16 cores
failures=0
rm -rf "${SCRATCH:?}" "$SCRATCH".*.log && mkdir -p "$SCRATCH"

make_prebuilt() {  # make_prebuilt DIR stand-in|corrupt: a prebuilt folder as build_ext.sh lays it out
    local dir=$1 include
    mkdir -p "$dir"
    if [ "$2" = corrupt ]; then
        head -c 65536 /dev/urandom >"$dir/exllamav2_ext.so"
    else
        include=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
        printf '%s\n' '#include <Python.h>' \
            'static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "exllamav2_ext", "a stand-in", -1, NULL};' \
            'PyMODINIT_FUNC PyInit_exllamav2_ext(void) { return PyModule_Create(&module); }' >"$dir/stand_in.c"
        gcc -shared -fPIC -I"$include" "$dir/stand_in.c" -o "$dir/exllamav2_ext.so" || return 1
    fi
    echo "sha256     $(sha256sum "$dir/exllamav2_ext.so" | cut -d' ' -f1)" >"$dir/build-info.txt"
    gzip -f "$dir/exllamav2_ext.so"
}
stand_in=""
if [ ! -f "$PREBUILT/exllamav2_ext.so.gz" ]; then
    make_prebuilt "$SCRATCH/stand-in" stand-in || exit 2
    export PREBUILT=$SCRATCH/stand-in
    stand_in="a STAND-IN for the extension (build_ext.sh has not built the real one)"
    echo "note: $stand_in"
fi
make_prebuilt "$SCRATCH/corrupt" corrupt
NO_GPU_STAGES="jit_build paged_smoke serve_gptq convert_exl2 paged_smoke_exl2 serve_exl2 serve_fp16 speculation"
CPU_STAGES="preflight wheels imports extension provider tiny_model model_check"

# rehearse NAME EXPECTED_RC "stage=STATUS ..." [VAR=value ...]: one run of run.sh and what it must report
rehearse() {
    local name=$1 expected_rc=$2 expectations=$3
    shift 3
    local out=$SCRATCH/$name/out work=$SCRATCH/$name/work rc problems=() expectation stage status got
    rm -rf "${SCRATCH:?}/$name"
    env "$@" OUT="$out" WORK="$work" bash bench/gpu/run.sh >"$SCRATCH.$name.log" 2>&1
    rc=$?
    [ "$rc" = "$expected_rc" ] || problems+=("exit $rc, expected $expected_rc")
    for expectation in $expectations; do
        stage=${expectation%%=*} status=${expectation#*=}
        got=$(awk -F'\t' -v s="$stage" '$1 == s {print $2}' "$work/report/stages.tsv" 2>/dev/null)
        [ "$got" = "$status" ] || problems+=("$stage ${got:-missing}, expected $status")
    done
    local files="run.log summary.txt gpu-report.tar.gz"
    [[ "$*" == *GPU_CHECK_FAIL=preflight* ]] || files+=" preflight.txt"  # a real preflight writes it first
    for file in $files; do
        [ -s "$out/$file" ] || problems+=("no $file in OUT")
    done
    [ "$(find "$out" -type f | wc -l)" -le 8 ] || problems+=("more than the 8 files a device run returns")
    tar -tzf "$out/gpu-report.tar.gz" report/stages.tsv report/summary.txt report/run.log >/dev/null 2>&1 ||
        problems+=("the archive lacks stages.tsv, summary.txt or run.log")
    grep -q "^result: " "$out/summary.txt" 2>/dev/null || problems+=("summary.txt has no result line")
    if [ ${#problems[@]} = 0 ]; then
        echo "PASS $name"
    else
        echo "FAIL $name: ${problems[*]} (log: $SCRATCH.$name.log)"
        failures=$((failures + 1))
    fi
}

all_ok="preflight=ok wheels=ok imports=ok extension=ok jit_build=SKIP provider=ok tiny_model=ok paged_smoke=SKIP"
all_ok+=" serve_gptq=SKIP convert_exl2=SKIP paged_smoke_exl2=SKIP serve_exl2=SKIP model_check=ok serve_fp16=SKIP speculation=SKIP"
echo "rehearsing bench/gpu/run.sh with $("$VENV/bin/python3" --version) from $VENV"
rehearse clean 0 "$all_ok"
grep -E "min_margin|bos_ok" "$SCRATCH/clean/work/report/model-check.json" 2>/dev/null | tr -d ' ,'

expect_after_failure() {  # the expectations when stage $1 fails: what needs it is skipped, the rest runs
    local failed=$1 expectation stage result=""
    for expectation in $all_ok; do
        stage=${expectation%%=*}
        case "$failed:$stage" in
            "$failed:$failed") result+=" $stage=FAIL" ;;
            wheels:imports | wheels:extension | wheels:provider | wheels:tiny_model | wheels:model_check | \
                extension:provider | tiny_model:model_check)
                result+=" $stage=SKIP" ;;
            *) result+=" $expectation" ;;
        esac
    done
    echo "$result"
}
for stage in $CPU_STAGES; do
    rehearse "fail-$stage" 1 "$(expect_after_failure "$stage")" GPU_CHECK_FAIL="$stage"
done
rehearse hang-tiny_model 1 "$(expect_after_failure tiny_model | sed 's/tiny_model=FAIL/tiny_model=TIMEOUT/')" GPU_CHECK_HANG=tiny_model
rehearse no-prebuilt 1 "$(expect_after_failure extension)" PREBUILT="$SCRATCH/none"
rehearse corrupt-prebuilt 1 "$(expect_after_failure extension)" PREBUILT="$SCRATCH/corrupt"
rehearse no-wheels 1 "$(expect_after_failure wheels)" WHEELS="$SCRATCH/none"
rehearse short-budget 1 "" GPU_CHECK_BUDGET_S=40 GPU_CHECK_SLOWDOWN=1  # the preflight runs, the wheels have too little left
grep -q "no time left" "$SCRATCH/short-budget/work/report/stages.tsv" ||
    { echo "FAIL short-budget: no stage was skipped for want of time"; failures=$((failures + 1)); }
echo "rehearsal: $failures failed (stages with no GPU: $NO_GPU_STAGES skipped throughout)${stand_in:+; with $stand_in}"
[ "$failures" = 0 ]
