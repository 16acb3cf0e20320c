"""Triton Inference Server's Python-backend model of a formula-compress package: image in, LaTeX out.

Stage export copies this file to ``<package>/triton/formula/1/model.py`` (``pipeline/export/triton.py``)
and the package runtime's torch-free modules beside it (``1/pipeline/``), so the server's Python needs
onnxruntime (``onnxruntime-gpu`` for the TensorRT / CUDA providers), numpy, pillow and tokenizers,
and no torch. The package itself is the folder ``config.pbtxt``'s parameter ``package`` names
(relative to the model's folder: ``../..``).

A request row is one image file's bytes (``TYPE_STRING``); the rows of all the requests Triton's
dynamic batcher hands to one :meth:`TritonPythonModel.execute` are read as ``stage=infer`` reads files
(:func:`pipeline.files.decode_image`, the package's preprocessing), then encoded in one encoder call
and decoded the package's way (:meth:`OnnxPackage.generate`: a CPU package reads the batch's rows
speculatively one by one, a GPU package in batched greedy steps). A request whose image cannot be
read gets an error of its own; the others in the batch are still answered.

The input and output names come from the model config Triton hands :meth:`initialize`
(``config.pbtxt``), so they are spelt once, in ``pipeline/export/triton.py``.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

IMAGE_ERROR = "not a readable image"  # the start of a bad request's error message


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        from pipeline.export.runtime import OnnxPackage

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        self.image_input = config["input"][0]["name"]
        self.latex_output = config["output"][0]["name"]
        params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        folder = (Path(args["model_repository"]) / params.get("package", "../..")).resolve()
        threads = int(params.get("threads") or 0)
        options = {}
        if args.get("model_instance_kind") == "GPU":  # each GPU instance on its own device
            options["device_id"] = int(args.get("model_instance_device_id") or 0)
        self.package = OnnxPackage(folder, threads=threads, provider_options=options)
        self.max_length = self.package.max_length
        pb_utils.Logger.log_info(f"formula-compress package {folder} ({self.package.meta['target']}) on "
                                 f"{self.package.provider}; speculative: {self.package.speculative}")

    def _images(self, request) -> list:
        """The request's rows preprocessed; an image that cannot be read raises, naming its row."""
        from pipeline.files import decode_image

        blobs = self.pb.get_input_tensor_by_name(request, self.image_input).as_numpy().reshape(-1)
        return [self.package.preprocess(decode_image(io.BytesIO(bytes(blob)), f"row {i} of the request"))
                for i, blob in enumerate(blobs)]

    def execute(self, requests: list) -> list:
        import numpy as np

        from pipeline.errors import PipelineError

        pb = self.pb
        rows: list = []
        spans: list = []  # per request: (first row, row count) or the error message
        for request in requests:
            try:
                images = self._images(request)
            except (PipelineError, ValueError, OSError) as exc:  # what a bad image raises
                spans.append(f"{IMAGE_ERROR}: {exc}")
                continue
            spans.append((len(rows), len(images)))
            rows += images
        texts: list = []
        if rows:
            try:
                texts = self.package.generate(np.stack(rows), self.max_length, batch_size=len(rows)).texts
            except Exception as exc:  # the batch's reading failed: every request in it is told why
                return [pb.InferenceResponse(error=pb.TritonError(f"reading failed: {exc}")) for _ in requests]
        responses = []
        for span in spans:
            if isinstance(span, str):
                responses.append(pb.InferenceResponse(error=pb.TritonError(span)))
                continue
            start, count = span
            latex = np.array([t.encode("utf-8") for t in texts[start:start + count]], dtype=np.object_)
            responses.append(pb.InferenceResponse([pb.Tensor(self.latex_output, latex.reshape(count, 1))]))
        return responses

    def finalize(self) -> None:
        self.package = None
