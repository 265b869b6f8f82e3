"""Command-line flags for speculative decoding, shared by `dyngen generate` and `dyngen serve`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError
from engine.speculation.speculation_config import DrafterKind, SpeculationConfig
from service.config import SPECULATE_AUTO, SPECULATE_KINDS, WEIGHT_DTYPES, whole
from service.engine_config import SpeculationFlags

# The model code (and torch) is imported only where a model is loaded: `dyngen serve` builds its
# command line, flags included, in the front-end process, which never imports torch.
if TYPE_CHECKING:
    import torch

    from engine.model.llama import LlamaModel
    from engine.model.loader import WeightDtype


@dataclass(frozen=True)
class SpeculationOptions:
    config: SpeculationConfig
    draft_model: Path | None  # None: the target model's own file
    draft_layers: int | None  # keep only the draft's first layers (None: all)
    draft_dtype: WeightDtype
    where_exact: bool = False  # `auto`: drafts only for a model whose steps are row-invariant

    def resolved(self, row_invariant: bool) -> SpeculationOptions:
        """These options for the loaded model: `auto` turns drafting off where a token's logits
        depend on how many rows its step carries (float linears: BLAS rounds apart by row count),
        since drafts change those counts and so, on near ties, the tokens."""
        if not self.where_exact or row_invariant:
            return self
        return replace(self, config=replace(self.config, kind=DrafterKind.NONE))

    def load_draft(
        self, target: Path | None, progress: bool, device: torch.device | None = None
    ) -> LlamaModel | None:
        if self.config.kind is not DrafterKind.DRAFT_MODEL:
            return None
        from engine.model.loader import load_model
        from engine.model.shipped_model import default_model_path

        path = self.draft_model or target or default_model_path()
        return load_model(
            path, self.draft_dtype, progress=progress, num_layers=self.draft_layers, device=device
        ).model


def add_speculation_arguments(parser: argparse.ArgumentParser, action: type[argparse.Action]) -> None:
    """`dyngen generate`'s speculation flags (serve has its own), each stored by `action`."""
    d = SpeculationFlags()
    g = parser.add_argument_group("speculative decoding")

    def arg(*names: str, **options: Any) -> None:
        g.add_argument(*names, action=action, **options)

    arg(
        "--speculate",
        choices=SPECULATE_KINDS,
        default=d.speculate,
        help="drafter kind (auto: ngram where speculation changes no token, as with the block linears "
        "of --quant auto on the CPU; else none)",
    )
    arg(
        "--num-draft-tokens",
        type=whole(1),
        default=d.num_draft_tokens,
        help="the most draft tokens a job verifies per step (each job's own length adapts below it)",
    )
    arg(
        "--step-draft-tokens",
        type=whole(1),
        default=d.step_draft_tokens,
        help="the most draft tokens one step verifies over all its jobs (bounds the rows drafts add to a step)",
    )
    arg("--max-ngram", type=whole(1), default=d.max_ngram, help="longest suffix the n-gram drafter matches")
    arg(
        "--speculate-max-batch",
        type=whole(0),
        default=d.speculate_max_batch,
        help="no speculation with more running jobs than this",
    )
    arg("--draft-model", type=Path, default=None, help="draft model file (default: the target's)")
    arg("--draft-layers", type=whole(0), default=None, help="keep only the draft's first N layers")
    arg("--draft-dtype", choices=WEIGHT_DTYPES, default=d.draft_dtype)


def speculation_options(
    kind: str,
    num_draft_tokens: int,
    step_draft_tokens: int,
    max_ngram: int,
    max_batch: int,
    draft_model: str | None,
    draft_layers: int | None,
    draft_dtype: str,
) -> SpeculationOptions:
    """Validated options from flag values (shared by `dyngen generate` and `dyngen serve`)."""
    from engine.model.loader import WeightDtype

    auto = kind == SPECULATE_AUTO
    drafter = DrafterKind.NGRAM if auto else DrafterKind(kind)
    same_as_target = draft_model is None and not draft_layers
    if drafter is DrafterKind.DRAFT_MODEL and same_as_target and draft_dtype == WeightDtype.FLOAT32.value:
        raise InvalidRequestError(
            "--speculate draft_model needs a cheaper draft: --draft-model, --draft-layers or --draft-dtype bfloat16"
        )
    return SpeculationOptions(
        SpeculationConfig(
            drafter,
            num_draft_tokens=num_draft_tokens,
            step_draft_tokens=step_draft_tokens,
            max_ngram=max_ngram,
            max_batch_size=max_batch,
        ),
        Path(draft_model) if draft_model else None,
        draft_layers or None,
        WeightDtype(draft_dtype),
        where_exact=auto,
    )


def options_from_flags(f: SpeculationFlags) -> SpeculationOptions:
    """Validated options from the flags an engine process is handed (EngineConfig.speculation)."""
    return speculation_options(
        f.speculate,
        f.num_draft_tokens,
        f.step_draft_tokens,
        f.max_ngram,
        f.speculate_max_batch,
        f.draft_model,
        f.draft_layers,
        f.draft_dtype,
    )


def speculation_from_args(args: argparse.Namespace) -> SpeculationOptions:
    return speculation_options(
        args.speculate,
        args.num_draft_tokens,
        args.step_draft_tokens,
        args.max_ngram,
        args.speculate_max_batch,
        None if args.draft_model is None else str(args.draft_model),
        args.draft_layers,
        args.draft_dtype,
    )
