"""formula-compress: prune, re-tokenize, calibrate, quantize and export a formula recognizer."""

__version__ = "0.1.0"
