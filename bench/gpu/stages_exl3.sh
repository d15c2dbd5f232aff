# The exllamav3 variant of the GPU check: sourced by run.sh when GPU_CHECK_PLAN=exl3, after its
# machinery (stage, record, pack, the exit trap), it runs these stages instead of exllamav2's and ends the run.
#
#   here:  bash bench/gpu/fetch_wheels.sh && bash bench/gpu/build_ext_exl3.sh
#   there: GPU_CHECK_PLAN=exl3 bash bench/gpu/run.sh   # carry .whl and bench/gpu/build/prebuilt
#
# Stages, the most important proof first:
#   preflight, wheels   as run.sh's
#   imports_exl3        tokenspout's server, the exllamav3 engine module and check.py import beside the wheels
#   extension_exl3      the prebuilt exllamav3_ext test-imported alone, then exllamav3 imported on it (no build)
#   jit_build_exl3      only if that failed: exllamav3's own JIT build (177 .cu files: minutes even on 16 cores)
#   tiny_model          run.sh's tiny random Llama (FP16), from exllamav2's calibration text
#   binding_exl3        exllamav3's own classes (no GPU needed) take what the binding gives them: a Job with
#                       every sampler, the grammar filter on its Filter, a Generator enqueueing and cancelling
#   serve_fp16_exl3     tokenspout serving the FP16 model on exllamav3 (check.py --engine exllamav3): the
#                       served checks (streaming equal to unary, stops, cancellation, a JSON-schema stream,
#                       every sampler, 4 streams batched, n, tools), transformers' greedy tokens, and decode
#                       tokens/s through gRPC at 1, 4 and 16 streams against exllamav3 driven directly
#   convert_exl3        EXL3 with exllamav3's own converter (4.0 bits, head 6, a small calibration)
#   serve_exl3          the same on the EXL3 model
#   speculation_exl3    the EXL3 model (FP16 if there is none) with exllamav3's n-gram drafting and without
# Triton compiles exllamav3's kernels on first use; they are kept in $WORK/triton for a rerun.
# shellcheck shell=bash disable=SC2154  # STATUS, WORK, REPORT, ... are run.sh's

BUDGET_S=$((${GPU_CHECK_BUDGET_S:-540} * SLOWDOWN))
DEADLINE=$((STARTED + BUDGET_S))
export TRITON_CACHE_DIR=$WORK/triton
rm -rf "$WORK/exl3-work" "$WORK/model/exl3"
stamp "exllamav3 variant: ${BUDGET_S}s budget"

stage_imports_exl3() {
    "$PYTHON" -c "
import service.cli, service.server, backend.exllamav3.engine, bench.gpu.check, bench.gpu.rates_exl3
print('tokenspout, its exllamav3 engine and check.py import; grpcio', __import__('grpc').__version__)"
}

stage_extension_exl3() {
    # exllamav3 imports exllamav3_ext if one is importable (ext.py), else builds its own: the prebuilt is tried
    # alone in a child first, then exllamav3 must take it without building.
    [ -f "$PREBUILT/exllamav3_ext.so.gz" ] || { echo "no prebuilt exllamav3_ext in $PREBUILT: run bench/gpu/build_ext_exl3.sh here and carry it"; return 1; }
    cat "$PREBUILT/build-info-exl3.txt" 2>/dev/null
    gunzip -c "$PREBUILT/exllamav3_ext.so.gz" >"$WORK/ext/exllamav3_ext.so" || return 1
    expected=$(sed -n 's/^sha256 *//p' "$PREBUILT/build-info-exl3.txt" 2>/dev/null)
    actual=$(sha256sum "$WORK/ext/exllamav3_ext.so" | cut -d' ' -f1)
    [ -z "$expected" ] || [ "$expected" = "$actual" ] || { echo "sha256 $actual, build-info-exl3 says $expected"; return 1; }
    "$PYTHON" -c "import torch, exllamav3_ext; print('prebuilt imports:', exllamav3_ext.__file__)" || return 1
    "$PYTHON" -c "
import exllamav3.ext as e
from exllamav3.version import __version__
assert e.is_precompiled_extension_available(), 'exllamav3 would build its own'
print('exllamav3', __version__, 'uses it')"
}

