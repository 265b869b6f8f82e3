"""LoRA adapters made by peft itself for tests: random non-zero B (peft starts B at zero, which
would test nothing), saved as peft saves them."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def save_peft_adapter(
    base: Any,
    folder: Path,
    r: int,
    alpha: int,
    targets: Sequence[str],
    seed: int,
    use_rslora: bool = False,
    alpha_pattern: dict[str, int] | None = None,
    scale: float = 0.05,
) -> Any:
    """Wrap a copy of the transformers model `base` in a peft LoRA, randomize its A and B, save it
    to `folder` and return the peft model (the reference forward)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        alpha_pattern=alpha_pattern or {},
        lora_dropout=0.0,
    )
    model = get_peft_model(copy.deepcopy(base), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(str(folder))
    return model.eval()
