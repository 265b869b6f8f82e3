"""Counter-based uniforms: a job's random draw is a pure function of (seed, output position, stream).

A job's sampled token at output position p uses the uniform keyed by (seed, p, stream), not the
next value of a generator whose state depends on every draw before it. So a job re-created from
its prompt and the tokens it already emitted (after an engine restart, with the same seed) draws
exactly what it would have drawn, with no generator state to carry, and a banned-string redraw
never shifts the draws of later positions (speculation draws each draft position's own uniform).

The hash is SplitMix64's finalizer (Steele, Lea and Flood, 2014) applied along the key; its
outputs pass BigCrush as a counter-based generator. Three mixes of Python ints cost about a
microsecond, less than one `torch.rand(1, generator=...)` call.
"""

from __future__ import annotations

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_SCALE = 2.0**-24  # 24 bits: every value is exact in float32, as torch.rand's are

# Stream of draws that name no position (direct Sampler callers): numbered by the state in order.
SEQUENTIAL_STREAM = 1 << 33


def mix64(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit ints whose output bits each depend on every input bit."""
    z = (z + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def seed_key(seed: int) -> int:
    """A seed's key, computed once per job."""
    return mix64(seed & _MASK)


def positioned_uniform(key: int, position: int, stream: int) -> float:
    """The uniform in [0, 1) of draw `stream` at output `position` of the job keyed `key`."""
    z = mix64(key ^ (position & _MASK))
    return (mix64(z ^ (stream & _MASK)) >> 40) * _SCALE
