"""Reading and writing safetensors checkpoints: headers, index, path safety, atomic sharded output."""
