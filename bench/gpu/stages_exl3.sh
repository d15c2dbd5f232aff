# The exllamav3 variant of the GPU check: sourced by run.sh when GPU_CHECK_PLAN=exl3, after its
# machinery (stage, record, pack, the exit trap), it runs these stages instead of exllamav2's and ends the run.
#
#   here:  bash bench/gpu/fetch_wheels.sh && bash bench/gpu/build_ext.sh exl3
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

export TRITON_CACHE_DIR=$WORK/triton
rm -rf "$WORK/exl3-work" "$WORK/model/exl3"

stage_imports_exl3() {
    "$PYTHON" -c "
import service.cli, service.server, backend.exllamav3.engine, bench.gpu.check, bench.gpu.rates_exl3
print('tokenspout, its exllamav3 engine and check.py import; grpcio', __import__('grpc').__version__)"
}

stage_extension_exl3() {
    # exllamav3 imports exllamav3_ext if one is importable (ext.py), else builds its own: the prebuilt is tried
    # alone in a child first (run.sh's unpack_prebuilt), then exllamav3 must take it without building.
    unpack_prebuilt && "$PYTHON" -c "
import exllamav3.ext as e
from exllamav3.version import __version__
assert e.is_precompiled_extension_available(), 'exllamav3 would build its own'
print('exllamav3', __version__, 'uses it')"
}

stage_jit_build_exl3() { stage_jit_build; }
stage_serve_fp16_exl3() { serve fp16 --reference-hf; }
stage_serve_exl3() { serve exl3; }
stage_speculation_exl3() { speculate exl3; }

stage_convert_exl3() {
    "$PYTHON" -m exllamav3.conversion.convert_model -i "$WORK/model/fp16" -w "$WORK/exl3-work" -o "$WORK/model/exl3" \
        -b 4.0 -hb 6 -cr 16 -cc 512
    converted exl3 || return 1
    grep -q '"exl3"' "$WORK/model/exl3/config.json" || { echo "config.json names no exl3 quantization"; return 1; }
}

stage_binding_exl3() { "$PYTHON" bench/gpu/binding_exl3.py "$WORK/model/fp16"; }
export -f stage_imports_exl3 stage_extension_exl3 stage_jit_build_exl3 stage_serve_fp16_exl3 stage_serve_exl3 \
    stage_convert_exl3 stage_binding_exl3 stage_speculation_exl3

# Limits: guesses (this variant has not run on a GPU yet), the served stages with room for Triton's first
# compiles; a stage left under half its limit is skipped, not started.
first_stages 420
stage tiny_model 45 wheels
stage binding_exl3 45 extension_exl3 tiny_model
stage serve_fp16_exl3 180 gpu imports_exl3 extension_exl3 tiny_model
stage convert_exl3 150 gpu extension_exl3 tiny_model
stage serve_exl3 150 gpu imports_exl3 convert_exl3
stage speculation_exl3 120 gpu imports_exl3 extension_exl3 tiny_model
exit 0  # finish() sets the status from the report, not from whether the last stage ran
