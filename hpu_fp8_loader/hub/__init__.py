"""Publishing: convert, validate, evaluate, render the model card from ``model_cards/``, upload and verify."""
