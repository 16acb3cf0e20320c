"""The float graphs stage quantize starts from, made by the export stage's own graph code."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx

from pipeline.export import transforms
from pipeline.export.build import build_graphs, decoder_shapes, exported_graphs
from pipeline.export.package import write_package
from pipeline.export.runtime import OnnxPackage
from pipeline.export.targets import resolve_target, target_config
from pipeline.names import ENCODER

OPSET = 17


@dataclass
class FloatGraphs:
    encoder_std: Path      # onnxsim'd encoder, plain ONNX ops (what TensorRT / Metax graphs start from)
    encoder_ort: Path      # the ort_cpu package's encoder: ORT fusions + fused attention
    package_dir: Path      # a float ort_cpu package (encoder + KV-cached decoder) for greedy readings
    package: OnnxPackage
    memory_length: int
    hidden_size: int

    def open_package(self, threads: int = 0, graphs: dict[str, Path] | None = None) -> OnnxPackage:
        """A fresh session set on the float package; ``graphs`` replaces some of its graphs."""
        package = OnnxPackage(self.package_dir, threads=threads, provider="CPUExecutionProvider")
        for name, path in (graphs or {}).items():
            package.use_graph(name, path)
        return package

    def open_readers(self, threads: int, workers: int, graphs: dict[str, Path] | None = None) -> list[OnnxPackage]:
        """Session sets a reading is split over (:func:`pipeline.quantization.measure.read`): ``workers``
        of them with one intra-op thread each (two single-threaded sessions on two cores read more
        images a second than one session with two threads), or one with ``threads``."""
        if workers <= 1:
            return [self.open_package(threads, graphs)]
        return [self.open_package(1, graphs) for _ in range(workers)]


def ort_cpu_target():
    """The ``ort_cpu`` target with its default settings (conf/target/ort_cpu.yaml)."""
    return resolve_target(target_config("ort_cpu"))


def float_graphs(adapter, workdir: Path, max_length: int, model_key: str, threads: int = 0) -> FloatGraphs:
    target = ort_cpu_target()
    built = build_graphs(adapter, target, True, None, lambda _: None, model_key)
    package_dir = workdir / "float-package"
    package_dir.mkdir()
    write_package(package_dir, adapter, built, target, max_length)
    std = transforms.simplify(exported_graphs(adapter, OPSET, model_key)[ENCODER], ENCODER)
    std_path = workdir / f"{ENCODER}.std.onnx"
    onnx.save(std, str(std_path))
    shapes = decoder_shapes(adapter)
    return FloatGraphs(std_path, package_dir / f"{ENCODER}.onnx", package_dir,
                       OnnxPackage(package_dir, threads=threads, provider="CPUExecutionProvider"),
                       shapes["memory_length"], shapes["hidden_size"])