stage_jit_build_exl3() {
    # shellcheck disable=SC1091
    [ -f "$WORK/cuda.env" ] && source "$WORK/cuda.env"
    echo "CUDA_HOME=${CUDA_HOME:-unset} TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS"
    find "$TORCH_EXTENSIONS_DIR" -name lock -type f -print -delete 2>/dev/null  # a killed build's lock waits forever
    "$PYTHON" -c "import exllamav3.ext as e; print('built', e.exllamav3_ext.__file__)"
}

serve_exl3() {  # serve_exl3 VARIANT SECONDS [check.py flags]
    local variant=$1 seconds=$2; shift 2
    "$PYTHON" bench/gpu/check.py --engine exllamav3 --model "$WORK/model/$variant" --name "exl3-$variant" \
        --json "$REPORT/check-exl3-$variant.json" --time-limit "$seconds" "$@"
}
stage_serve_fp16_exl3() { serve_exl3 fp16 "$STAGE_LIMIT" --reference-hf; }
stage_serve_exl3() { serve_exl3 exl3 "$STAGE_LIMIT"; }

stage_convert_exl3() {
    "$PYTHON" -m exllamav3.conversion.convert_model -i "$WORK/model/fp16" -w "$WORK/exl3-work" -o "$WORK/model/exl3" \
        -b 4.0 -hb 6 -cr 16 -cc 512
    [ -f "$WORK/model/exl3/config.json" ] && compgen -G "$WORK/model/exl3/*.safetensors" >/dev/null ||
        { echo "the converter wrote no EXL3 model"; return 1; }
    grep -q '"exl3"' "$WORK/model/exl3/config.json" || { echo "config.json names no exl3 quantization"; return 1; }
}

stage_binding_exl3() { "$PYTHON" bench/gpu/binding_exl3.py "$WORK/model/fp16"; }

stage_speculation_exl3() {
    local variant=fp16
    [ -f "$WORK/model/exl3/config.json" ] && variant=exl3
    "$PYTHON" bench/gpu/check.py --engine exllamav3 --model "$WORK/model/$variant" --name "exl3-speculation-$variant" \
        --speculation --json "$REPORT/check-exl3-speculation.json" --time-limit "$STAGE_LIMIT"
}
export -f stage_imports_exl3 stage_extension_exl3 stage_jit_build_exl3 serve_exl3 stage_serve_fp16_exl3 \
    stage_serve_exl3 stage_convert_exl3 stage_binding_exl3 stage_speculation_exl3

# Limits: guesses (this variant has not run on a GPU yet), the served stages with room for Triton's first
# compiles; a stage left under half its limit is skipped, not started.
stage preflight 30
# shellcheck disable=SC1091
[ -f "$WORK/cuda.env" ] && source "$WORK/cuda.env"
stage wheels 45
stage imports_exl3 45 wheels
if stage extension_exl3 60 wheels; then
    record jit_build_exl3 SKIP 0 "the prebuilt extension imports"
else
    rm -f "$WORK/ext/exllamav3_ext.so"  # a broken one on the path would stop exllamav3's own build
    stage jit_build_exl3 420 wheels gpu && STATUS[extension_exl3]=ok
fi
stage tiny_model 45 wheels
stage binding_exl3 45 extension_exl3 tiny_model
stage serve_fp16_exl3 180 gpu imports_exl3 extension_exl3 tiny_model
stage convert_exl3 150 gpu extension_exl3 tiny_model
stage serve_exl3 150 gpu imports_exl3 convert_exl3
stage speculation_exl3 120 gpu imports_exl3 extension_exl3 tiny_model
exit 0  # finish() sets the status from the report, not from whether the last stage ran
