"""Calibration and accuracy evidence on the float32 reference engine and the Gaudi FP8 emulation."""

# eval's default text: 16 windows of 128 tokens, the 2,048 held-out tokens the demo evaluates, and enough windows
# for the bootstrap intervals (fewer windows give intervals that are themselves unstable). Here, not in
# evaluate.py, so that the command line can show them without importing the engine.
DEFAULT_EVAL_SAMPLES = 16
DEFAULT_EVAL_SEQ_LEN = 128
