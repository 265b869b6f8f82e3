"""LoRA adapters on a tiny random model: read from peft's files, applied per row in one forward
beside other adapters and the base model, each row equal to peft's own forward."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.adapters.lora_adapter import AdapterError, LoraAdapter
from engine.errors import InvalidRequestError, ModelNotFoundError
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.ids import PageId
from engine.model.loader import LoadedModel, WeightDtype, load_model
from engine.model.quantization import QuantMode
from tests.lora_adapters import save_peft_adapter
from tests.tiny_llama import save_tiny_llama

PAGE = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("tiny")
    return folder, save_tiny_llama(folder, with_tokenizer=True)


@pytest.fixture(scope="module")
def adapters(tiny: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    _, hf = tiny
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": (
            root / "attn",
            save_peft_adapter(hf, root / "attn", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], 1),
        ),
        "mlp": (
            root / "mlp",
            save_peft_adapter(
                hf, root / "mlp", 4, 32, ["gate_proj", "down_proj", "v_proj"], 2, use_rslora=True
            ),
        ),
        "pattern": (
            root / "pattern",
            save_peft_adapter(
                hf, root / "pattern", 6, 8, ["q_proj", "up_proj"], 3, alpha_pattern={"up_proj": 24}
            ),
        ),
    }


def _forward(
    loaded: LoadedModel, prompts: list[list[int]], which: list[LoraAdapter | None]
) -> list[torch.Tensor]:
    """Every prompt prefilled in one forward; each one's logits at every position."""
    model = loaded.model
    pages_each = max(len(p) for p in prompts) // PAGE + 1
    cache = model.new_cache(1 + pages_each * len(prompts), PAGE)
    seqs = [
        SequenceInput(
            p,
            0,
            [PageId(1 + i * pages_each + j) for j in range(pages_each)],
            logit_positions=len(p),
            adapter=a,
        )
        for i, (p, a) in enumerate(zip(prompts, which, strict=True))
    ]
    logits = model.forward(ForwardBatch.build(seqs, PAGE, torch.device("cpu")), cache)
    sizes = [len(p) for p in prompts]
    return [logits[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(sizes))]


def _reference(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(torch.tensor([prompt])).logits[0].to(torch.float32)
    return out


def test_one_forward_mixes_adapters_and_the_base_model(
    tiny: tuple[Path, Any], adapters: dict[str, tuple[Path, Any]]
) -> None:
    folder, hf = tiny
    loaded = load_model(folder, WeightDtype.FLOAT32, progress=False)
    loras = {n: LoraAdapter.load(n, p, loaded.model.config) for n, (p, _) in adapters.items()}
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (11, 5, 23, 9, 14)]
    which = [loras["attn"], None, loras["mlp"], loras["attn"], loras["pattern"]]
    refs = [adapters["attn"][1], hf, adapters["mlp"][1], adapters["attn"][1], adapters["pattern"][1]]
    got = _forward(loaded, prompts, which)
    for prompt, out, ref in zip(prompts, got, refs, strict=True):
        want = _reference(ref, prompt)
        assert torch.allclose(out, want, atol=2e-4, rtol=1e-4), (out - want).abs().max()
    # The adapters change the output: the test would fail if they were not applied.
    base = _reference(hf, prompts[0])
    assert (got[0] - base).abs().max() > 1e-2


def test_decode_steps_with_adapters_leave_the_fused_layer(
    tiny: tuple[Path, Any], adapters: dict[str, tuple[Path, Any]]
) -> None:
    """One new token per sequence (a decode step) with an adapter runs the per-op path."""
    folder, _ = tiny
    loaded = load_model(folder, WeightDtype.FLOAT32, progress=False, quant=QuantMode.INT4)
    lora = LoraAdapter.load("mlp", adapters["mlp"][0], loaded.model.config)
    prompts = [[5], [9]]
    with_lora = _forward(loaded, prompts, [lora, None])
    base = _forward(loaded, prompts, [None, None])
    assert torch.equal(with_lora[1], base[1])  # the base row is untouched
    assert (with_lora[0] - base[0]).abs().max() > 1e-3


