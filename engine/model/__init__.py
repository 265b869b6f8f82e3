"""Llama-family model: config, weight sources (GGUF, safetensors), tokenizer, forward."""
