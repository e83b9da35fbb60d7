"""Checking a checkpoint against the spec: the validator, inspection, and loading (resolve + quick validation)."""
