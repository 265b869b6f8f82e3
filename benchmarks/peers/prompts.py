"""The token ids every engine of the peers benchmark gets: one rendering, shared as a JSON file.

Prompts are rendered once with dyngen's tokenizer and chat template, so that no engine's own
template or tokenizer can make its prompts longer or shorter than the others'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.workloads import load_workloads
from engine.model.tokenizer import ChatMessage, HFTokenizer

# 512, not 128: 128 tokens are about half a second here, and two rounds of one run measured 113 and
# 142 tok/s on an AVX2 part; 512 keeps the same prompt and takes ~2 s at 250 tok/s.
SINGLE_NEW_TOKENS = 512
# W1 sampled: nucleus sampling as chat clients ask for it, request i seeded with i. No other filter
# (each engine's defaults, such as llama.cpp's top_k 40 and min_p 0.05, are turned off).
SAMPLED_TEMPERATURE = 0.8
SAMPLED_TOP_P = 0.95


@dataclass(frozen=True)
class Workload:
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    ignore_eos: bool
    temperature: float = 0.0  # 0: greedy; else request i samples with seed i
    top_p: float = 1.0

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def to_json(self) -> dict[str, object]:
        return {
            "prompts": [list(p) for p in self.prompts],
            "max_new_tokens": self.max_new_tokens,
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }

    @staticmethod
    def from_json(data: dict[str, object]) -> Workload:
        prompts = data["prompts"]
        assert isinstance(prompts, list)
        return Workload(
            tuple(tuple(int(t) for t in p) for p in prompts),
            int(str(data["max_new_tokens"])),
            bool(data["ignore_eos"]),
            float(str(data.get("temperature", 0.0))),
            float(str(data.get("top_p", 1.0))),
        )

    def describe(self) -> str:
        lengths = sorted(len(p) for p in self.prompts)
        span = f"{lengths[0]}" if lengths[0] == lengths[-1] else f"{lengths[0]}-{lengths[-1]}"
        eos = "EOS ignored" if self.ignore_eos else "stops at EOS"
        count = (
            f"{len(self.prompts)} x {span}-token prompts"
            if len(self.prompts) > 1
            else f"a {span}-token prompt"
        )
        sampling = (
            f", temperature {self.temperature:g}, top_p {self.top_p:g}, a seed per request"
            if self.sampled
            else ""
        )
        return f"{count}, {self.max_new_tokens} new tokens, {eos}{sampling}"


@dataclass(frozen=True)
class PeerPrompts:
    w1: Workload  # all at once: generated tokens / wall seconds
    single: Workload  # one stream: decode tokens per second
    w2: Workload  # all at once on a cold cache: wall seconds
    w1s: Workload  # W1 sampled: generated tokens / wall seconds

    @staticmethod
    def build(model: Path, workloads: Path | None) -> PeerPrompts:
        tokenizer = HFTokenizer(model)
        spec = load_workloads(workloads)
        w1, w2 = spec["W1"], spec["W2"]
        w1_ids = tuple(tuple(tokenizer.encode_chat([ChatMessage("user", m)])) for m in w1["user_messages"])
        system = ChatMessage("system", w2["system_message"])
        w2_ids = tuple(
            tuple(tokenizer.encode_chat([system, ChatMessage("user", q)])) for q in w2["user_messages"]
        )
        w1_part = Workload(w1_ids, int(w1["max_new_tokens"]), bool(w1["ignore_eos"]))
        return PeerPrompts(
            w1_part,
            Workload(w1_ids[:1], SINGLE_NEW_TOKENS, True),
            Workload(w2_ids, int(w2["max_new_tokens"]), bool(w2["ignore_eos"])),
            replace(w1_part, temperature=SAMPLED_TEMPERATURE, top_p=SAMPLED_TOP_P),
        )

    def parts(self) -> dict[str, Workload]:
        """The workloads by the part names the engines' children answer to."""
        return {"w1": self.w1, "w1s": self.w1s, "single": self.single, "w2": self.w2}

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({name: w.to_json() for name, w in self.parts().items()}))

    @staticmethod
    def read(path: Path) -> PeerPrompts:
        data = json.loads(path.read_text())
        w1, single, w2, w1s = (Workload.from_json(data[name]) for name in ("w1", "single", "w2", "w1s"))
        return PeerPrompts(w1, single, w2, w1s)
