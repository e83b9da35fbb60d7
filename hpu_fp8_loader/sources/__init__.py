"""What the pipeline reads: a directory or Hub id resolved, source tensors and their layout, measurement files, synthesized models."""
