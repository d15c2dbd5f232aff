#!/usr/bin/env bash
# The exllamav2 engine on a GPU, end to end, from this repository and what it carries, in at most 330 s.
#
#   here:  bash bench/gpu/fetch_wheels.sh    # wheels for Python 3.12 into .whl/ (git ignores it)
#          bash bench/gpu/build_ext.sh       # exllamav2's extension, prebuilt, into bench/gpu/build/prebuilt/
#   there: bash bench/gpu/run.sh             # carry .whl and bench/gpu/build/prebuilt
#
# Stages, each under its own limit (`timeout -k`), each failure caught and reported, never fatal,
# the most important proof first (a run cut short still has it):
#   preflight        versions (Python, gcc, nvcc, torch, driver) first, then the CUDA root and headers
#   wheels           the carried wheels into $WORK/site
#   imports          tokenspout's server, its attention provider and check.py import beside them;
#                    paged_smoke.py's self-check (seconds, not a failed server start)
#   extension        the prebuilt exllamav2_ext test-imported in a child process
#   jit_build        only if that failed: exllamav2's own JIT build (3-4 minutes on the H200)
#   provider         exllamav2 imported through backend.exllamav2.attention_provider (sdpa): paged
#                    mode on, the stand-in flash_attn gone after the import (no GPU needed)
#   tiny_model       a tiny random Llama: FP16 and GPTQ (bench/gpu/tiny_llama.py)
#   paged_smoke      FP16 and GPTQ in exllamav2's paged generator on tokenspout's SDPA paged attention
#                    against its own unpaged path: the same tokens, 5 jobs at once, batched attention
#                    calls, shared prefix pages (bench/gpu/paged_smoke.py)
#   serve_gptq       tokenspout serving GPTQ (default attention: auto, sdpa there), bench/gpu/check.py:
#                    the contract, concurrent streams batched, decode tok/s at 1/4/16 streams against
#                    exllamav2 driven directly
#   convert_exl2     EXL2 with exllamav2's converter
#   paged_smoke_exl2 the paged smoke on EXL2
#   serve_exl2       check.py on EXL2, only if the converter wrote the files
#   model_check      the FP16 files in transformers (CPU): one BOS, and a greedy margin FP16 cannot flip
#   serve_fp16       check.py on FP16, with transformers' greedy tokens as reference
#   speculation      the EXL2 model (FP16 if there is none) served with exllamav2's n-gram drafting and
#                    without: the same greedy output, drafts counted, decode tokens/s at 1 and 4 streams
# No flash_attn folder goes on PYTHONPATH: exllamav2 gets its paged attention only through
# attention_provider, and transformers (model_check, check.py's reference) runs in processes that
# never import exllamav2.
# $OUT (default bench/results/gpu) gets run.log (everything printed, as it happens), preflight.txt,
# summary.txt and gpu-report.tar.gz (every file written), the last two refreshed after each stage
# and once more on exit, so a run cut off from outside still leaves them.
#
# GPU_CHECK_PLAN=exl3 runs the exllamav3 variant instead (bench/gpu/stages_exl3.sh, 540 s budget): the same first
# stages on exllamav3 (imports_exl3, extension_exl3, jit_build_exl3), then its own.
# GPU_CHECK_PLAN=real-size runs the real-size plan instead (bench/gpu/README.md has the exact device call):
#   preflight, wheels, imports, extension (or jit_build), provider (attention triton: paged on) as above, then
#   bandwidth        a copy-bandwidth probe (bench/gpu/real_size.py)
#   model_FMT        an 8B-shaped model with random weights, FMT exl2, then gptq, then fp16 (make_random_model.py)
#   direct_FMT       its loading check, exllamav2's own unpaged forward at one stream, its generator driven
#                    directly at 1/16/64 streams on the Triton provider and on the SDPA one
#   grpc_FMT         tokenspout serving it (attention triton), the same streams through gRPC
#   each format's files removed before the next is written. REAL_SIZE_SHAPE (llama3-8b) and REAL_SIZE_ARGS
#   (real_size.py's flags) change what is measured; MODELS is where the models go (/dev/shm when it exists).
# GPU_CHECK_SKIP=stage[,stage] skips stages a first run already proved (a rerun's minutes go to the rest).
# For rehearsals: GPU_CHECK_FAIL=stage[,stage] makes those stages fail, GPU_CHECK_HANG=stage makes
# one hang until its limit kills it (a 3 s limit), GPU_CHECK_BUDGET_S changes the 330 s budget, and
# GPU_CHECK_SLOWDOWN=N multiplies it and every limit for a slower machine (the rehearsal on 2 busy cores).
# GPU_CHECK_STAND_INS=DIR (rehearse.sh --real-size): DIR's stand-in exllamav2 package goes first on the path,
# the GPU stages run with no GPU (Triton's interpreter for the kernel), and the gRPC stages serve the
# scripted engine (tests/harness/fake_engine.py) with the same flags.
set -uo pipefail  # no -e: a stage's failure is a finding, and the next stage runs
shopt -s nullglob
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=bench/gpu/common.sh
source bench/gpu/common.sh
ROOT=$PWD
PLAN=${GPU_CHECK_PLAN:-check}
if [ "$PLAN" = exl3 ]; then use_generation exl3; else use_generation exl2; fi
OUT=${OUT:-$ROOT/bench/results/gpu}
WORK=${WORK:-/tmp/tokenspout-gpu}
REPORT=$WORK/report
PREBUILT=${PREBUILT:-$ROOT/bench/gpu/build/prebuilt}
WHEELS=${WHEELS:-$ROOT/.whl}
PYTHON=${PYTHON:-python3}
SLOWDOWN=${GPU_CHECK_SLOWDOWN:-1}
default_budget_s=330
[ "$GEN" = exl3 ] && default_budget_s=540
BUDGET_S=$((${GPU_CHECK_BUDGET_S:-$default_budget_s} * SLOWDOWN))
PACK_RESERVE_S=15  # kept back from the budget for the summary and the archive
STARTED=$(date +%s)
DEADLINE=$((STARTED + BUDGET_S))
GPU_CHECK_FAIL=${GPU_CHECK_FAIL:-}
GPU_CHECK_HANG=${GPU_CHECK_HANG:-}
GPU_CHECK_SKIP=${GPU_CHECK_SKIP:-}
STAND_INS=${GPU_CHECK_STAND_INS:-}
REAL_SIZE_SHAPE=${REAL_SIZE_SHAPE:-llama3-8b}
REAL_SIZE_ARGS=${REAL_SIZE_ARGS:---streams 1,16,64 --tokens 128 --reps 2 --warmup-steps 240 --cache-tokens 32768}
if [ -z "${MODELS:-}" ]; then  # memory-backed when it can hold the largest (FP16: 16 GB), else the disk
    shm_free=$(df --output=avail -B1 /dev/shm 2>/dev/null | tail -1)
    if [ -w /dev/shm ] && [ "${shm_free:-0}" -gt 20000000000 ] 2>/dev/null; then
        MODELS=/dev/shm/tokenspout-models
    else
        MODELS=$WORK/models
    fi
