"""Speculative decoding: drafters (n-gram, draft model), acceptance, and the step that runs them."""
