"""Calibration and accuracy evidence on the float32 reference engine and the Gaudi FP8 emulation."""
