"""A tiny random-weight Llama GGUF that `dyngen serve --model FILE` can load: the byte-level
BPE vocabulary of tests/tiny_gguf.py plus a ChatML chat template, so text, chat and token id
prompts all work. Service tests use it where the real model is not the point (fuzz, soak):
it loads in about a second and decodes hundreds of tokens a second on one core.

The template is SmolLM2's with one addition: a role other than system, user or assistant
makes it call `raise_exception`, as many real templates do for malformed conversations, so
a hostile chat reaches that path in the service.
"""

from __future__ import annotations

from pathlib import Path

import gguf

from tests.tiny_gguf import QType, TinyLlamaSpec, random_llama_weights, write_tiny_gguf

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny random model<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SERVICE_SPEC = TinyLlamaSpec(context_length=4096)


def write_servable_tiny_gguf(path: Path, seed: int = 0, spec: TinyLlamaSpec = SERVICE_SPEC) -> Path:
    """Write the tiny model (F32 weights, chat template) to `path` and return it."""
    bare = path.with_name(path.stem + ".bare.gguf")
    write_tiny_gguf(bare, random_llama_weights(spec, seed, tied=False), spec, QType.F32)
    _copy_with_chat_template(bare, path, CHAT_TEMPLATE)
    bare.unlink()
    return path


def _copy_with_chat_template(source: Path, target: Path, template: str) -> None:
    """Copy a GGUF file adding tokenizer.chat_template (as gguf's gguf_new_metadata script does)."""
    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(str(target), arch=arch, endianess=reader.endianess)
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue  # virtual fields, or written by the writer itself
        kind = f.types[0]
        sub_type = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), kind, sub_type=sub_type)
    writer.add_chat_template(template)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
