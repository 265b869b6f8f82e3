"""Logits to tokens: the sampler, per-job sampler state, logits processors and filters."""
