# What the GPU check's scripts share, sourced by each from the repository root: the names that differ
# between the exllama generations, the prebuilt extension as build_ext.sh lays it out, and the rehearsals'
# run of run.sh with what every run must report.
# shellcheck shell=bash

stamp() { echo "[$(date -u +%T)] $*"; }

# use_generation exl2|exl3: the package MODULE, its extension EXT and build-info file INFO, the SUFFIX of the
# GPU check's stages that differ (imports_exl3) and the PREFIX of its check reports (check-exl3-fp16.json)
use_generation() {
    case $1 in
        exl2) MODULE=exllamav2 EXT=exllamav2_ext INFO=build-info.txt SUFFIX="" PREFIX="" ;;
        exl3) MODULE=exllamav3 EXT=exllamav3_ext INFO=build-info-exl3.txt SUFFIX=_exl3 PREFIX=exl3- ;;
        *) echo "no exllama generation '$1' (exl2 or exl3)" >&2; return 2 ;;
    esac
    GEN=$1
}

make_prebuilt() {  # make_prebuilt DIR stand-in|corrupt: a prebuilt $EXT folder as build_ext.sh lays it out
    local dir=$1 include any_name=0
    mkdir -p "$dir"
    if [ "$2" = corrupt ]; then
        head -c 65536 /dev/urandom >"$dir/$EXT.so"
    else
        # An empty C module of that name, built in a second. exllamav3's modules take functions from it as
        # they import (moe_batch_recon: ext.silu_mul): for it every name is a function that does nothing.
        [ "$EXT" = exllamav3_ext ] && any_name=1
        include=$("${PYTHON:-python3}" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
        cat >"$dir/stand_in.c" <<C
#include <Python.h>
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "$EXT", "a stand-in", -1, NULL};
PyMODINIT_FUNC PyInit_$EXT(void) {
    PyObject *m = PyModule_Create(&module), *d, *r;
    if (!m || !$any_name) return m;
    d = PyModule_GetDict(m);
    PyDict_SetItemString(d, "__builtins__", PyEval_GetBuiltins());
    r = PyRun_String("def __getattr__(name):\n    if name.startswith('__'):\n        raise AttributeError(name)\n"
                     "    return lambda *args, **kwargs: None\n", Py_file_input, d, d);
    if (!r) return NULL;
    Py_DECREF(r);
    return m;
}
C
        gcc -shared -fPIC -I"$include" "$dir/stand_in.c" -o "$dir/$EXT.so" || return 1
    fi
    echo "sha256     $(sha256sum "$dir/$EXT.so" | cut -d' ' -f1)" >"$dir/$INFO"
    gzip -f "$dir/$EXT.so"
}

# rehearse NAME EXPECTED_RC "stage=STATUS ..." [VAR=value ...]: one run of run.sh under $SCRATCH/NAME, with
# REHEARSAL_ENV's settings, then these, and what it must report: its exit, each stage's status, and what
# every run leaves in OUT; rehearse_checks, where the caller defines it, adds its plan's own problems.
# Counts the runs that fail in $failures.
rehearse() {
    local name=$1 expected_rc=$2 expectations=$3
    shift 3
    local out=$SCRATCH/$name/out work=$SCRATCH/$name/work rc problems=() expectation stage got files file
    rm -rf "${SCRATCH:?}/$name"
    env "${REHEARSAL_ENV[@]}" "$@" OUT="$out" WORK="$work" bash bench/gpu/run.sh >"$SCRATCH/$name.log" 2>&1
    rc=$?
    [ "$rc" = "$expected_rc" ] || problems+=("exit $rc, expected $expected_rc")
    for expectation in $expectations; do
        stage=${expectation%%=*}
        got=$(awk -F'\t' -v s="$stage" '$1 == s {print $2}' "$work/report/stages.tsv" 2>/dev/null)
        [ "$got" = "${expectation#*=}" ] || problems+=("$stage ${got:-missing}, expected ${expectation#*=}")
    done
    files="run.log summary.txt gpu-report.tar.gz"
    grep -q $'^preflight\tok\t' "$work/report/stages.tsv" 2>/dev/null && files+=" preflight.txt"  # a preflight that ran wrote it
    for file in $files; do
        [ -s "$out/$file" ] || problems+=("no $file in OUT")
    done
    [ "$(find "$out" -type f | wc -l)" -le 8 ] || problems+=("more than the 8 files a device run returns")
    tar -tzf "$out/gpu-report.tar.gz" report/stages.tsv report/summary.txt report/run.log >/dev/null 2>&1 ||
        problems+=("the archive lacks stages.tsv, summary.txt or run.log")
    grep -q "^result: " "$out/summary.txt" 2>/dev/null || problems+=("summary.txt has no result line")
    if declare -F rehearse_checks >/dev/null; then rehearse_checks "$out" "$expectations"; fi  # appends to problems
    if [ ${#problems[@]} = 0 ]; then
        echo "PASS $name"
    else
        echo "FAIL $name: ${problems[*]} (log: $SCRATCH/$name.log)"
        failures=$((failures + 1))
    fi
}
