"""Quantization building blocks (graph fusion, quantizable groups, QDQ graphs, plans) for stage quantize."""
