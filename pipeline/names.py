"""The names stages meet by: artifact folders and the files in them.

Stages never import each other (they meet through artifacts); where one stage writes a file or a
folder that another reads, both take its name from here, so a rename lands in one place."""
from __future__ import annotations

# stage quantize's output folder, and the files in it that stage export takes
QUANTIZE_ORIGINAL = "quantize-original"        # the original model with the chain model's plan (quantize.original)
QDQ_ENCODER = "encoder.qdq.onnx"               # plain ops + Q/DQ: TensorRT, Metax
QDQ_ENCODER_ORT = "encoder.ort_cpu.qdq.onnx"   # ONNX Runtime fusions + Q/DQ: ort_cpu
QDQ_ENCODERS = {"ort_cpu": QDQ_ENCODER_ORT, "tensorrt": QDQ_ENCODER, "metax": QDQ_ENCODER}  # per export target
# ort_cpu's decoders with 8-bit weights (ORT MatMulNBits), when the plan has them; decoder_verify is
# speculative decoding's check of drafted tokens, the step's plan weight for weight
INT8_DECODERS = {"decoder_first": "decoder_first.ort_cpu.int8.onnx",
                 "decoder_step": "decoder_step.ort_cpu.int8.onnx",
                 "decoder_verify": "decoder_verify.ort_cpu.int8.onnx"}
INT8_DECODERS_BY_TARGET = {"ort_cpu": INT8_DECODERS}  # per export target (TensorRT / Metax: float, cast to FP16)

# stage export's packages that stage benchmark compares (folder names under the artifacts root)
DEPLOYABLE = "export-ort_cpu"                       # the chain's package for ONNX Runtime CPU
FLOAT_BASELINE = "export-ort_cpu-float-original"    # the original model in float: what users have today
FLOAT_CHAIN = "export-ort_cpu-float-chain"          # the chain's model (pruned ...) before quantization
INT8_ORIGINAL = "export-ort_cpu-int8-original"      # the original model quantized with the chain's plan
