"""The engine's defaults, each defined once and imported by every place that offers it (the
engine's configs, `dyngen serve`'s ServiceConfig and flags, `dyngen generate`). Plain
constants, no torch: the front end imports them too."""

from __future__ import annotations

# 64, not 256: W2 measured 5.4x from the prefix cache at 64 and 3.3x at 256 (finer pages share
# more of a prompt), and the torch attention's cost does not depend on the page size.
PAGE_SIZE = 64
CACHE_TOKENS = 32768  # the KV cache of `serve` and `generate`: pages = CACHE_TOKENS // PAGE_SIZE
MAX_BATCH_SIZE = 64  # running jobs at once
MAX_CHUNK_SIZE = 2048  # tokens per forward: decode tokens plus prefill chunks
MAX_QUEUE = 1024  # jobs waiting for admission
SAMPLING_THREADS = 2
# The KV cache's storage (kernels.attention.kv_layer.KVCacheKind's values, and auto): float = the model's
# dtype; float16 = half a float32 cache's bytes; int8 = int8 with a float16 scale per token and
# head. auto = float16 where the linears are quantized and the model computes in float32, float
# elsewhere (engine.kv_cache.choose_kv_cache says why).
KV_CACHE_KINDS = ("auto", "float", "float16", "int8")
KV_CACHE = "auto"