fi

mkdir -p "$OUT"
rm -rf "$REPORT" "$WORK/model" "$WORK/exl2-work" "$WORK/ext" "$WORK/site" "$WORK/cuda.env"  # torch_extensions stays
mkdir -p "$REPORT" "$WORK/ext"
rm -f "$OUT/run.log" "$OUT/summary.txt" "$OUT/preflight.txt" "$OUT/gpu-report.tar.gz"
exec > >(tee -a "$OUT/run.log") 2>&1
TEE_PID=$!

export ROOT OUT WORK REPORT PREBUILT WHEELS PYTHON PYTHONUNBUFFERED=1 MODELS REAL_SIZE_SHAPE REAL_SIZE_ARGS STAND_INS
export GEN MODULE EXT INFO SUFFIX PREFIX
export PYTHONPATH="${STAND_INS:+$STAND_INS:}$WORK/ext:$WORK/site:$ROOT:$ROOT/clients/python${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=$WORK/torch_extensions TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if nvidia-smi -L >/dev/null 2>&1; then HAVE_GPU=1; else HAVE_GPU=0; fi
if [ -n "$STAND_INS" ]; then HAVE_GPU=1; export TRITON_INTERPRET=1; fi  # the rehearsal: stand-ins on the CPU
PROVIDER_SETTING=sdpa
[ "$PLAN" = real-size ] && PROVIDER_SETTING=triton
export HAVE_GPU PROVIDER_SETTING

