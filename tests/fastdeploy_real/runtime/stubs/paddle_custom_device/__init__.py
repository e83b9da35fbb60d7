"""Stand-in for PaddleCustomDevice's package: only its compiled Intel HPU ops (``intel_hpu``) are needed."""
