"""JobBuilder: a checked JobSpec -> the JobState the engine runs (its rows, sampler, text stream,
grammar, token healing and prompt embeddings), built once at enqueue."""

from __future__ import annotations

import dataclasses
import time

import torch

from engine.adapters.lora_adapter import LoraAdapter
from engine.errors import InvalidRequestError
from engine.grammar.constraints import GrammarCompiler
from engine.guided_pair import negative_sequence
from engine.job_state import JobState
from engine.jobs import JobId, JobSpec
from engine.model.tokenizer import Tokenizer
from engine.output.text_stream import TextStream
from engine.output.token_healing import TokenHealer
from engine.prompt.prompt_embeddings import span_token_ids
from engine.sampling.sampler import SamplerState


class JobBuilder:
    def __init__(
        self,
        tokenizer: Tokenizer,
        grammars: GrammarCompiler,
        healer: TokenHealer,
        vocab_size: int,
        hidden_size: int,
    ) -> None:
        self._tokenizer = tokenizer
        self._grammars = grammars
        self._healer = healer
        self._vocab_size = vocab_size
        self._hidden_size = hidden_size

    def build(self, spec: JobSpec, job_id: JobId, adapter: LoraAdapter | None) -> JobState:
        """The job for a spec that passed JobSpec.check; InvalidRequestError for what only the
        engine sees (a schema that does not compile, prompt embeddings that are not finite)."""
        # Compiled (or taken from the cache) here: a bad schema is the caller's error, at enqueue.
        constraint = (
            self._grammars.compile(spec.response_format) if spec.response_format is not None else None
        )
        heal = self._healer.plan(spec.prompt_ids) if spec.token_healing else None
        if heal is not None:  # the job runs on the prompt less its last token
            spec = dataclasses.replace(spec, prompt_ids=heal.prompt_ids)
        embeds = self._embedding_spans(spec) if spec.embeddings else ()
        tokens = list(spec.prompt_ids)
        # Prompt embeddings' positions take pseudo ids, which the prefix cache hashes like tokens.
        for e in spec.embeddings:
            tokens[e.position : e.end] = span_token_ids(e)
        return JobState(
            job_id=job_id,
            spec=spec,
            sampler=SamplerState(spec.sampling, spec.prompt_ids, self._vocab_size),
            text=TextStream(
                self._tokenizer,
                spec.stop_strings,
                not spec.decode_special_tokens,
                spec.banned_strings,
                heal.removed_text if heal is not None else "",
            ),
            enqueued_at=time.perf_counter(),
            order=0,
            tokens=tokens,
            constraint=constraint,
            heal=heal,
            healing=heal.removed if heal is not None else b"",
            adapter=adapter,
            embeds=embeds,
            negative=None
            if spec.guidance is None
            else negative_sequence(spec, None if adapter is None else adapter.uid),
        )

    def _embedding_spans(self, spec: JobSpec) -> tuple[tuple[int, torch.Tensor], ...]:
        """The job's prompt embeddings as tensors, by start position."""
        spans = []
        for i, e in enumerate(spec.embeddings):
            values = torch.frombuffer(bytearray(e.data), dtype=torch.float32).view(e.rows, self._hidden_size)
            if not bool(torch.isfinite(values).all()):
                raise InvalidRequestError(
                    f"embeddings[{i}].data: holds values that are not finite (NaN or inf)",
                    f"embeddings[{i}].data",
                )
            spans.append((e.position, values))
        return tuple(spans)
