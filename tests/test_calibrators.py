"""calibration/calibrators.py: ORT's own calibrators fed from a saved calibration set."""
from __future__ import annotations

import numpy as np
import pytest

from calibration import calibrators
from pipeline.errors import PipelineError

SHAPE = (1, 8, 16)


@pytest.fixture(scope="module")
def calib_set_dir(tmp_path_factory):
    """A calib_set as stage calibrate writes it (same column and feature type), 6 rows whose
    value ranges differ from batch to batch."""
    import datasets

    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 1.0, size=(6, *SHAPE)).astype(np.float32)
    x[4] *= 3.0  # one batch with a wider range: moving-average min/max must differ from plain min/max
    x[5] -= 1.0
    features = datasets.Features({calibrators.TENSOR_COLUMN: datasets.Array3D(shape=SHAPE, dtype="float32"),
                                  "source_id": datasets.Value("string")})
    folder = tmp_path_factory.mktemp("cal") / "calib_set"
    datasets.Dataset.from_dict({calibrators.TENSOR_COLUMN: x, "source_id": [f"s{i}" for i in range(6)]},
                               features=features).save_to_disk(str(folder))
    return folder, x


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    """y = relu(2 x - 0.5): tensors 'scaled' and 'out' have ranges known from the input."""
    import onnx
    from onnx import TensorProto, helper

    inp = helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", *SHAPE])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", *SHAPE])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    half = helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])
    graph = helper.make_graph([
        helper.make_node("Mul", ["pixel_values", "two"], ["scaled"]),
        helper.make_node("Sub", ["scaled", "half"], ["shifted"]),
        helper.make_node("Relu", ["shifted"], ["out"]),
    ], "tiny", [inp], [out], initializer=[two, half])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    onnx.save(model, str(path))
    return path


def test_reader_batches_the_saved_set(calib_set_dir, tiny_onnx):
    folder, x = calib_set_dir
    name = calibrators.model_input_name(tiny_onnx)
    assert name == "pixel_values"
    reader = calibrators.CalibSetReader(folder.parent, name, batch_size=4)  # the artifact folder works too
    assert len(reader) == 2
    batches = list(reader)
    assert [b[name].shape for b in batches] == [(4, *SHAPE), (2, *SHAPE)]
    np.testing.assert_array_equal(np.concatenate([b[name] for b in batches]), x)
    assert reader.get_next() is None
    reader.rewind()
    assert reader.get_next()[name].shape == (4, *SHAPE)


def test_minmax_ranges_are_the_data_ranges(calib_set_dir, tiny_onnx):
    folder, x = calib_set_dir
    ranges = calibrators.ranges_as_dict(calibrators.compute_ranges(
        tiny_onnx, calibrators.CalibSetReader(folder, "pixel_values", batch_size=2), "minmax"))
    np.testing.assert_allclose(ranges["pixel_values"], [x.min(), x.max()], rtol=1e-6)
    np.testing.assert_allclose(ranges["scaled"], [2 * x.min(), 2 * x.max()], rtol=1e-6)
    np.testing.assert_allclose(ranges["out"], [0.0, 2 * x.max() - 0.5], rtol=1e-6, atol=1e-7)


def test_other_methods_run_and_stay_inside_the_data(calib_set_dir, tiny_onnx):
    folder, x = calib_set_dir
    lo, hi = 2 * x.min(), 2 * x.max()
    results = {}
    for name in ("minmax_ema", "entropy", "percentile"):
        reader = calibrators.CalibSetReader(folder, "pixel_values", batch_size=2)
        results[name] = calibrators.ranges_as_dict(calibrators.compute_ranges(tiny_onnx, reader, name))["scaled"]
        r_lo, r_hi = results[name]
        assert np.isfinite([r_lo, r_hi]).all() and r_lo < r_hi
        assert r_lo >= -max(abs(lo), abs(hi)) - 1e-5 and r_hi <= max(abs(lo), abs(hi)) + 1e-5, name
    # the moving average lags the widest batch: a narrower range than plain min/max
    assert results["minmax_ema"][1] < hi and results["minmax_ema"][0] > lo
    # entropy clips the sparse tail (ORT's default 128 bins would give back min/max exactly)
    mm = calibrators.ranges_as_dict(calibrators.compute_ranges(
        tiny_onnx, calibrators.CalibSetReader(folder, "pixel_values", batch_size=2), "minmax"))["scaled"]
    assert max(abs(v) for v in results["entropy"]) < 0.99 * max(abs(v) for v in mm)


