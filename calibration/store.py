"""The calibration set on disk: the chosen images preprocessed by the model's adapter, saved as a
``datasets`` Dataset (``datasets.load_from_disk``), one row per image with its bucket and measures."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from calibration import sets
from pipeline.errors import PipelineError

TENSOR_COLUMN = "pixel_values"
CHUNK = 128  # rows converted to Arrow at a time (bounds peak memory for large sets)


def write_set(folder: Path, chosen: list[sets.Candidate], source: sets.Source, adapter,
               progress: bool) -> list[np.ndarray]:
    """Preprocess the chosen images again with the adapter and save them as a ``datasets`` Dataset;
    returns a few of the tensors (for the contact sheet)."""
    import datasets

    shape = tuple(int(s) for s in adapter.input_shape)
    features = datasets.Features({
        TENSOR_COLUMN: datasets.Array3D(shape=shape, dtype="float32"),
        "source_id": datasets.Value("string"),
        "bucket": datasets.Value("string"),
        "text": datasets.Value("string"),
        "length": datasets.Value("int32"),
        "structure": datasets.Value("string"),
        "ink_width": datasets.Value("int32"),
        "ink_height": datasets.Value("int32"),
        "ink_density": datasets.Value("float32"),
    })
    parts, shown = [], []
    bar = tqdm(total=len(chosen), desc="tensors", unit="img", disable=not progress)
    for batch in sets.iter_batches(chosen, CHUNK):
        arrays = []
        for c in batch:
            arr = adapter.preprocess(source.image(c.source_id)).numpy().astype(np.float32, copy=False)
            if tuple(arr.shape) != shape:
                raise PipelineError(f"preprocess gave shape {tuple(arr.shape)} for {c.source_id}, expected {shape}")
            arrays.append(arr)
            bar.update()
        shown.extend(arrays[:max(0, 64 - len(shown))])
        parts.append(datasets.Dataset.from_dict({
            TENSOR_COLUMN: np.stack(arrays),
            "source_id": [c.source_id for c in batch],
            "bucket": [c.bucket for c in batch],
            "text": [c.text for c in batch],
            "length": [c.length for c in batch],
            "structure": [c.structure for c in batch],
            "ink_width": [c.ink_width for c in batch],
            "ink_height": [c.ink_height for c in batch],
            "ink_density": [c.ink_density for c in batch],
        }, features=features))
    bar.close()
    ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    bars_were_on = datasets.is_progress_bar_enabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        ds.save_to_disk(str(folder))
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    return shown
