"""The serving benchmark's traffic: seeded requests (token ids, output length) and Poisson arrivals.

Every engine gets the same token ids, rendered once with dyngen's tokenizer and chat template
(as the peers benchmark does), and the same arrival times. Texts come from workloads.json and
from records generated here; nothing is fetched.

- chat: short questions (W1's), questions over a ~1k-token shared system prompt (W2's), and
  long prompts of their own (a passage of W2's story from a random sentence, to summarize);
  outputs log-normal around 128 tokens, clipped to 32-512.
- editing: rewrite a JSON document with one change; the output is about the document's length,
  so most of it copies spans of the prompt (where speculation from the prompt pays).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from benchmarks.workloads import load_workloads
from engine.model.tokenizer import ChatMessage, Tokenizer

MIN_OUTPUT, MAX_OUTPUT = 32, 512
# The chat trace's mix: shares of short, shared-system-prompt and long-own-prompt requests.
CHAT_MIX = (("short", 0.5), ("shared", 0.25), ("long", 0.25))
TRACES = ("chat", "editing")


@dataclass(frozen=True)
class TraceRequest:
    kind: str  # which part of the mix it is
    prompt: tuple[int, ...]
    output_tokens: int  # generated exactly (EOS ignored), so every engine does the same work


@dataclass(frozen=True)
class Trace:
    name: str
    requests: tuple[TraceRequest, ...]

    def describe(self) -> str:
        prompts = sorted(len(r.prompt) for r in self.requests)
        outputs = sorted(r.output_tokens for r in self.requests)
        kinds: dict[str, int] = {}
        for r in self.requests:
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
        mix = ", ".join(f"{k} {v}" for k, v in kinds.items())
        return (
            f"{len(self.requests)} requests ({mix}); prompt tokens {prompts[0]}-{prompts[-1]} "
            f"(median {prompts[len(prompts) // 2]}), output tokens {outputs[0]}-{outputs[-1]} "
            f"(median {outputs[len(outputs) // 2]})"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "requests": [
                {"kind": r.kind, "prompt": list(r.prompt), "output_tokens": r.output_tokens}
                for r in self.requests
            ],
        }


def arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Poisson arrival offsets in seconds: the same seeded unit-rate gaps at every rate, scaled."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t / rate)
        t += rng.expovariate(1.0)
    return out


def _output_length(rng: random.Random) -> int:
    return max(MIN_OUTPUT, min(MAX_OUTPUT, round(rng.lognormvariate(math.log(128), 0.7))))


def _sentences(text: str) -> list[str]:
    parts = [s.strip() for s in text.replace("\n", " ").split(". ")]
    return [s if s.endswith(".") else s + "." for s in parts if s]


def chat_trace(tokenizer: Tokenizer, count: int, seed: int, workloads: Path | None) -> Trace:
    spec = load_workloads(workloads)
    short = [str(m) for m in spec["W1"]["user_messages"]]
    system = str(spec["W2"]["system_message"])
    questions = [str(q) for q in spec["W2"]["user_messages"]]
    sentences = _sentences(system)
    rng = random.Random(seed)
    kinds = [k for k, _ in CHAT_MIX]
    weights = [w for _, w in CHAT_MIX]
    requests = []
    for _ in range(count):
        kind = rng.choices(kinds, weights)[0]
        if kind == "short":
            messages = [ChatMessage("user", rng.choice(short))]
        elif kind == "shared":
            messages = [ChatMessage("system", system), ChatMessage("user", rng.choice(questions))]
        else:
            # A passage of 8-40 sentences from a random start (no prefix shared past the template).
            start = rng.randrange(len(sentences))
            n = rng.randint(8, 40)
            passage = " ".join(sentences[(start + i) % len(sentences)] for i in range(n))
            messages = [
                ChatMessage("user", f"Summarize the following passage in a few sentences.\n\n{passage}")
            ]
        requests.append(TraceRequest(kind, tuple(tokenizer.encode_chat(messages)), _output_length(rng)))
    return Trace("chat", tuple(requests))


_NAMES = ("Ada", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lena")
_CITIES = ("Lisbon", "Oslo", "Quito", "Accra", "Hanoi", "Perth", "Tunis", "Riga", "Lima", "Dakar")
_TAGS = ("new", "vip", "late", "paid", "trial", "beta", "eu", "us", "asia", "gold")


def _document(rng: random.Random) -> list[dict[str, object]]:
    return [
        {
            "id": rng.randint(1000, 9999),
            "name": rng.choice(_NAMES),
            "city": rng.choice(_CITIES),
            "score": round(rng.uniform(0, 100), 1),
            "tags": rng.sample(_TAGS, rng.randint(1, 3)),
        }
        for _ in range(rng.randint(3, 9))
    ]


def editing_trace(tokenizer: Tokenizer, count: int, seed: int) -> Trace:
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        records = _document(rng)
        target = rng.randrange(len(records))
        city = rng.choice(_CITIES)
        text = json.dumps(records, indent=2)
        ask = (
            f"Rewrite this JSON exactly as it is, except that the record with id {records[target]['id']} "
            f'gets "city": "{city}". Output only the JSON.\n\n{text}'
        )
        prompt = tuple(tokenizer.encode_chat([ChatMessage("user", ask)]))
        body = len(tokenizer.encode(text))
        requests.append(TraceRequest("edit-json", prompt, max(MIN_OUTPUT, min(MAX_OUTPUT, body + 8))))
    return Trace("editing", tuple(requests))


def build(name: str, tokenizer: Tokenizer, count: int, seed: int, workloads: Path | None) -> Trace:
    if name == "chat":
        return chat_trace(tokenizer, count, seed, workloads)
    if name == "editing":
        return editing_trace(tokenizer, count, seed)
    raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACES)}")
