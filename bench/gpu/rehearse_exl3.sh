#!/usr/bin/env bash
# The exllamav3 variant of the GPU check rehearsed here, on the CPU, as rehearse.sh does exllamav2's: run.sh
# with GPU_CHECK_PLAN=exl3 in the lent machine's Python 3.12 environment, its stages that need no GPU
# for real, then once more with each of them failing or hanging on purpose, to prove that every failure is
# caught, reported and packed, and the stages after it still run.
#
#   bash bench/gpu/fetch_wheels.sh && bash bench/gpu/build_ext_exl3.sh --venv   # first: the wheels and the venv
#   bash bench/gpu/rehearse_exl3.sh
#
# Real: the preflight, the wheel install, the imports (tokenspout's exllamav3 engine, check.py), exllamav3
# itself imported over the prebuilt extension (a CUDA torch imports without a GPU), tiny_llama.py, exllamav3's
# own classes taking what the binding gives them (binding_exl3.py), the report and the archive. Until build_ext_exl3.sh has built the real extension, a stand-in (an empty C module of
# that name, built in a second) takes its place; the last line says so.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD
VENV=${VENV:-$ROOT/bench/gpu/build/venv}
PREBUILT=${PREBUILT:-$ROOT/bench/gpu/build/prebuilt}
SCRATCH=${SCRATCH:-/tmp/tokenspout-gpu-rehearsal-exl3}
[ -x "$VENV/bin/python3" ] || { echo "no venv at $VENV: run bench/gpu/build_ext_exl3.sh --venv first" >&2; exit 2; }
export PATH=$VENV/bin:$PATH GPU_CHECK_PLAN=exl3
pip install --quiet --disable-pip-version-check -r bench/gpu/requirements-image.txt || exit 2
unset CUDA_HOME CPATH LIBRARY_PATH PYTHONPATH
export GPU_CHECK_SLOWDOWN=${GPU_CHECK_SLOWDOWN:-3}  # run.sh's limits are sized for the GPU machine's 16 cores
failures=0
rm -rf "${SCRATCH:?}" "$SCRATCH".*.log && mkdir -p "$SCRATCH"

make_prebuilt() {  # make_prebuilt DIR stand-in|corrupt: a prebuilt folder as build_ext_exl3.sh lays it out
    local dir=$1 include
    mkdir -p "$dir"
    if [ "$2" = corrupt ]; then
        head -c 65536 /dev/urandom >"$dir/exllamav3_ext.so"
    else
        # exllamav3's modules take functions from the extension as they import (moe_batch_recon: ext.silu_mul):
        # every name of the stand-in is a function that does nothing.
        include=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
        cat >"$dir/stand_in.c" <<'C'
#include <Python.h>
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "exllamav3_ext", "a stand-in", -1, NULL};
PyMODINIT_FUNC PyInit_exllamav3_ext(void) {
    PyObject *m = PyModule_Create(&module), *d, *r;
    if (!m) return NULL;
    d = PyModule_GetDict(m);
    PyDict_SetItemString(d, "__builtins__", PyEval_GetBuiltins());
    r = PyRun_String("def __getattr__(name):\n    if name.startswith('__'):\n        raise AttributeError(name)\n"
                     "    return lambda *args, **kwargs: None\n", Py_file_input, d, d);
    if (!r) return NULL;
    Py_DECREF(r);
    return m;
}
C
        gcc -shared -fPIC -I"$include" "$dir/stand_in.c" -o "$dir/exllamav3_ext.so" || return 1
    fi
    echo "sha256     $(sha256sum "$dir/exllamav3_ext.so" | cut -d' ' -f1)" >"$dir/build-info-exl3.txt"
    gzip -f "$dir/exllamav3_ext.so"
}
stand_in=""
if [ ! -f "$PREBUILT/exllamav3_ext.so.gz" ]; then
    make_prebuilt "$SCRATCH/stand-in" stand-in || exit 2
    export PREBUILT=$SCRATCH/stand-in
    stand_in="a STAND-IN for the extension (build_ext_exl3.sh has not built the real one)"
    echo "note: $stand_in"
fi
make_prebuilt "$SCRATCH/corrupt" corrupt
CPU_STAGES="preflight wheels imports_exl3 extension_exl3 tiny_model binding_exl3"

# rehearse NAME EXPECTED_RC "stage=STATUS ..." [VAR=value ...]: one run of run.sh and what it must report
rehearse() {
    local name=$1 expected_rc=$2 expectations=$3
    shift 3
    local out=$SCRATCH/$name/out work=$SCRATCH/$name/work rc problems=() expectation stage got
    env "$@" OUT="$out" WORK="$work" bash bench/gpu/run.sh >"$SCRATCH.$name.log" 2>&1
    rc=$?
    [ "$rc" = "$expected_rc" ] || problems+=("exit $rc, expected $expected_rc")
    for expectation in $expectations; do
        stage=${expectation%%=*}
        got=$(awk -F'\t' -v s="$stage" '$1 == s {print $2}' "$work/report/stages.tsv" 2>/dev/null)
        [ "$got" = "${expectation#*=}" ] || problems+=("$stage ${got:-missing}, expected ${expectation#*=}")
    done
    for file in run.log summary.txt gpu-report.tar.gz; do
        [ -s "$out/$file" ] || problems+=("no $file in OUT")
    done
    grep -q "^result: " "$out/summary.txt" 2>/dev/null || problems+=("summary.txt has no result line")
    if [ ${#problems[@]} = 0 ]; then
        echo "PASS $name"
    else
        echo "FAIL $name: ${problems[*]} (log: $SCRATCH.$name.log)"
        failures=$((failures + 1))
    fi
}

all_ok="preflight=ok wheels=ok imports_exl3=ok extension_exl3=ok jit_build_exl3=SKIP tiny_model=ok binding_exl3=ok"
all_ok+=" serve_fp16_exl3=SKIP convert_exl3=SKIP serve_exl3=SKIP speculation_exl3=SKIP"
echo "rehearsing GPU_CHECK_PLAN=exl3 bench/gpu/run.sh with $(python3 --version) from $VENV"
rehearse clean 0 "$all_ok"

expect_after_failure() {  # the expectations when stage $1 fails: what needs it is skipped, the rest runs
    local failed=$1 expectation stage result=""
    for expectation in $all_ok; do
        stage=${expectation%%=*}
        case "$failed:$stage" in
            "$failed:$failed") result+=" $stage=FAIL" ;;
            wheels:imports_exl3 | wheels:extension_exl3 | wheels:tiny_model | wheels:binding_exl3 | \
                extension_exl3:binding_exl3 | tiny_model:binding_exl3) result+=" $stage=SKIP" ;;
            *) result+=" $expectation" ;;
        esac
    done
    echo "$result"
}
for stage in $CPU_STAGES; do
    rehearse "fail-$stage" 1 "$(expect_after_failure "$stage")" GPU_CHECK_FAIL="$stage"
done
rehearse hang-tiny_model 1 "$(expect_after_failure tiny_model | sed 's/tiny_model=FAIL/tiny_model=TIMEOUT/')" GPU_CHECK_HANG=tiny_model
rehearse corrupt-prebuilt 1 "$(expect_after_failure extension_exl3)" PREBUILT="$SCRATCH/corrupt"
rehearse no-wheels 1 "$(expect_after_failure wheels)" WHEELS="$SCRATCH/none"
echo "rehearsal: $failures failed (stages with no GPU skipped throughout)${stand_in:+; with $stand_in}"
[ "$failures" = 0 ]
