"""--quant modes on tiny GGUF models: the file's 4-bit blocks kept as stored, every mode generates.

The first-step logits of each mode are compared with the float path (relative error of
the logit vector, bounds with headroom over what these models give: int8 ~3%, int4 on
a Q4_1 file ~1% since its weights are the file's own and only bfloat16 activations
and the int8 head differ).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.gguf_source import GGUFSource
from engine.model.llama import LlamaModel
from engine.model.loader import load_model
from engine.model.quantization import LinearPlan, LinearRole, QuantMode, plan_for
from kernels.cpu_features import cpu_features
from kernels.linear.make_linear import LinearKind
from kernels.native.native_library import native_library, native_unavailable_reason
from tests.reference_generate import GenerationSettings, generate_batch
from tests.tiny_gguf import QType, TinyLlamaSpec, random_llama_weights, write_tiny_gguf

SPEC = TinyLlamaSpec()
PROMPT = [5, 77, 300, 12, 451, 9, 260, 33, 140, 499, 17]
NEW_TOKENS = 6
MAX_LOGIT_ERROR = {QuantMode.NONE: 0.0, QuantMode.AUTO: 0.06, QuantMode.INT8: 0.06, QuantMode.INT4: 0.03}


def _write(folder: Path, qtype: QType, tied: bool = False) -> Path:
    path = folder / f"tiny-{qtype.name.lower()}.gguf"
    write_tiny_gguf(path, random_llama_weights(SPEC, seed=0, tied=tied), SPEC, qtype)
    return path


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1], ids=["Q4_0", "Q4_1"])
def test_stored_int4_matches_dequantized_rows(tmp_path: Path, qtype: QType) -> None:
    source = GGUFSource(_write(tmp_path, qtype))
    floats = dict(source.tensors())
    for name, tensor in floats.items():
        groups = source.stored_int4(name)
        if tensor.dim() == 1:
            assert groups is None and source.raw_tensor(name) is None
            continue
        assert groups is not None, name
        # Bit-exact, and Q/K rows un-permuted like the dequantized tensors.
        assert torch.equal(groups.dequantize(), tensor), name


def test_no_int4_groups_in_other_types(tmp_path: Path) -> None:
    source = GGUFSource(_write(tmp_path, QType.Q8_0))
    raw = source.raw_tensor("model.layers.0.self_attn.q_proj.weight")
    assert raw is not None and raw.qtype == QType.Q8_0
    assert source.stored_int4("model.layers.0.self_attn.q_proj.weight") is None


def _first_logits(model: LlamaModel) -> tuple[torch.Tensor, tuple[int, ...]]:
    cache = model.new_cache(num_pages=8, page_size=8)
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True, max_chunk_tokens=7)
    (result,) = generate_batch(model, cache, [PROMPT], settings, keep_logits=True)
    assert len(result.token_ids) == NEW_TOKENS
    return result.step_logits[0], result.token_ids


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_mode_generates_near_the_float_path(tmp_path: Path, tied: bool, native: bool) -> None:
    if native and native_library() is None:
        pytest.skip(f"native kernels unavailable: {native_unavailable_reason()}")
    source = GGUFSource(_write(tmp_path, QType.Q4_1, tied))
    cpu = cpu_features()
    float_logits, _ = _first_logits(LlamaModel.from_source(source, progress=False))
    for mode in QuantMode:
        plan = plan_for(mode, cpu, native)
        model = LlamaModel.from_source(source, progress=False, plan=plan, tune_dir=tmp_path)
        logits, tokens = _first_logits(model)
        err = float((logits - float_logits).norm() / float_logits.norm())
        print(f"{mode.value} tied={tied}: relative logit error {err:.3g}")
        assert err <= MAX_LOGIT_ERROR[mode], f"{mode}: {err:.3g}"
        assert all(0 <= t < SPEC.vocab_size for t in tokens)
        text = model.describe()
        assert text.startswith("float32 activations; qkv ")
        if plan.qkv in (LinearKind.INT4, LinearKind.INT4_Q8) and not plan.autotuned:
            # A fixed int4 plan (auto may pick int8 blocks for some shapes and rows): every
            # layer's weights came from the file's Q4_1 blocks, none re-quantized.
            i4 = plan.qkv.value
            assert f"qkv {i4}[file], o {i4}[file], gate_up {i4}[file], down {i4}[file]" in text
        if plan == LinearPlan.uniform(LinearKind.FLOAT):
            assert text.endswith("head float32")


def test_requantized_int4_from_a_float_file(tmp_path: Path) -> None:
    source = GGUFSource(_write(tmp_path, QType.F16))
    model = LlamaModel.from_source(source, progress=False, plan=plan_for(QuantMode.INT4, cpu_features()))
    assert "qkv int4[requant]" in model.describe() or "qkv int4_q8[requant]" in model.describe()
    _first_logits(model)


def test_load_model_takes_the_mode(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    loaded = load_model(_write(tmp_path, QType.Q4_0), progress=False, quant=QuantMode.INT8)
    assert loaded.model.plan == plan_for(QuantMode.INT8, cpu_features())
    assert "qkv int8" in loaded.model.describe()


def test_auto_chooses_the_body_among_block_kinds_where_native() -> None:
    """So every decode step can run each layer as one native call (all four projections block linears)."""
    cpu = cpu_features()
    native = plan_for(QuantMode.AUTO, cpu, native=True)
    body = (LinearRole.QKV, LinearRole.OUT, LinearRole.GATE_UP, LinearRole.DOWN)
    for role in body:
        assert native.candidates(role) == (LinearKind.INT4_Q8, LinearKind.INT8_Q8)
    assert LinearKind.INT8_Q8 in native.candidates(LinearRole.HEAD)
    elsewhere = plan_for(QuantMode.AUTO, cpu, native=False)
    for role in body:
        assert not {LinearKind.INT4_Q8, LinearKind.INT8_Q8} & set(elsewhere.candidates(role))
        assert len(elsewhere.candidates(role)) > 1
