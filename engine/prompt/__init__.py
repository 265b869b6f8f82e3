"""A job's prompt beyond its tokens: guidance's negative prompt, prompt embeddings (torch-free)."""
