"""The token ids every engine of the peers benchmark gets: one rendering, shared as a JSON file.

Prompts are rendered once with dyngen's tokenizer and chat template, so that no engine's own
template or tokenizer can make its prompts longer or shorter than the others'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.workloads import load_workloads
from engine.model.tokenizer import ChatMessage, HFTokenizer

# 512, not 128: 128 tokens are about half a second here, and two rounds of one run measured 113 and
# 142 tok/s on an AVX2 part; 512 keeps the same prompt and takes ~2 s at 250 tok/s.
SINGLE_NEW_TOKENS = 512


@dataclass(frozen=True)
class Workload:
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    ignore_eos: bool

    def to_json(self) -> dict[str, object]:
        return {
            "prompts": [list(p) for p in self.prompts],
            "max_new_tokens": self.max_new_tokens,
            "ignore_eos": self.ignore_eos,
        }

    @staticmethod
    def from_json(data: dict[str, object]) -> Workload:
        prompts = data["prompts"]
        assert isinstance(prompts, list)
        return Workload(
            tuple(tuple(int(t) for t in p) for p in prompts),
            int(str(data["max_new_tokens"])),
            bool(data["ignore_eos"]),
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
        return f"{count}, {self.max_new_tokens} new tokens, {eos}"


@dataclass(frozen=True)
class PeerPrompts:
    w1: Workload  # all at once: generated tokens / wall seconds
    single: Workload  # one stream: decode tokens per second
    w2: Workload  # all at once on a cold cache: wall seconds

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
        return PeerPrompts(
            Workload(w1_ids, int(w1["max_new_tokens"]), bool(w1["ignore_eos"])),
            Workload(w1_ids[:1], SINGLE_NEW_TOKENS, True),
            Workload(w2_ids, int(w2["max_new_tokens"]), bool(w2["ignore_eos"])),
        )

    def write(self, path: Path) -> None:
        parts = {"w1": self.w1, "single": self.single, "w2": self.w2}
        path.write_text(json.dumps({name: w.to_json() for name, w in parts.items()}))

    @staticmethod
    def read(path: Path) -> PeerPrompts:
        data = json.loads(path.read_text())
        return PeerPrompts(
            Workload.from_json(data["w1"]), Workload.from_json(data["single"]), Workload.from_json(data["w2"])
        )
