"""LoRA adapters: their files, read and checked for the model, and the engine's registry of them."""
