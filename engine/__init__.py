"""dyngen's engine: model, paged KV cache, and (later) the dynamic generator."""