def test_unknown_method_and_missing_set_are_clear_errors(tmp_path, tiny_onnx):
    with pytest.raises(PipelineError, match="unknown calibration method 'kl'"):
        calibrators.method("kl")
    with pytest.raises(PipelineError, match="run stage calibrate first"):
        calibrators.CalibSetReader(tmp_path / "nothing", "pixel_values")


@pytest.mark.slow
def test_histogram_methods_in_passes_give_the_one_pass_ranges(calib_set_dir, tiny_onnx, monkeypatch):
    """entropy/percentile watch a group of tensors per pass over the whole set (memory), and every
    tensor's range is the one-pass range; min-max keeps its one pass (ReduceMin/Max outputs are tiny)."""
    folder, _ = calib_set_dir
    seen: list[list[str]] = []
    collect = calibrators._collect

    def spy(calibrator, reader):
        seen.append(sorted(o.name for o in calibrator.infer_session.get_outputs()))
        return collect(calibrator, reader)

    monkeypatch.setattr(calibrators, "_collect", spy)
    per_image = 4 * int(np.prod(SHAPE))  # each tensor of the tiny graph, float32, one image
    for name in ("entropy", "percentile", "minmax"):
        seen.clear()
        one = calibrators.compute_ranges(tiny_onnx, calibrators.CalibSetReader(folder, "pixel_values", batch_size=2), name)
        assert len(seen) == 1
        seen.clear()
        split = calibrators.compute_ranges(tiny_onnx, calibrators.CalibSetReader(folder, "pixel_values", batch_size=2),
                                           name, pass_bytes=6 * per_image)  # one tensor of the 6 images a pass
        if name == "minmax":
            assert len(seen) == 1
            continue
        # one watched tensor per pass, beside the graph's own output
        assert seen == [sorted({"out", t}) for t in ("out", "pixel_values", "scaled", "shifted")]
        assert sorted(split) == sorted(one) == ["out", "pixel_values", "scaled", "shifted"]
        for tensor in one:
            np.testing.assert_array_equal(np.asarray(split[tensor].range_value), np.asarray(one[tensor].range_value))


class _Feeds(calibrators.CalibrationDataReader):
    def __init__(self, feeds):
        self.feeds = iter(feeds)

    def get_next(self):
        return next(self.feeds, None)


def test_batches_of_different_token_counts_calibrate_as_their_values_in_one_batch(tmp_path):
    """A policy encoder's calibration batches keep different token counts (320 tokens, then 384): every
    method calibrates over them, and its ranges are those of the same values read as one batch."""
    import onnx
    from onnx import TensorProto, helper

    inp = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "tokens", 16])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "tokens", 16])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["scaled"]),
                               helper.make_node("Relu", ["scaled"], ["out"])], "ragged", [inp], [out],
                              initializer=[helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "ragged.onnx"))
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(1, 8, 16)).astype(np.float32), 3 * rng.normal(size=(1, 5, 16)).astype(np.float32)
    for name in calibrators.METHODS:
        ragged = calibrators.compute_ranges(tmp_path / "ragged.onnx", _Feeds([{"x": a}, {"x": b}]), name)
        if "ema" in name:  # a moving average of per-batch ranges: not the one batch's range
            continue
        joined = calibrators.compute_ranges(tmp_path / "ragged.onnx", _Feeds([{"x": np.concatenate([a, b], 1)}]), name)
        for tensor in ("x", "scaled", "out"):
            np.testing.assert_allclose(np.asarray(ragged[tensor].range_value), np.asarray(joined[tensor].range_value),
                                       rtol=1e-6, err_msg=f"{name} {tensor}")
