"""``python -m pipeline.benchmarking.memory JOB_JSON``: load one variant in this fresh process, read
the images, print peak resident memory as JSON (``VmHWM`` of ``/proc/self/status``; ``getrusage`` elsewhere)."""
from __future__ import annotations

import json
import resource
import sys


def _rss_mb() -> float:
    """Peak resident memory of this process so far, MiB."""
    try:  # Linux: the high-water mark of this process's own memory map
        for line in open("/proc/self/status", encoding="ascii"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    # ru_maxrss survives exec on Linux (it would report the parent's size at fork), hence the fallback only
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024 if sys.platform != "darwin" else kib / (1024 * 1024)  # macOS reports bytes


def main(job: dict) -> dict:
    import numpy as np
    import torch

    from pipeline.benchmarking.variants import rebuild

    torch.set_num_threads(int(job["threads"]))
    images = np.load(job["images"])
    base = _rss_mb()
    decode = rebuild(job["spec"], int(job["threads"]))
    decode(images, int(job["max_length"]), int(job["batch_size"]))
    return {"base_mb": base, "peak_mb": _rss_mb(), "images": int(images.shape[0])}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
