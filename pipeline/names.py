"""The names stages meet by: artifact folders and the files in them, and an exported package's graphs.

Stages never import each other (they meet through artifacts); where one stage writes a file or a
folder that another reads, both take its name from here, so a rename lands in one place."""
from __future__ import annotations

# every artifact's record: its config, input hashes, output sha256s, library versions, metrics
MANIFEST = "manifest.json"
# the corpus artifact's formulas (and the shift split's), a JSON line each
FORMULAS_FILE = "formulas.jsonl"
# an exported package's metadata (graphs, precision, limits, format version), read by every runtime
PACKAGE_META = "package.json"
PREPROCESS = "preprocess.json"   # the package's declared preprocessing
TOKENIZER = "tokenizer.json"     # the package's tokenizer; stage tokenizer's formula BPE

# an exported package's graphs (package.json: graphs, io, precision): the encoder (images -> memory);
# the decoder's first call (BOS over the memory: logits, the self- and cross-attention caches); one
# cached step a token; speculative decoding's check of drafted tokens (the step's weights, several rows)
ENCODER = "encoder"
DECODER_FIRST = "decoder_first"
DECODER_STEP = "decoder_step"
DECODER_VERIFY = "decoder_verify"
DECODERS = (DECODER_FIRST, DECODER_STEP, DECODER_VERIFY)
REQUIRED_GRAPHS = (ENCODER, DECODER_FIRST, DECODER_STEP)  # decoder_verify: packages since speculative decoding

# stage quantize's output folder, and the files in it that stage export takes
QUANTIZE_ORIGINAL = "quantize-original"        # the original model with the chain model's plan (quantize.original)
QDQ_ENCODER = f"{ENCODER}.qdq.onnx"            # plain ops + Q/DQ: TensorRT, Metax
QDQ_ENCODER_ORT = f"{ENCODER}.ort_cpu.qdq.onnx" # ONNX Runtime fusions + Q/DQ: ort_cpu
QDQ_ENCODERS = {"ort_cpu": QDQ_ENCODER_ORT, "tensorrt": QDQ_ENCODER, "metax": QDQ_ENCODER}  # per export target
# ort_cpu's decoders with 8-bit weights (ORT MatMulNBits), when the plan has them; decoder_verify is
# speculative decoding's check of drafted tokens, the step's plan weight for weight
INT8_DECODERS = {g: f"{g}.ort_cpu.int8.onnx" for g in DECODERS}
INT8_DECODERS_BY_TARGET = {"ort_cpu": INT8_DECODERS}  # per export target (TensorRT / Metax: float, cast to FP16)

# stage export's packages that stage benchmark compares (folder names under the artifacts root)
DEPLOYABLE = "export-ort_cpu"                       # the chain's package for ONNX Runtime CPU
FLOAT_BASELINE = "export-ort_cpu-float-original"    # the original model in float: what users have today
FLOAT_CHAIN = "export-ort_cpu-float-chain"          # the chain's model (pruned ...) before quantization
INT8_ORIGINAL = "export-ort_cpu-int8-original"      # the original model quantized with the chain's plan
