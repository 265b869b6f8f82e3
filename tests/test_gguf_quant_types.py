"""GGUF files in every common tensor type load through GGUFSource and match transformers.

Tiny random-weight Llamas (tests/tiny_gguf.py) are written as llama.cpp writes them, one
file per tensor type, and checked three ways: the loader hands back exactly the values the
file stores, in the Hugging Face layout; those values are close to the weights before
quantization (so the block layouts and the rotary un-permutation are right); and the
model's logits over the paged cache match transformers loading the same file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.model.gguf_source import GGUFSource
from engine.model.llama import LlamaModel
from engine.model.loader import load_model, open_weight_source
from tests.reference_generate import GenerationSettings, generate_batch
from tests.tiny_gguf import (
    QType,
    TinyLlamaSpec,
    random_llama_weights,
    stored_values,
    write_tiny_gguf,
)

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SPEC = TinyLlamaSpec()
TYPES = (QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q6_K)

# Root-mean-square error of the stored weights relative to the weights' own RMS, per type,
# with headroom over what round-to-nearest gives on Gaussian weights (F16 2e-4, BF16 1.7e-3,
# Q8_0 5e-3, Q4_0 8.6e-2, Q4_1 and Q4_K 7.8e-2, Q6_K 1.9e-2). A block read with the wrong
# layout or a row order left permuted comes out near 1.4.
MAX_RELATIVE_ERROR = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 5e-3,
    "Q8_0": 1e-2,
    "Q4_0": 0.12,
    "Q4_1": 0.11,
    "Q4_K": 0.11,
    "Q6_K": 0.03,
}
LOGIT_TOLERANCE = 1e-3
PROMPT = [5, 77, 300, 12, 451, 9, 260, 33, 140, 499, 17, 288, 64]
NEW_TOKENS = 8


def _write(folder: Path, qtype: QType, tied: bool) -> Path:
    path = folder / f"tiny-{qtype.name.lower()}{'-tied' if tied else ''}.gguf"
    weights = random_llama_weights(SPEC, seed=0, tied=tied)
    write_tiny_gguf(path, weights, SPEC, qtype)
    return path


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_loader_returns_stored_values(tmp_path: Path, qtype: QType) -> None:
    weights = random_llama_weights(SPEC, seed=0, tied=False)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, weights, SPEC, qtype)

    source = GGUFSource(path)
    c = source.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (512, 256, 512)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 64)
    # GGUF stores these as float32.
    assert c.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert (c.rope_theta, c.max_position_embeddings) == (10000.0, 256)
    assert (c.tie_word_embeddings, c.bos_token_id, c.eos_token_ids) == (False, 1, (2,))
    assert c.name == f"tiny-llama-{qtype.name.lower()}"

    loaded = dict(source.tensors())
    assert source.tensor_count() == len(loaded) == len(weights)
    assert set(loaded) == set(weights)
    for name, original in weights.items():
        got = loaded[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == original.shape, name
        kind = QType.F32 if original.ndim == 1 else qtype
        # Exactly what the file holds, un-permuted back to the HF row order...
        expected = torch.from_numpy(stored_values(original, kind))
        assert torch.equal(got, expected), name
        # ...which is the original weight up to the type's rounding.
        rel = float(np.sqrt(np.mean((got.numpy() - original) ** 2)) / np.sqrt(np.mean(original**2)))
        assert rel <= MAX_RELATIVE_ERROR[kind.name], f"{name}: relative RMS error {rel:.3g}"


CASES = [(t, False) for t in TYPES] + [(QType.F16, True), (QType.Q8_0, True), (QType.Q4_K, True)]


@pytest.mark.parametrize(
    ("qtype", "tied"), CASES, ids=[f"{t.name}-{'tied' if tied else 'untied'}" for t, tied in CASES]
)
def test_logits_match_transformers(
    tmp_path: Path, qtype: QType, tied: bool, record_property: Callable[[str, object], None]
) -> None:
    path = _write(tmp_path, qtype, tied)

    source = open_weight_source(path)
    assert isinstance(source, GGUFSource)
    assert source.config.tie_word_embeddings is tied
    ours = LlamaModel.from_source(source, progress=False)
    # Small pages and prefill chunks, so the prompt spans pages and several forwards.
    cache = ours.new_cache(num_pages=8, page_size=4)
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True, max_chunk_tokens=5)
    (result,) = generate_batch(ours, cache, [PROMPT], settings, keep_logits=True)
    assert len(result.token_ids) == len(result.step_logits) == NEW_TOKENS

    ref: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    assert ref.config.tie_word_embeddings is tied
    with torch.inference_mode():
        ref_logits = ref(torch.tensor([PROMPT + list(result.token_ids)])).logits[0].float()

    worst = 0.0
    for i, ours_logits in enumerate(result.step_logits):
        theirs = ref_logits[len(PROMPT) - 1 + i]  # the logits that chose generated token i
        assert int(torch.argmax(theirs)) == result.token_ids[i], f"greedy token {i} differs"
        worst = max(worst, float((ours_logits - theirs).abs().max()))
    record_property("max_logit_diff", worst)
    print(f"{qtype.name} {'tied' if tied else 'untied'}: max |logit diff| = {worst:.3g}")
    assert worst < LOGIT_TOLERANCE


@pytest.mark.parametrize("qtype", [QType.Q8_K, QType.Q8_1], ids=["Q8_K", "Q8_1"])
def test_unsupported_tensor_type_is_named(tmp_path: Path, qtype: QType) -> None:
    path = tmp_path / "odd.gguf"
    weights = random_llama_weights(SPEC, seed=0, tied=False)
    write_tiny_gguf(path, weights, SPEC, QType.Q8_0, overrides={"blk.1.ffn_down.weight": qtype})
    with pytest.raises(UnsupportedModelError) as info:
        open_weight_source(path)
    message = str(info.value)
    assert "blk.1.ffn_down.weight" in message
    assert qtype.name in message
    assert "Q4_K" in message  # the supported types are listed


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2ish.gguf"
    weights = random_llama_weights(SPEC, seed=0, tied=True)
    write_tiny_gguf(path, weights, SPEC, QType.F32, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        open_weight_source(path)


def test_junk_file_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a GGUF file\n" * 64)
    with pytest.raises(ModelFormatError, match=r"junk\.gguf"):
        open_weight_source(path)


def test_truncated_file_is_a_format_error(tmp_path: Path) -> None:
    whole = _write(tmp_path, QType.Q8_0, tied=True)
    path = tmp_path / "truncated.gguf"
    data = whole.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match=r"truncated\.gguf"):
        open_weight_source(path)


def test_load_model_with_its_tokenizer(tmp_path: Path) -> None:
    path = _write(tmp_path, QType.Q4_K, tied=False)
    loaded = load_model(path, progress=False)
    assert loaded.model.config.vocab_size == loaded.tokenizer.vocab_size == SPEC.vocab_size
    assert loaded.tokenizer.eos_token_ids == frozenset({SPEC.eos_token_id})
    ids = loaded.tokenizer.encode("the cat sat on the mat", add_special_tokens=False)
    assert loaded.tokenizer.decode(ids) == "the cat sat on the mat"
    assert all(0 <= i < SPEC.vocab_size for i in ids)