# ---- the stages (each runs in a child bash under `timeout`; a nonzero exit is its failure) ----

stage_preflight() {
    "$PYTHON" bench/gpu/preflight.py --report "$OUT/preflight.txt" --env-file "$WORK/cuda.env" \
        --scratch "$WORK/cuda-links"
}

stage_wheels() {
    compgen -G "$WHEELS/*.whl" >/dev/null || { echo "no wheels in $WHEELS: run bench/gpu/fetch_wheels.sh here and carry .whl"; return 1; }
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$WHEELS"/*.whl &&
        installed=("$WORK"/site/*.dist-info) && printf '%s\n' "${installed[@]##*/}" &&
        echo "${#installed[@]} packages installed into $WORK/site"
}

stage_imports() {
    "$PYTHON" -c "
import service.cli, service.server, backend.exllamav2.engine, backend.exllamav2.attention_provider, bench.gpu.check
import bench.gpu.real_size, bench.gpu.make_random_model
print('tokenspout and check.py import; grpcio', __import__('grpc').__version__)" &&
        "$PYTHON" bench/gpu/paged_smoke.py --self-check
}

unpack_prebuilt() {  # the prebuilt $EXT into $WORK/ext, checked against its sha256 in $INFO, test-imported alone
    [ -f "$PREBUILT/$EXT.so.gz" ] || { echo "no prebuilt $EXT in $PREBUILT: run bench/gpu/build_ext.sh $GEN here and carry it"; return 1; }
    cat "$PREBUILT/$INFO" 2>/dev/null
    gunzip -c "$PREBUILT/$EXT.so.gz" >"$WORK/ext/$EXT.so" || return 1
    expected=$(sed -n 's/^sha256 *//p' "$PREBUILT/$INFO" 2>/dev/null)
    actual=$(sha256sum "$WORK/ext/$EXT.so" | cut -d' ' -f1)
    [ -z "$expected" ] || [ "$expected" = "$actual" ] || { echo "sha256 $actual, $INFO says $expected"; return 1; }
    "$PYTHON" -c "import torch, $EXT; print('prebuilt imports:', $EXT.__file__)"
}

stage_extension() {
    # exllamav2 imports exllamav2_ext if it can; an ImportError other than "undefined symbol"
    # leaves its loader broken, so the prebuilt is tried alone in a child first.
    unpack_prebuilt &&
        "$PYTHON" -c "import exllamav2.ext as e, exllamav2; assert not e.build_jit, 'exllamav2 would build'; print('exllamav2', exllamav2.__version__, 'uses it')"
}

stage_provider() {
    "$PYTHON" -c "
import sys
from backend.exllamav2.attention_provider import import_exllamav2
exllamav2, provider = import_exllamav2('$PROVIDER_SETTING')
import exllamav2.attn as attn
assert provider == '$PROVIDER_SETTING' and attn.has_flash_attn_with_paged, (provider, attn.has_flash_attn_with_paged)
assert 'flash_attn' not in sys.modules, 'the stand-in flash_attn outlived the import'
print('exllamav2', exllamav2.__version__, 'runs paged on', provider, '(the stand-in flash_attn gone after the import)')"
}

stage_jit_build() {  # $MODULE's own build of $EXT, when the prebuilt one failed
    # shellcheck disable=SC1091
    [ -f "$WORK/cuda.env" ] && source "$WORK/cuda.env"
    echo "CUDA_HOME=${CUDA_HOME:-unset} CPATH=${CPATH:-unset} TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS"
    find "$TORCH_EXTENSIONS_DIR" -name lock -type f -print -delete 2>/dev/null  # a killed build's lock waits forever
    "$PYTHON" -c "import $MODULE.ext as e; print('$MODULE built', e.$EXT.__file__)"
}