def test_refused_adapters_say_why(
    tiny: tuple[Path, Any], adapters: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    folder, _ = tiny
    config = load_model(folder, WeightDtype.FLOAT32, progress=False).model.config
    with pytest.raises(ModelNotFoundError):
        LoraAdapter.load("x", tmp_path / "missing", config)
    source = adapters["attn"][0]
    for change, words in (
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"lora_alpha": 0}, "lora_alpha"),
        ({"lora_alpha": float("inf")}, "lora_alpha must be a positive finite number"),
        ({"r": 8.5}, "r must be a positive whole number"),
        # The weights (rank 8 on q/k/v/o of every layer) disagree with the config: PEFT would refuse
        # the file or leave weights out, so applying them all would not be the adapter PEFT runs.
        ({"r": 16}, "layer 0 k_proj has rank 8, but adapter_config.json gives it rank 16"),
        ({"rank_pattern": {"k_proj": 4}}, "layer 0 k_proj has rank 8, but"),
        (
            {"target_modules": ["q_proj"]},
            "layer 0 k_proj has weights, but adapter_config.json does not target",
        ),
        ({"target_modules": r".*\.q_proj"}, "does not target"),
        ({"layers_to_transform": [0]}, "layer 1 k_proj has weights"),
        ({"exclude_modules": ["o_proj"]}, "layer 0 o_proj has weights"),
    ):
        bad = tmp_path / str(len(list(tmp_path.iterdir())))
        bad.mkdir()
        (bad / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
        settings = json.loads((source / "adapter_config.json").read_text()) | change
        (bad / "adapter_config.json").write_text(json.dumps(settings))
        with pytest.raises(AdapterError, match=words):
            LoraAdapter.load("x", bad, config)
    # Weights that are not finite would turn every job of the adapter to NaN logits.
    tensors = load_file(source / "adapter_model.safetensors")
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key][0, 0] = float("nan")
    nan = tmp_path / "nan"
    nan.mkdir()
    save_file(tensors, nan / "adapter_model.safetensors")
    (nan / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    with pytest.raises(AdapterError, match="lora_B holds values that are not finite"):
        LoraAdapter.load("x", nan, config)
    save_tiny_llama(tmp_path / "wide", with_tokenizer=True, hidden_size=96)
    other = load_model(tmp_path / "wide", WeightDtype.FLOAT32, progress=False).model.config
    with pytest.raises(AdapterError, match="do not fit"):
        LoraAdapter.load("x", source, other)
    assert issubclass(AdapterError, InvalidRequestError)


@pytest.mark.parametrize(
    "targets",
    [
        r".*\.(q_proj|k_proj|v_proj|o_proj)",  # a regex, matched against the whole module name
        "all-linear",
        ["self_attn.q_proj", "k_proj", "v_proj", "o_proj"],  # names match the module name's end
    ],
)
def test_a_config_naming_its_modules_another_way_loads_the_same(
    tiny: tuple[Path, Any], adapters: dict[str, tuple[Path, Any]], tmp_path: Path, targets: object
) -> None:
    folder, _ = tiny
    config = load_model(folder, WeightDtype.FLOAT32, progress=False).model.config
    source = adapters["attn"][0]
    (tmp_path / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
    settings = json.loads((source / "adapter_config.json").read_text()) | {"target_modules": targets}
    (tmp_path / "adapter_config.json").write_text(json.dumps(settings))
    same, listed = LoraAdapter.load("x", tmp_path, config), LoraAdapter.load("y", source, config)
    for mine, theirs in zip(same.layers, listed.layers, strict=True):
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[p].b, theirs[p].b) for p in mine)


def _generator(folder: Path, quant: QuantMode = QuantMode.NONE) -> Any:
    from engine.generator import DynamicGenerator, GeneratorConfig

    loaded = load_model(folder, WeightDtype.FLOAT32, progress=False, quant=quant)
    return DynamicGenerator(loaded.model, loaded.tokenizer, GeneratorConfig(page_size=PAGE, num_pages=64))


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0
        )
    return [int(t) for t in out[0, len(prompt) :]]


def test_generator_runs_each_job_with_its_adapter(
    tiny: tuple[Path, Any], adapters: dict[str, tuple[Path, Any]]
) -> None:
    from engine.jobs import JobSpec

    folder, hf = tiny
    gen = _generator(folder)
    for loaded_name in ("attn", "mlp"):
        gen.load_adapter(loaded_name, adapters[loaded_name][0])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 17, 12, 20)]
    names: list[str | None] = ["attn", None, "mlp", "attn"]
    specs = [
        JobSpec(tuple(p), max_new_tokens=12, ignore_eos=True, adapter=a)
        for p, a in zip(prompts, names, strict=True)
    ]
    done = gen.generate(specs)
    for prompt, name, c in zip(prompts, names, done, strict=True):
        ref: Any = hf if name is None else adapters[name][1]
        assert list(c.token_ids) == _greedy(ref, prompt, 12), name
        assert c.finished.adapter == name
    gen.close()


