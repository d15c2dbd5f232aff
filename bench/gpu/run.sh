#!/usr/bin/env bash
# The exllamav2 engine on a GPU, end to end, from nothing but this repository and carried wheels.
#
#   here:  bash bench/gpu/fetch_wheels.sh     # wheels for Python 3.12 into .whl/ (git ignores it)
#   there: bash bench/gpu/run.sh              # a CUDA machine with torch, no network; carry .whl
#
# Builds exllamav2's extension, makes a tiny random-weight Llama and its tokenizer, converts
# it to EXL2 with exllamav2's own converter, writes a GPTQ copy, then serves each (and the
# FP16 original) through tokenspout and runs bench/gpu/check.py. Reports land in $OUT
# (or bench/results/gpu). Sized for about 10 minutes on one H200; the extension build is
# most of it.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu}
WORK=${WORK:-/tmp/tokenspout-gpu}
mkdir -p "$OUT" "$WORK"
stamp() { echo "[$(date +%T)] $*"; }

for tool in nvcc ninja nvidia-smi; do  # exllamav2 compiles its extension with them on first import
    command -v "$tool" >/dev/null || { echo "missing $tool" >&2; exit 1; }
done
python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$WORK/site" .whl/*.whl
export PYTHONPATH="$WORK/site:$PWD:$PWD/clients/python" PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

stamp "building exllamav2's CUDA extension (first import)"
python3 -c "import torch, exllamav2; print('exllamav2', exllamav2.__version__, 'torch', torch.__version__, torch.version.cuda)" \
    2>&1 | tee "$OUT/build.log" | tail -3

stamp "tiny Llama: tokenizer, FP16 and GPTQ"
CAL=$(python3 -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('exllamav2').origin).parent / 'conversion' / 'standard_cal_data')")
python3 bench/gpu/tiny_llama.py "$WORK/model" --text "$CAL"/*.utf8

stamp "EXL2 with exllamav2's converter"
# The converter exits 0 on some errors: its output directory is the proof.
python3 -m exllamav2.conversion.convert_exl2 -i "$WORK/model/fp16" -o "$WORK/exl2-work" -cf "$WORK/model/exl2" \
    -b 4.0 -hb 6 -l 512 -ml 512 -nr > "$OUT/convert.log" 2>&1 || true
if [ ! -f "$WORK/model/exl2/config.json" ] || ! ls "$WORK/model/exl2"/*.safetensors >/dev/null 2>&1; then
    tail -40 "$OUT/convert.log"; exit 1
fi

status=0
for variant in exl2 gptq fp16; do
    stamp "serving $variant through tokenspout"
    extra=(); [ "$variant" = fp16 ] && extra=(--reference-hf)
    python3 bench/gpu/check.py --model "$WORK/model/$variant" --name "$variant" --json "$OUT/check-$variant.json" \
        "${extra[@]}" || status=1
done
stamp "summary"
python3 bench/gpu/check.py --summarize "$OUT"/check-*.json | tee "$OUT/summary.txt" || status=1
exit $status
