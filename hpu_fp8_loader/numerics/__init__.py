"""FP8 arithmetic on numpy: the e4m3fn cast, scales from amax, requantization and fusion of row/column groups."""
