"""Pick the fastest linear kind per weight shape, measured once per machine.

No kind wins everywhere: on an AVX2-only CPU dynamic int8 wins a decode step and
float32 may win a 64-row step, and on a CPU with native bfloat16 the order changes
again. So at load each distinct weight shape is timed with every allowed kind at a
few step sizes (rows per call: 1, 8, 64). A weight then runs one kind at every step
size: kinds round apart (an int8 re-encoding of a 4-bit weight is not the same
weight), and a job's tokens must not depend on how many rows its step had, or a
verified draft, a prefilled prompt and a resumed job would give other tokens than
plain decoding. (Mixed per bucket, this machine's tuning once put int8_q8 on the
64-row gate/up and int4_q8 elsewhere, and n-gram speculation changed 6 of 7 greedy
outputs.) Where the buckets' winners differ, the kind that loses least summed over
the buckets, each relative to its bucket's fastest, runs them all. Choices are
cached as JSON, keyed by the CPU's features, the torch version and the model, so a
second start measures nothing.
"""

from __future__ import annotations

import functools
import os
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cache_dir import keyed_file, read_keyed, write_json
from kernels.cpu_features import CpuFeatures
from kernels.linear.linear_kind import Linear, LinearKind
from kernels.native.native_library import source_digest

BUCKETS = (1, 8, 64)
_CALLS = 5  # timed calls per (kind, bucket); the best one counts


def bucket(rows: int) -> int:
    """The bucket whose choice serves a call of `rows` rows: the smallest bucket >= rows."""
    for b in BUCKETS:
        if rows <= b:
            return b
    return BUCKETS[-1]


@dataclass(frozen=True)
class TuneKey:
    """What the timings depend on: the CPU, the torch build, the model, the allowed kinds."""

    cpu: str
    torch_version: str
    model: str
    kinds: tuple[str, ...]
    method: str = "cold-cache-3/saving-0.2/one-kind"  # how `measure` times and `choose` picks; a change invalidates old choices
    native_source: str = ""  # digest of the native kernels' source when native kinds compete

    @staticmethod
    def make(cpu: CpuFeatures, model: str, kinds: Sequence[LinearKind], gpu: str | None = None) -> TuneKey:
        """`gpu`: the GPU the linears run on (its name and capability), which then keys the timings
        instead of the CPU."""
        native = bool({LinearKind.INT4_Q8, LinearKind.INT8_Q8} & set(kinds))
        return TuneKey(
            f"gpu|{gpu}" if gpu is not None else cpu.identity,
            torch.__version__,
            model,
            tuple(k.value for k in kinds),
            native_source=_native_source_digest() if native else "",
        )

    def path(self, folder: Path | None) -> Path:
        return keyed_file(folder, "linear-autotune", self.__dict__)

    def file_name(self) -> str:
        return self.path(Path()).name


def _native_source_digest() -> str:
    """A new kernel source changes the timings: choices made for the old one are not reused."""
    return source_digest()


Choice = dict[int, LinearKind]  # bucket -> kind


class TuneCache:
    """Choices per weight shape and candidate kinds, one JSON file per key."""

    def __init__(self, key: TuneKey, folder: Path | None = None) -> None:
        self.key = key
        self.path = key.path(folder)
        self.hit = False
        self._choices: dict[str, Choice] = {}
        data = read_keyed(self.path, key.__dict__)
        choices = data.get("choices") if data is not None else None
        try:
            if isinstance(choices, dict):
                self._choices = {
                    shape: {int(b): LinearKind(k) for b, k in by_bucket.items()}
                    for shape, by_bucket in choices.items()
                }
                self.hit = True
        except (ValueError, TypeError, AttributeError):
            pass  # unreadable: measure again

    @staticmethod
    def shape_name(out_features: int, in_features: int, kinds: Sequence[LinearKind]) -> str:
        """The entry for a weight shape tuned among `kinds` (the head may allow other kinds)."""
        return f"{out_features}x{in_features} " + ",".join(k.value for k in kinds)

    def get(self, shape: str) -> Choice | None:
        return self._choices.get(shape)

    def put(self, shape: str, choice: Choice) -> None:
        self._choices[shape] = choice

    def save(self) -> None:
        data = {
            "key": self.key.__dict__,
            "choices": {s: {str(b): k.value for b, k in c.items()} for s, c in self._choices.items()},
        }
        write_json(self.path, data)


_EVICT_FALLBACK = 64 << 20  # where the OS does not say: more than the caches of the CPUs we run on


def _cache_bytes(index_dir: Path) -> int:
    """A cache's size from its sysfs folder ("32768K"), 0 where unreadable."""
    try:
        text = (index_dir / "size").read_text().strip()
    except OSError:
        return 0
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
    except ValueError:
        return 0


