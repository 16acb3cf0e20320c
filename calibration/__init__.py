"""Calibration data for quantization: set building (``sets``) and ORT's calibrators (``calibrators``)."""