stage_tiny_model() {
    cal=$("$PYTHON" -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('exllamav2').origin).parent / 'conversion' / 'standard_cal_data')") || return 1
    "$PYTHON" bench/gpu/tiny_llama.py "$WORK/model" --text "$cal"/*.utf8
}

stage_model_check() {
    "$PYTHON" bench/gpu/model_check.py "$WORK/model/fp16" --json "$REPORT/model-check.json"
}

stage_paged_smoke() {
    "$PYTHON" bench/gpu/paged_smoke.py "$WORK/model/fp16" "$WORK/model/gptq" --json "$REPORT/smoke-fp16-gptq.json"
}
stage_paged_smoke_exl2() {
    "$PYTHON" bench/gpu/paged_smoke.py "$WORK/model/exl2" --json "$REPORT/smoke-exl2.json"
}

serve() {  # serve VARIANT [check.py flags]: check.py serving $WORK/model/VARIANT on $MODULE, in its stage's limit
    "$PYTHON" bench/gpu/check.py --engine "$MODULE" --model "$WORK/model/$1" --name "$PREFIX$1" \
        --json "$REPORT/check-$PREFIX$1.json" --time-limit "$STAGE_LIMIT" "${@:2}"
}
speculate() {  # speculate QUANT: the QUANT model (FP16 if there is none) with $MODULE's n-gram drafting and without
    local variant=fp16
    [ -f "$WORK/model/$1/config.json" ] && variant=$1
    "$PYTHON" bench/gpu/check.py --engine "$MODULE" --model "$WORK/model/$variant" --name "${PREFIX}speculation-$variant" \
        --speculation --json "$REPORT/check-${PREFIX}speculation.json" --time-limit "$STAGE_LIMIT"
}
stage_serve_fp16() { serve fp16 --reference-hf; }
stage_serve_gptq() { serve gptq; }
stage_serve_exl2() { serve exl2; }
stage_speculation() { speculate exl2; }

converted() {  # converted VARIANT: a converter exits 0 on some errors, so its output directory is the proof
    [ -f "$WORK/model/$1/config.json" ] && compgen -G "$WORK/model/$1/*.safetensors" >/dev/null ||
        { echo "the converter wrote no ${1^^} model"; return 1; }
}
stage_convert_exl2() {
    "$PYTHON" -m exllamav2.conversion.convert_exl2 -i "$WORK/model/fp16" -o "$WORK/exl2-work" -cf "$WORK/model/exl2" \
        -b 4.0 -hb 6 -l 512 -ml 512 -r 32 -mr 8 -nr
    converted exl2
}
# The real-size plan's stages (GPU_CHECK_PLAN=real-size); $REAL_SIZE_ARGS is split into flags on purpose.
stage_bandwidth() { "$PYTHON" bench/gpu/real_size.py bandwidth --json "$REPORT/real-bandwidth.json" ${REAL_SIZE_PROBE:-}; }
make_model() {
    rm -rf "${MODELS:?}"
    "$PYTHON" bench/gpu/make_random_model.py "$MODELS/$1" --format "$1" --shape "$REAL_SIZE_SHAPE"
}
measure() {  # measure direct|grpc FORMAT
    # shellcheck disable=SC2086
    "$PYTHON" bench/gpu/real_size.py "$1" "$MODELS/$2" --format "$2" --shape "$REAL_SIZE_SHAPE" \
        --json "$REPORT/real-$2-$1.json" --start-s $((STAGE_LIMIT - 30)) $REAL_SIZE_ARGS ${STAND_INS:+--fake-engine}
}
stage_model_exl2() { make_model exl2; }
stage_model_gptq() { make_model gptq; }
stage_model_fp16() { make_model fp16; }
stage_direct_exl2() { measure direct exl2; }
stage_direct_gptq() { measure direct gptq; }
stage_direct_fp16() { measure direct fp16; }
stage_grpc_exl2() { measure grpc exl2; }
stage_grpc_gptq() { measure grpc gptq; }
stage_grpc_fp16() { measure grpc fp16; }
export -f stage_bandwidth make_model measure stage_model_exl2 stage_model_gptq stage_model_fp16 stage_direct_exl2 \
    stage_direct_gptq stage_direct_fp16 stage_grpc_exl2 stage_grpc_gptq stage_grpc_fp16
export -f stage_preflight stage_wheels stage_imports unpack_prebuilt stage_extension stage_jit_build stage_provider \
    stage_tiny_model stage_paged_smoke stage_paged_smoke_exl2 stage_model_check serve speculate stage_serve_fp16 \
    stage_serve_gptq stage_serve_exl2 converted stage_convert_exl2 stage_speculation

# ---- running, recording, packing ----

declare -A STATUS=()

record() {  # record NAME STATUS SECONDS DETAIL
    STATUS[$1]=$2
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4//$'\t'/ }" >>"$REPORT/stages.tsv"
}

pack() {  # summary.txt and the archive, rewritten whole each time (a kill from outside keeps the last)
    {
        echo "tokenspout GPU check, $(date -u '+%F %T') UTC, ${BUDGET_S}s budget, $(($(date +%s) - STARTED))s so far"
        head -8 "$OUT/preflight.txt" 2>/dev/null
        echo
        "$PYTHON" bench/gpu/report.py "$REPORT/stages.tsv" "$REPORT"/smoke-*.json "$REPORT"/check-*.json \
            "$REPORT"/real-*.json 2>&1 ||
            python3 bench/gpu/report.py "$REPORT/stages.tsv" "$REPORT"/smoke-*.json "$REPORT"/check-*.json \
                "$REPORT"/real-*.json 2>&1
    } >"$OUT/summary.txt.tmp" 2>&1
    mv -f "$OUT/summary.txt.tmp" "$OUT/summary.txt"
    cp -f "$OUT/summary.txt" "$OUT/preflight.txt" "$REPORT/" 2>/dev/null
    cp -f "$OUT/run.log" "$REPORT/run.log" 2>/dev/null
    tar -czf "$OUT/gpu-report.tar.gz.tmp" -C "$WORK" report 2>/dev/null && mv -f "$OUT/gpu-report.tar.gz.tmp" "$OUT/gpu-report.tar.gz"
}

stage() {  # stage NAME LIMIT_S [NEEDS...]: run stage_NAME under its limit unless a stage it needs did not pass
    local name=$1 limit=$(($2 * SLOWDOWN)) need
    shift 2
    if [[ ",$GPU_CHECK_SKIP," == *",$name,"* ]]; then  # a rerun spends its minutes on what is left to prove
        record "$name" SKIP 0 "GPU_CHECK_SKIP"
        return 1
    fi
    for need in "$@"; do
        if [ "$need" = gpu ]; then
            [ "$HAVE_GPU" = 1 ] || { record "$name" SKIP 0 "no GPU (nvidia-smi -L fails)"; return 1; }
        elif [ "${STATUS[$need]:-}" != ok ]; then
            record "$name" SKIP 0 "needs $need (${STATUS[$need]:-not run})"
            return 1
        fi
    done
    local left=$((DEADLINE - PACK_RESERVE_S - $(date +%s))) full=$limit
    ((left < limit)) && limit=$left
    # Under half its limit a stage would fail for want of time and say something else (a server
    # given 10 s "did not start"): skipped, it says why.
    if ((limit < 5 || 2 * limit < full)); then
        record "$name" SKIP 0 "no time left in the ${BUDGET_S}s budget (${limit}s of the ${full}s it may need)"
        return 1
    fi
    local command="stage_$name"
    [[ ",$GPU_CHECK_FAIL," == *",$name,"* ]] && command="echo 'simulated failure of $name' >&2; exit 3"
    [ "$GPU_CHECK_HANG" = "$name" ] && command="echo 'simulated hang of $name'; sleep 600" && limit=3
    stamp "stage $name (limit ${limit}s)"
    local began rc seconds detail status
    began=$(date +%s)
    STAGE_LIMIT=$((limit - 10)) timeout -k 10 "$limit" bash -c "$command" 2>&1 | tee "$REPORT/$name.log"
    rc=${PIPESTATUS[0]}
    seconds=$(($(date +%s) - began))
    detail=$(grep -v '^\s*$' "$REPORT/$name.log" | tail -1 | cut -c1-200)
    case $rc in
        0) status=ok ;;
        124 | 137) status=TIMEOUT detail="killed at its ${limit}s limit; last line: $detail" ;;
        *) status=FAIL detail="exit $rc: $detail" ;;
    esac
    stamp "stage $name: $status after ${seconds}s"
    record "$name" "$status" "$seconds" "$detail"
    pack
    [ "$status" = ok ]
}

finish() {
    local rc=$?
    trap - EXIT
    stamp "done after $(($(date +%s) - STARTED))s"
    pack
    grep -q $'\t\\(FAIL\\|TIMEOUT\\)\t' "$REPORT/stages.tsv" 2>/dev/null && rc=1
    grep -q '^result: FAILED' "$OUT/summary.txt" 2>/dev/null && rc=1
    cat "$OUT/summary.txt"
    exec >&- 2>&-
    wait "$TEE_PID" 2>/dev/null  # run.log complete before the command returns
    exit "$rc"
}
trap finish EXIT
trap 'stamp "stopped by a signal"; exit 143' TERM INT HUP

stamp "GPU check ($PLAN): OUT=$OUT WORK=$WORK, ${BUDGET_S}s budget, GPU: $([ "$HAVE_GPU" = 1 ] && echo yes || echo no)${STAND_INS:+ (stand-ins from $STAND_INS)}$([ "$PLAN" = real-size ] && echo ", models in $MODELS")"
: >"$REPORT/stages.tsv"

# Limits: about twice what each took on the H200 (# N s: the first run there, 2026-12-04; serve_fp16
# from the second, speculation never reached). That is ~375 s before speculation, so a 330 s budget
# skips serve_fp16's end and speculation; a stage left under half its limit is skipped, not started.
first_stages() {  # first_stages JIT_LIMIT_S: every plan's start, on $MODULE (stage names with its $SUFFIX)
    stage preflight 30                                    # 8 s
    # shellcheck disable=SC1091
    [ -f "$WORK/cuda.env" ] && source "$WORK/cuda.env"  # CUDA_HOME and CPATH for a JIT build
    stage wheels 45                                       # 1 s
    stage "imports$SUFFIX" 45 wheels                      # 2 s
    if stage "extension$SUFFIX" 60 wheels; then           # 14 s
        record "jit_build$SUFFIX" SKIP 0 "the prebuilt extension imports"
    else
        rm -f "$WORK/ext/$EXT.so"  # a broken one on the path would break the package's own loader or build
        stage "jit_build$SUFFIX" "$1" wheels gpu && STATUS[extension$SUFFIX]=ok  # then the budget cuts the tail
    fi
}

# GPU_CHECK_PLAN=exl3: exllamav3's stages instead of the ones below (it ends the run).
# shellcheck source=bench/gpu/stages_exl3.sh
[ "$PLAN" = exl3 ] && source bench/gpu/stages_exl3.sh

first_stages 300                                          # exllamav2's JIT build: 3-4 min
stage provider 45 extension                               # 10 s
if [ "$PLAN" = real-size ]; then
    # Limits: about twice the estimates for an 8B model on an H100 (../shared/research/gpu-real-size.md, s. 4),
    # EXL2 first, FP16 last: a cut run loses FP16 through gRPC first.
    rm -rf "${MODELS:?}"
    stage bandwidth 30 gpu imports                        # ~5 s
    for fmt in exl2 gptq fp16; do
        limit=60
        [ "$fmt" = fp16 ] && limit=90
        stage "model_$fmt" "$limit" gpu imports           # 15-40 s
        stage "direct_$fmt" 150 gpu extension "model_$fmt"  # 60-80 s
        stage "grpc_$fmt" 120 gpu imports extension "model_$fmt"  # 45-60 s
        rm -rf "${MODELS:?}"
    done
    exit 0
fi
stage tiny_model 45 wheels                                # 2 s
stage paged_smoke 90 gpu extension tiny_model             # 25 s
stage serve_gptq 100 gpu imports extension tiny_model     # 56 s
stage convert_exl2 120 gpu extension tiny_model           # 68 s
stage paged_smoke_exl2 60 gpu convert_exl2                # 25 s
stage serve_exl2 100 gpu imports convert_exl2             # 59 s
stage model_check 60 tiny_model                           # 16 s
stage serve_fp16 110 gpu imports extension tiny_model     # 89 s
stage speculation 90 gpu imports extension tiny_model     # ~40 s (not measured)
exit 0  # finish() sets the status from the report, not from whether the last stage ran