def evict_bytes(cache_root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Bytes to write between timed calls so that no weight is left in any cache: the caches one
    core sees, summed, and a quarter more. Filling 64 MiB before each of the ~165 timed calls of
    a first start took 0.8 s; this CPU's 32 MiB L3 and 1 MiB L2 ask for 42 MiB."""
    sizes = [_cache_bytes(d) for d in sorted(cache_root.glob("index*"))]
    total = sum(sizes)
    return total + total // 4 if total > 0 else _EVICT_FALLBACK


_CPU = torch.device("cpu")


@functools.cache
def _evictor(device: torch.device = _CPU) -> torch.Tensor:
    """What a timed call's predecessor writes to leave no weight in any cache: more than the CPU's
    caches, or on a GPU more than its L2 (50 MiB on an H100; 256 MiB covers every GPU we know)."""
    size = evict_bytes() if device.type == "cpu" else 256 << 20
    return torch.empty(size // 4, dtype=torch.float32, device=device)


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU runs calls asynchronously; the CPU needs nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Timings this close count as a tie, broken by weight bytes. Wider at one row, where a linear in
# a forward is bound by streaming its weight: cold lone calls there vary by +-30% run to run.
BYTES_MARGIN = 0.15
BYTES_MARGIN_ONE_ROW = 0.5
# A slower kind wins on bytes only when it saves at least this share of them: between kinds of
# near-equal bytes the timing decides (the head's int8_weight, 6% fewer bytes than int8_q8, won
# one-row ties and made single stream 10% slower: 345 against 383 tok/s, Zen 5).
BYTES_SAVING = 0.2


def measure(candidates: Mapping[LinearKind, Linear], device: torch.device = _CPU) -> Choice:
    """Time every candidate (same weight, on `device`) at each bucket's row count; the kind that
    runs every bucket (`one_kind`).

    Each timed call starts with cold caches: in a forward the model's weights stream from
    memory (30 layers do not fit in cache), and a weight left in cache by the previous
    call would favour the kinds with the most bytes.
    """
    first = next(iter(candidates.values()))
    times: dict[int, dict[LinearKind, float]] = {}
    winners: dict[int, LinearKind] = {}
    weight_bytes = {k: lin.weight_bytes() for k, lin in candidates.items()}
    for rows in BUCKETS:
        x = torch.randn(rows, first.in_features, device=device)
        best: dict[LinearKind, float] = {}
        for lin in candidates.values():
            lin(x)  # warm-up: first calls allocate, pack and compile
        for _ in range(_CALLS):
            for kind, lin in candidates.items():  # kinds take turns, so load spikes hit all alike
                _evictor(device).fill_(0.0)
                _sync(device)
                t0 = time.perf_counter()
                lin(x)
                _sync(device)
                best[kind] = min(best.get(kind, float("inf")), time.perf_counter() - t0)
        times[rows], winners[rows] = best, choose(best, weight_bytes, rows)
    kind = one_kind(times, winners)
    return {rows: kind for rows in BUCKETS}


def one_kind(
    times: Mapping[int, Mapping[LinearKind, float]], winners: Mapping[int, LinearKind]
) -> LinearKind:
    """The kind that runs every bucket: the buckets' winner where they agree; else, of their
    winners, the one with the least slowdown summed over the buckets (each time over its
    bucket's fastest), fewer winning buckets losing a tie."""
    kinds = list(dict.fromkeys(winners.values()))
    if len(kinds) == 1:
        return kinds[0]

    def loss(kind: LinearKind) -> tuple[float, int]:
        slowdown = sum(t[kind] / min(t.values()) for t in times.values())
        return slowdown, -sum(1 for w in winners.values() if w is kind)

    return min(kinds, key=loss)


def choose(
    seconds: Mapping[LinearKind, float], weight_bytes: Mapping[LinearKind, int], rows: int
) -> LinearKind:
    """The kind to run at `rows` rows given each kind's best time: the fastest, except that within
    the margin a kind with far fewer weight bytes (BYTES_SAVING) wins. A lone call times a weight in isolation, but in a forward
    every layer's weights stream from memory one after another, so bytes cost more there than
    here (measured: cold single calls picked int8 kinds at one row where int4_q8 made the whole
    decode step 15% faster)."""
    fastest = min(seconds, key=lambda k: seconds[k])
    margin = BYTES_MARGIN_ONE_ROW if rows == 1 else BYTES_MARGIN
    close = [
        k
        for k in seconds
        if k is fastest
        or (
            seconds[k] <= seconds[fastest] * (1 + margin)
            and weight_bytes[k] <= weight_bytes[fastest] * (1 - BYTES_SAVING)
        )
    ]
    return min(close, key=lambda k: (weight_bytes[k], seconds[k]))


class TunedLinear:
    """One weight in the kinds that won some bucket; each call goes to its bucket's winner."""

    def __init__(self, by_bucket: Mapping[int, Linear]) -> None:
        self._by_bucket = dict(by_bucket)
        first = self._by_bucket[BUCKETS[0]]
        self.in_features = first.in_features
        self.out_features = first.out_features

    @property
    def kind(self) -> LinearKind:
        """The kind a decode step (one row per sequence, few sequences) runs."""
        return self._by_bucket[BUCKETS[0]].kind

    def describe(self) -> str:
        kinds = [self._by_bucket[b].describe() for b in BUCKETS]
        if len(set(kinds)) == 1:
            return kinds[0]
        return "tuned(" + " ".join(f"{b}:{k}" for b, k in zip(BUCKETS, kinds, strict=True)) + ")"

    def weight_bytes(self) -> int:
        return sum(lin.weight_bytes() for lin in {id(v): v for v in self._by_bucket.values()}.values())

    def bucket_linears(self) -> list[Linear]:
        """Each bucket's winner, once."""
        return list({id(v): v for v in self._by_bucket.values()}.values())

    def for_rows(self, rows: int) -> Linear:
        """The linear a call with `rows` rows runs."""
        return self._by_bucket[bucket(rows)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        return self._by_bucket[bucket(rows)](x)


# Other processes may use this share of the CPU while we time, or the choices are not kept.
BUSY_SHARE = 0.25


def _cpu_seconds() -> tuple[float, float]:
    """(CPU seconds used by the whole machine, by this process) so far; machine time is 0 off Linux."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        busy = sum(int(v) for i, v in enumerate(fields) if i not in (3, 4))  # all but idle and iowait
        machine = busy / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        machine = 0.0
    return machine, own.ru_utime + own.ru_stime


class BusyMeter:
    """The share of the machine's CPUs that other processes used between start and `share()`."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self._machine0, self._own0 = _cpu_seconds()

    def share(self) -> float:
        machine, own = _cpu_seconds()
        wall = max(time.monotonic() - self._t0, 1e-9)
        others = max(machine - self._machine0 - (own - self._own0), 0.0)
        return others / (wall * (os.cpu_count() or 1))


class LinearTuner:
    """Builds tuned linears at load: one measurement per distinct shape, the rest from the cache.

    Timings taken while other processes keep the CPU busy pick kinds at random (measured: a
    loaded machine cached float32 for one-row steps where int4_q8 is 3.8x faster idle), so
    such choices serve this load only and are not written; the next start measures again.
    """

    def __init__(self, cache: TuneCache, device: torch.device = _CPU) -> None:
        self.cache = cache
        self.device = device  # where the candidates run and are timed
        self.measured = 0  # shapes timed in this load (0 on a cache hit)
        self.busy_share = 0.0  # other processes' share of the CPU while this load measured
        self._meter: BusyMeter | None = None

    def build(
        self, kinds: Sequence[LinearKind], make: Callable[[LinearKind], Linear], shape: tuple[int, int]
    ) -> Linear:
        """A linear over the weight [out, in] = `shape` that `make` builds in any kind; one kind
        alone is built plainly. On a cached choice only the chosen kinds are built (each kind
        costs a quantization or a float copy); otherwise every candidate, to be measured."""
        if len(kinds) == 1:
            return make(kinds[0])
        name = TuneCache.shape_name(shape[0], shape[1], kinds)
        choice = self.cache.get(name)
        if choice is not None and set(choice) == set(BUCKETS):
            try:
                chosen = {k: make(k) for k in dict.fromkeys(choice.values())}
                return TunedLinear({b: chosen[choice[b]] for b in BUCKETS})
            except ValueError:
                pass  # a chosen kind cannot hold this weight after all: measure again
        candidates: dict[LinearKind, Linear] = {}
        for k in kinds:
            try:
                candidates[k] = make(k)
            except ValueError:
                continue  # a shape this kind cannot hold (e.g. inputs not in groups of 32): not a candidate
        if not candidates:
            return make(kinds[0])  # raises the first kind's error
        if len(candidates) == 1:
            return next(iter(candidates.values()))
        self._meter = self._meter or BusyMeter()
        choice = measure(candidates, self.device)
        self.cache.put(name, choice)
        self.measured += 1
        return TunedLinear({b: candidates[choice[b]] for b in BUCKETS})

    @property
    def kept(self) -> bool:
        """Whether this load's measurements were quiet enough to cache."""
        return self.busy_share <= BUSY_SHARE

    def finish(self) -> None:
        """Write what was measured (nothing on a full cache hit, nor when the machine was busy)."""
        if self._meter is not None:
            self.busy_share = self._meter.share()
        if self.measured and self.kept:
            self.cache.save()
