"""In-process benchmarks of the engine: W1/W2 against transformers, single stream and the matmul table, speculation, structured output, the sampler, host cost, the roofline, grammar engines."""