def test_prefix_pages_are_shared_only_within_one_adapter(
    tiny: tuple[Path, Any], adapters: dict[str, tuple[Path, Any]]
) -> None:
    """Jobs with the same prompt: a second job of the same adapter (or of the base model) reuses the
    first one's pages; a job of another adapter, or of the base model, computes its own."""
    from engine.jobs import JobSpec

    folder, _ = tiny
    gen = _generator(folder)
    gen.load_adapter("attn", adapters["attn"][0])
    gen.load_adapter("mlp", adapters["mlp"][0])
    prompt = tuple(range(10, 10 + 3 * PAGE + 5))

    def run(adapter: str | None) -> tuple[int, list[int]]:
        (c,) = gen.generate([JobSpec(prompt, max_new_tokens=4, ignore_eos=True, adapter=adapter)])
        return c.finished.cached_tokens, list(c.token_ids)

    cached, attn_tokens = run("attn")
    assert cached == 0
    assert run("mlp")[0] == 0  # attn's pages are not mlp's
    assert run(None)[0] == 0  # nor the base model's
    again, tokens = run("attn")
    assert again >= 3 * PAGE and tokens == attn_tokens
    assert run(None)[0] >= 3 * PAGE  # base jobs share with each other
    assert tokens == _greedy(adapters["attn"][1], list(prompt), 4)
    gen.close()


def test_adapters_load_list_and_unload(tiny: tuple[Path, Any], adapters: dict[str, tuple[Path, Any]]) -> None:
    from engine.errors import AdapterExistsError, AdapterInUseError, AdapterNotFoundError
    from engine.jobs import JobSpec

    folder, _ = tiny
    gen = _generator(folder)
    gen.load_adapter("attn", adapters["attn"][0])
    with pytest.raises(AdapterExistsError, match="loaded already"):
        gen.load_adapter("attn", adapters["mlp"][0])
    with pytest.raises(AdapterNotFoundError):
        gen.enqueue(JobSpec((5, 6), max_new_tokens=2, adapter="nope"))
    job = gen.enqueue(JobSpec((5, 6, 7), max_new_tokens=50, ignore_eos=True, adapter="attn"))
    assert [(i.name, i.jobs) for i in gen.adapter_infos()] == [("attn", 1)]
    with pytest.raises(AdapterInUseError, match="in use"):
        gen.unload_adapter("attn")
    gen.cancel(job)
    gen.unload_adapter("attn")
    assert gen.adapter_infos() == []
    with pytest.raises(AdapterNotFoundError):
        gen.unload_adapter("attn")
    gen.close()


def test_ngram_speculation_keeps_an_adapter_jobs_tokens(
    tiny: tuple[Path, Any], adapters: dict[str, tuple[Path, Any]]
) -> None:
    """The n-gram drafter speculates for adapter jobs (its drafts are the job's own tokens) and
    the verified output is the adapter's greedy output, as without speculation."""
    from engine.generator import DynamicGenerator, GeneratorConfig
    from engine.jobs import JobSpec
    from engine.speculation.speculation_config import DrafterKind, SpeculationConfig

    folder, _ = tiny
    loaded = load_model(folder, WeightDtype.FLOAT32, progress=False)
    prompt = tuple([7, 8, 9, 10] * 6)  # repeats: the n-gram drafter finds drafts
    outputs = []
    for kind in (DrafterKind.NONE, DrafterKind.NGRAM):
        config = GeneratorConfig(page_size=PAGE, num_pages=64, speculation=SpeculationConfig(kind=kind))
        gen = DynamicGenerator(loaded.model, loaded.tokenizer, config)
        gen.load_adapter("attn", adapters["attn"][0])
        (done,) = gen.generate([JobSpec(prompt, max_new_tokens=24, ignore_eos=True, adapter="attn")])
        outputs.append(
            (list(done.token_ids), done.finished.accepted_draft_tokens + done.finished.rejected_draft_tokens)
        )
        gen.close()
    (plain, _), (speculated, drafted) = outputs
    assert speculated == plain == _greedy(adapters["attn"][1], list(prompt), 24)
    assert drafted > 0  # drafts were verified
