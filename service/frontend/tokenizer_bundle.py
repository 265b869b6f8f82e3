"""TokenizerBundle: the engine's tokenizer folder as one zip, for a gateway that tokenizes itself.

The worker contract's GetTokenizer streams the zip in chunks with the SHA-256 of the whole zip on
the last one. The folder is the one the engine saved and the front end tokenizes from
(service/tokenizer_folder.py), so the gateway's ids are the engine's. Its ids of note
(end of sequence, beginning of sequence, padding) are read from the same files, for GetModelInfo.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CHUNK_BYTES = 64 * 1024  # per GetTokenizer message, well under any gRPC message limit
MAX_FILE_BYTES = 64 * 1024 * 1024  # a file larger than this is not a tokenizer file: left out


@dataclass(frozen=True)
class TokenizerBundle:
    data: bytes  # the zip
    sha256: str  # hex digest of `data`
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None

    @staticmethod
    def from_folder(folder: Path) -> TokenizerBundle:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for path in sorted(folder.iterdir()):
                if path.is_file() and not path.is_symlink() and path.stat().st_size <= MAX_FILE_BYTES:
                    archive.write(path, path.name)
        data = buffer.getvalue()
        generation = _json(folder / "generation_config.json")
        tokenizer = _json(folder / "tokenizer_config.json")
        eos = generation.get("eos_token_id", [])
        eos_ids = tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int))
        return TokenizerBundle(
            data,
            hashlib.sha256(data).hexdigest(),
            eos_ids,
            _int(generation.get("bos_token_id")),
            _pad_id(folder, tokenizer),
        )

    def chunks(self) -> Iterator[tuple[bytes, str]]:
        """(bytes, sha256): the digest on the last chunk only, empty on the others."""
        last = max(0, (len(self.data) - 1) // CHUNK_BYTES)
        for i in range(last + 1):
            yield self.data[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES], self.sha256 if i == last else ""


def _json(path: Path) -> dict[str, object]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _pad_id(folder: Path, tokenizer_config: dict[str, object]) -> int | None:
    """The pad token's id, looked up in tokenizer.json's added tokens (None: no pad token)."""
    pad = tokenizer_config.get("pad_token")
    if isinstance(pad, dict):
        pad = pad.get("content")
    if not isinstance(pad, str):
        return None
    added = _json(folder / "tokenizer.json").get("added_tokens", [])
    for token in added if isinstance(added, list) else []:
        if isinstance(token, dict) and token.get("content") == pad:
            return _int(token.get("id"))
    return None
