#!/usr/bin/env bash
# The chain's torch stages on CUDA, on a machine that has a GPU (run it when one is at hand; CI has none).
# Needs a Python with a CUDA build of torch and this project installed (pip install -e . with
# torch==2.13.0 from PyPI, not the +cpu pin). Prints what a decoder call costs by width and batch on CUDA
# (benchmarks/decoder_widths.py), each stage's seconds and the readings' agreement between
# model.device=cuda and model.device=cpu; exits non-zero on the first failure.
#   bash benchmarks/gpu_check.sh [artifacts folder]        (default: /tmp/fc-gpu-check)
set -euo pipefail
PY=${PY:-python}
ROOT=${1:-/tmp/fc-gpu-check}
mkdir -p "$ROOT"
export MPLBACKEND=Agg PYTHONUNBUFFERED=1
$PY - <<'PYEOF'
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device: install a CUDA build"
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
PYEOF
# the GPU targets' speculative premise (issue 38): a decoder call's cost by width (batch 1) and by batch, on the
# model's own cached decoder in torch, FP16 and FP32 (seconds; first, so it lands whatever follows)
for dtype in float16 float32; do
  "$PY" "$(dirname "$0")/decoder_widths.py" --device cuda --dtype $dtype --out "$ROOT/decoder_widths_$dtype.json"
done
run() { local t0=$SECONDS; "$PY" -m pipeline "$@" artifacts.dir="$ROOT" progress=false; echo "[gpu_check] $1: $((SECONDS - t0)) s"; }
# torch readings (evaluate), on both devices: the same greedy readings expected (float32 on both)
run stage=evaluate model.device=cuda eval.limit=32 eval.name=evaluate-cuda
run stage=evaluate model.device=cpu eval.limit=32 eval.name=evaluate-cpu
$PY - "$ROOT" <<'PYEOF'
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
m = {d: json.loads((root / f"evaluate-{d}" / "manifest.json").read_text())["metrics"] for d in ("cuda", "cpu")}
for split in m["cpu"].get("splits", m["cpu"]):
    print("[gpu_check] evaluate", split, {d: m[d].get("splits", m[d]).get(split, {}).get("exact_match") for d in m})
PYEOF
# prune's recovery (teacher readings, refit, finetune under bf16 autocast) and quantize's QAT on CUDA
run stage=prune model.device=cuda prune.key_pool_layers=[0] prune.key_pool=[2,2] prune.finetune_steps=50 \
    prune.finetune_precision=bf16 prune.eval_limit=16 prune.compare_random=false
run stage=calibrate calibrate.size=128
run stage=quantize model.device=cuda quantize.qat_steps=50 quantize.qat_precision=bf16 quantize.methods=[percentile_99.99] \
    quantize.anchors=false quantize.check=false quantize.search_images=128 quantize.decoder_search_images=64
# distill's decoder training on CUDA (a short run)
run stage=tokenizer
run stage=distill model.device=cuda distill.steps=50 distill.eval_every=0
echo "[gpu_check] done: $ROOT"
