"""The engine's defaults, each defined once and imported by every place that offers it (the
engine's configs, `dyngen serve`'s ServiceConfig and flags, `dyngen generate`). Plain
constants, no torch: the front end imports them too."""

from __future__ import annotations

# 64, not 256: W2 measured 5.4x from the prefix cache at 64 and 3.3x at 256 (finer pages share
# more of a prompt), and the torch attention's cost does not depend on the page size.
PAGE_SIZE = 64
CACHE_TOKENS = 32768  # the KV cache of `serve` and `generate`: pages = CACHE_TOKENS // PAGE_SIZE
# Running jobs at once. 128, not 64, by `python -m benchmarks serving` (Zen 5, 2 cores): on the chat
# trace at 9 requests/s, 64 slots were all taken in the Poisson bursts and arrivals waited for one (p99
# TTFT 4.75 s, p99 inter-token 67 ms, far inside its 200 ms); at 128 they start at once (p99 TTFT
# 0.37 s, inter-token 85 ms). The page pool, not the cap, bounds concurrency past that: 256 gained
# nothing at 10.5 and 12 requests/s, where the cores are the bound, and the editing trace read the same
# at 64 and 128.
MAX_BATCH_SIZE = 128
MAX_CHUNK_SIZE = 2048  # tokens per forward: decode tokens plus prefill chunks
# Prompt tokens a forward may carry while other jobs decode in it (`--prefill-while-decoding`): each
# prompt token stalls every running stream's next token (~0.75 ms each on a 2-core Zen 5), so a long
# arriving prompt is fed in slices; with no job decoding, prefill takes the whole MAX_CHUNK_SIZE.
# Both budgets are counted from depth 0: a deeper token costs more (engine/prompt_depth_cost.py).
# 128 by `python -m benchmarks serving` (Zen 5): at 256 the editing trace's p99 inter-token latency
# was 302 ms at 1 request/s, at 128 it was 191 ms, within a 200 ms SLO, up to 1.41 requests/s.
PREFILL_WHILE_DECODING = 128
# The share of a forward's prompt budget that a prompt not finishing in it leaves to the prompts behind
# it (running or queued), so a short request does not wait out another's long prefill; what they do
# not use, it takes back.
PROMPT_RESERVE = 0.25
# The prompt work a forward with no decode step may carry, in milliseconds by the warm-up's timing of a
# depth-0 prompt token (`--prefill-alone-ms`; never fewer tokens than PREFILL_WHILE_DECODING, nor more
# than MAX_CHUNK_SIZE): a request arriving beside a long prefill waits for this forward, then for its
# own. A 7600-token prompt took as long in forwards of 256 to 2048 tokens (2-core Zen 4), so a short
# forward costs its prefill nothing; on a fast device, MAX_CHUNK_SIZE takes less than this.
PREFILL_ALONE_MS = 250.0
MAX_QUEUE = 1024  # jobs waiting for admission
# KV events the page pool keeps for replay (engine/cache/kv_events.py): at 64-token pages, 4096 events
# cover the registrations and evictions of a few full turns of the default 512-page cache.
KV_EVENT_CAPACITY = 4096
# Waiting jobs one named tenant may hold (with authentication on), unless `--max-queue-per-tenant`
# says: a quarter of the queue (whatever `--max-queue` is), so one tenant's flood leaves room for others'.
TENANT_QUEUE_SHARE = 4


def tenant_queue_cap(max_queue: int) -> int:
    return max(1, max_queue // TENANT_QUEUE_SHARE)


# Priority levels a waiting job gains per second of waiting (`--priority-aging`): priority p is a head
# start of p seconds, so priority 0 always starts (engine/fair_queue.py); 0 = no aging.
PRIORITY_AGING = 1.0
SAMPLING_THREADS = 2  # the sampler's thread pool, used in the threaded sampler mode
# engine.sampling.sampler.SamplerMode's values. Batched by measurement: `python -m benchmarks sampler` on the 2-core
# Zen 5 (vocab 49152; temperature 0.8, top_k 50, top_p 0.9, repetition penalty 1.1) gave 251 / 823 / 4297 us
# per call batched and 338 / 2519 / 21582 threaded at 1 / 8 / 64 jobs: per job, ~40 small torch calls hold
# the GIL for their Python overhead, and each pool thread's OpenMP team competes for the same cores, while the
# batched ops run each step once over all rows with both cores.
SAMPLER_MODES = ("batched", "threaded")
SAMPLER_MODE = "batched"
# The KV cache's storage (kernels.attention.kv_layer.KVCacheKind's values, and auto): float = the model's
# dtype; float16 = half a float32 cache's bytes; bfloat16 = the same bytes, bfloat16 pair products
# in the native attention where the CPU has them; int8 = int8 with a float16 scale per token and
# head. auto, where the linears are quantized and the model computes in float32: int8 where the
# native attention runs it on AMX tiles, float16 elsewhere, or bfloat16 where the CPU multiplies
# bfloat16 pairs and it times faster on the model by kv_cache_tune.MARGIN; float otherwise
# (engine.cache.kv_cache.choose_kv_cache and engine.model.kv_cache_tune say why).
KV_CACHE_KINDS = ("auto", "float", "float16", "bfloat16", "int8")
KV_CACHE = "auto"
# LoRA adapters an engine holds at once (`--max-adapters`): each is rank x (in + out) float32 per
# adapted projection, ~2.4 MB for rank 8 on every projection of the shipped model.
MAX_ADAPTERS = 8
# Caps on one adapter, checked against its safetensors header before a tensor is read
# (`--max-adapter-rank`, `--max-adapter-bytes`): rank 64 on every projection of the shipped model is
# ~78 MB in float32, so 128 MiB admits it and refuses a file meant to stall the loader.
MAX_ADAPTER_RANK = 64
MAX_ADAPTER_BYTES = 128 << 20
# With authentication on, run-time adapters one tenant holds at once (`--max-adapters-per-tenant`);
# the server's own (--lora) are shared and count for no tenant.
MAX_ADAPTERS_PER_TENANT = 2
# Where the model runs (`--device`): auto = the first CUDA device torch sees, else the CPU.
DEVICE = "auto"
# Attention kernels (kernels.attention.backend.AttentionKind's values): auto = Triton on CUDA, the native
# kernels on the CPU (torch where they do not build); torch; triton (on the CPU only under
# TRITON_INTERPRET=1, the interpreter the tests use); native (CPU).
ATTENTION_KINDS = ("auto", "torch", "triton", "native")
ATTENTION = "auto"
