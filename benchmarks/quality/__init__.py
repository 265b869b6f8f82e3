"""Model quality per linear plan and KV cache kind: perplexity, KL divergence and top-1 agreement, with llama.cpp's on the same file."""
