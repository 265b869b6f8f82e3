"""The GPU checks of issue 25, run by tests/test_cuda.py in a child process of their own.

A child, because the CPU tests set TRITON_INTERPRET=1 in the test process (their modules set it
at import), and Triton reads it when a kernels module is first imported: on CUDA the kernels must
be compiled, not interpreted. Each check raises AssertionError with what differed.

`python -m tests.cuda_checks` runs them all (exit 0 on success); it needs a CUDA device.
"""

from __future__ import annotations

import sys

import torch

from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobSpec
from engine.model.loader import WeightDtype, load_model
from engine.model.quantization import QuantMode
from engine.model.tokenizer import ChatMessage
from kernels.attention.backend import AttentionKind
from kernels.linear.int4_groups import Int4Groups
from kernels.linear.triton_q4_linear import TritonQ4Linear

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red.",
)
NEW_TOKENS = 24


def check_q4_matmul() -> None:
    """The Triton Q4 matmul on CUDA equals the dequantized product (random shapes, both dtypes)."""
    g = torch.Generator().manual_seed(0)
    cuda = torch.device("cuda")
    for rows, out, inp in ((1, 96, 64), (7, 576, 576), (64, 1536, 576), (300, 576, 1536)):
        w = torch.randn(out, inp, generator=g) * 0.05
        groups = Int4Groups.quantize(w)
        lin = TritonQ4Linear(groups, cuda)
        x = torch.randn(rows, inp, generator=g)
        want = x @ groups.dequantize().T
        got = lin(x.to(cuda)).cpu()
        err = float((got - want).norm() / want.norm())
        assert err < 1e-3, f"float32 {rows}x{out}x{inp}: relative error {err}"
        got_bf16 = lin(x.to(cuda, torch.bfloat16)).float().cpu()
        err = float((got_bf16 - want).norm() / want.norm())
        assert err < 2e-2, f"bfloat16 {rows}x{out}x{inp}: relative error {err}"


def greedy(device: str, attention: AttentionKind, quant: QuantMode) -> list[tuple[int, ...]]:
    loaded = load_model(
        None,
        WeightDtype.FLOAT32,
        progress=False,
        attention=attention,
        quant=quant,
        device=torch.device(device),
    )
    tok = loaded.tokenizer
    gen = DynamicGenerator(loaded.model, tok, GeneratorConfig(page_size=16, num_pages=256))
    specs = [
        JobSpec(tuple(tok.encode_chat([ChatMessage("user", p)])), NEW_TOKENS, ignore_eos=True)
        for p in PROMPTS
    ]
    try:
        return [c.token_ids for c in gen.generate(specs)]
    finally:
        gen.close()


def check_greedy_tokens() -> None:
    """The shipped model in float32 on CUDA (Triton attention; float and Triton Q4 linears) gives the
    CPU torch path's greedy tokens for prompts run together."""
    reference = greedy("cpu", AttentionKind.TORCH, QuantMode.NONE)
    on_gpu = greedy("cuda", AttentionKind.TRITON, QuantMode.NONE)
    assert on_gpu == reference, f"float linears on CUDA: {on_gpu} != {reference}"
    # The body's Q4_1 blocks are what the float path dequantizes: the same weights, 4-bit on the GPU.
    q4 = greedy("cuda", AttentionKind.TRITON, QuantMode.INT4)
    agree = sum(a == b for a, b in zip(q4, reference, strict=True))
    assert agree >= len(PROMPTS) - 1, f"Triton Q4 linears on CUDA: {q4} vs {reference}"


CHECKS = (check_q4_matmul, check_greedy_tokens)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    for check in CHECKS:
        check()
        print(f"{check.__name__}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
