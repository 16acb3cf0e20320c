"""What a decoder call costs by its width and by its batch, on a device: the premise of the GPU targets'
speculative defaults (issue 38), checked with the model's own cached decoder in torch.

The `tensorrt` and `metax` targets draft every token the ngram table has (`draft_min_confidence` 0,
`draft_tail` 0) and decode batches of several images in plain greedy steps, all rows at once
(`speculative_batches: false`), because on a GPU a decoder call at batch 1 is expected to cost about the
same whatever its width or batch (a few small matrix products, bound by launches and weight reads, not by
the tokens). On this project's CPU it does not (a verify call pays ~0.15 ms a token: docs/export.md). The
lent GPU machines cannot run the packages themselves (their onnxruntime is the CPU build, the GPU wheel is
244 MB against the 64 MiB a call may carry, TensorRT is not there), so this script times what they can:
the adapter's cached decoder (`ModelAdapter.cached_decoder`, what export traces into `decoder_step` and
`decoder_verify`), eager torch, after `--past` tokens on the encoder output of a blank image:

- width T = 1..`--max-width` at batch 1, causal, the logits after every token (a `decoder_verify` call);
- batch B in `--batches`, one token a row (a batched `decoder_step` call);

each the median of `--repeat` calls after a warm-up (CUDA synchronized around each call), and its ratio
to width 1 / batch 1. `benchmarks/gpu_check.sh` runs it on CUDA in FP16 and FP32.

    python benchmarks/decoder_widths.py --device cuda --dtype float16
    python benchmarks/decoder_widths.py --device cpu --model artifacts/prune/<folder>
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DTYPES = ("float32", "float16", "bfloat16")


def time_calls(call, device, repeat: int) -> float:
    """Median milliseconds of ``call()`` over ``repeat`` calls after 5 warm-up calls."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(5):
        call()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        call()
        sync()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def measure(adapter, device, dtype: str, max_width: int, batches: list[int], past_len: int, repeat: int) -> dict:
    """Milliseconds of a verify-shaped call per width (batch 1) and of a step-shaped call per batch."""
    import torch

    cached = adapter.cached_decoder()
    if cached is None:
        raise SystemExit(f"error: the {adapter.family} adapter has no cached decoder to time")
    adapter.model.to(device=device, dtype=getattr(torch, dtype)).eval()
    eos = int(adapter.eos_id)
    with torch.inference_mode():
        image = torch.ones(1, *adapter.input_shape, device=device, dtype=getattr(torch, dtype))
        memory = adapter.encode(image)
        prefix = torch.full((1, past_len), eos, dtype=torch.long, device=device)
        prefix[0, 0] = int(adapter.bos_id)
        cross1 = cached.cross_kv(memory)
        _, past1 = cached.run(prefix, [], cross1, causal=True)
        widths = {}
        for width in range(1, max_width + 1):
            ids = torch.full((1, width), eos, dtype=torch.long, device=device)
            widths[width] = time_calls(lambda: cached.run(ids, past1, cross1, causal=True, every=True), device, repeat)
        rows = {}
        for batch in batches:
            cross = [c.expand(batch, *c.shape[1:]).contiguous() for c in cross1]
            past = [p.expand(batch, *p.shape[1:]).contiguous() for p in past1]
            ids = torch.full((batch, 1), eos, dtype=torch.long, device=device)
            rows[batch] = time_calls(lambda: cached.run(ids, past, cross, causal=False), device, repeat)
    return {"device": str(device), "dtype": dtype, "past": past_len, "repeat": repeat,
            "width_ms": widths, "width_ratio": {w: ms / widths[1] for w, ms in widths.items()},
            "batch_ms": rows, "batch_ratio": {b: ms / rows[batches[0]] for b, ms in rows.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapter", default="latex_ocr_junia", help="the model family (pipeline/adapters)")
    ap.add_argument("--model", default="package",
                    help="a model folder (a stage's output), or 'package': the adapter's own weights")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--max-width", type=int, default=9, help="tokens a verify call reads at most (export's 9)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--past", type=int, default=40, help="tokens already in the cache")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None, help="the figures as JSON")
    args = ap.parse_args(argv)
    if args.max_width < 1 or args.past < 1 or args.repeat < 1 or min(args.batches) < 1:
        ap.error("--max-width, --past, --repeat and --batches must be >= 1")

    import torch

    from pipeline.adapters.base import load_adapter
    from pipeline.errors import PipelineError

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    try:
        adapter = load_adapter(args.adapter, args.model)
    except PipelineError as exc:
        ap.error(str(exc))
    if args.past + args.max_width > adapter.max_positions:
        ap.error(f"--past {args.past} + --max-width {args.max_width} exceed the decoder's {adapter.max_positions} "
                 f"positions")
    if device.type == "cpu":
        torch.set_num_threads(1)
    r = measure(adapter, device, args.dtype, args.max_width, sorted(set(args.batches)), args.past, args.repeat)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu, 1 thread"
    print(f"[decoder_widths] {args.adapter} {args.model} on {label}, {args.dtype}, past {args.past}, "
          f"median of {args.repeat} calls")
    print("width (batch 1): " + ", ".join(f"{w}: {ms:.3f} ms ({r['width_ratio'][w]:.2f}x)"
                                          for w, ms in r["width_ms"].items()))
    print("batch (1 token): " + ", ".join(f"{b}: {ms:.3f} ms ({r['batch_ratio'][b]:.2f}x)"
                                          for b, ms in r["batch_ms"].items()))
    if args.out:
        args.out.write_text(json.dumps({"device_name": label, **r}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
