"""Find a model on disk, pick its weight source, and load model and tokenizer together."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import InvalidRequestError, ModelFormatError, ModelNotFoundError
from engine.model.derived_files import DerivedFiles
from engine.model.folder_tokenizer import FolderTokenizer, write_facts
from engine.model.gguf_reader_share import shared_readers
from engine.model.gguf_source import GGUFSource
from engine.model.llama import LlamaModel
from engine.model.packed_store import PackedStore
from engine.model.quantization import QuantMode, plan_for
from engine.model.safetensors_source import SafetensorsSource
from engine.model.shipped_model import default_model_path
from engine.model.tokenizer import HFTokenizer
from engine.model.weight_source import WeightSource
from engine.onednn_caches import bound_onednn_caches
from kernels.attention.backend import AttentionKind, attention_problem
from kernels.cpu_features import CpuFeatures, cpu_features
from kernels.native.native_library import native_library, source_digest

TorchDevice = torch.device  # for annotations inside WeightDtype, whose `torch` property hides the module


class WeightDtype(enum.Enum):
    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    @property
    def torch(self) -> torch.dtype:
        return torch.bfloat16 if self is WeightDtype.BFLOAT16 else torch.float32

    def resolve(self, quant: QuantMode, cpu: CpuFeatures, device: TorchDevice | None = None) -> WeightDtype:
        """AUTO: bfloat16 on CUDA; on the CPU bfloat16 only where it computes it natively
        (AVX512_BF16 or AMX) and the linears are float; elsewhere float32. AVX2-only parts emulate
        bfloat16 matmuls (measured 5x slower than float32 at 64 rows), and the native quantized
        kernels and fused ops take float32 activations."""
        if self is not WeightDtype.AUTO:
            return self
        if device is not None and device.type == "cuda":
            return WeightDtype.BFLOAT16
        return WeightDtype.BFLOAT16 if cpu.native_bf16 and quant is QuantMode.NONE else WeightDtype.FLOAT32


def open_weight_source(path: Path, derived: DerivedFiles | None = None) -> WeightSource:
    """A .gguf file, or a Hugging Face folder with config.json and *.safetensors; with `derived`,
    a GGUF header's index is kept there between starts."""
    if not path.exists():
        raise ModelNotFoundError(f"model not found: {path}")
    if path.is_dir():
        return SafetensorsSource(path)
    if path.suffix.lower() == ".gguf":
        return GGUFSource(path, derived)
    raise InvalidRequestError(f"{path}: expected a .gguf file or a folder with config.json and *.safetensors")


def load_tokenizer(
    path: Path, extra_eos: Sequence[int], derived: DerivedFiles | None = None
) -> HFTokenizer | FolderTokenizer:
    """The model's tokenizer; with `derived`, a GGUF file's converted tokenizer is kept there
    (converting it takes seconds; loading the saved one without transformers, a tenth of a second)."""
    if derived is None or path.is_dir():
        return HFTokenizer(path, extra_eos)
    if derived.tokenizer.is_dir():
        fast = FolderTokenizer.open(derived.tokenizer, extra_eos)
        if fast is not None:
            return fast
        try:
            saved = HFTokenizer(derived.tokenizer, extra_eos)
        except ModelFormatError:
            pass  # damaged: convert again
        else:
            write_facts(saved, derived.tokenizer, derived.publish_file)  # kept before facts were
            return saved
    tokenizer = HFTokenizer(path, extra_eos)

    def save(folder: Path) -> None:
        tokenizer.save(folder)
        write_facts(tokenizer, folder, derived.publish_file)

    derived.publish_folder(derived.tokenizer, save)
    return tokenizer


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaModel
    tokenizer: HFTokenizer | FolderTokenizer
    path: Path


def load_model(
    path: Path | None = None,
    dtype: WeightDtype = WeightDtype.FLOAT32,
    progress: bool = True,
    attention: AttentionKind = AttentionKind.AUTO,
    num_layers: int | None = None,
    quant: QuantMode = QuantMode.NONE,
    keep_derived: bool = True,
    device: torch.device | None = None,
) -> LoadedModel:
    """Load model and tokenizer; `quant` picks the projections' linear kinds (see quantization.py).
    `keep_derived`: keep what is derived from a GGUF file for the next start (derived_files.py).
    `device`: where the weights, the cache and the forward live (default: the CPU)."""
    device = device or torch.device("cpu")
    problem = attention_problem(attention, device)
    if problem is not None:
        raise InvalidRequestError(problem)
    bound_onednn_caches()  # before the first matmul (autotuning) reads them
    model_path = path if path is not None else default_model_path()
    derived = DerivedFiles.of(model_path) if keep_derived and model_path.is_file() else None
    # Work that can go beside the weights' goes on threads: a first start's native build (a
    # compiler process; the linears wait for it) and the tokenizer (on a first start mostly importing
    # transformers, while the weights' work is mostly in torch and numpy, which let go of the interpreter).
    with ThreadPoolExecutor(2, thread_name_prefix="load") as pool, shared_readers():
        pool.submit(native_library)
        source = open_weight_source(model_path, derived)
        tokenizer = pool.submit(load_tokenizer, model_path, source.config.eos_token_ids, derived)
        # The store keeps CPU tables and the native kernels' packing: nothing a GPU runs.
        packed = PackedStore.open(derived, source_digest()) if device.type == "cpu" else None
        model = LlamaModel.from_source(
            source,
            dtype.resolve(quant, cpu_features(), device).torch,
            device=device,
            progress=progress,
            attention=attention,
            num_layers=num_layers,
            plan=plan_for(quant, cpu_features(), device=device),
            packed=packed,
        )
        if packed is not None:
            packed.save()
        return LoadedModel(model, tokenizer.result(), model_path)
