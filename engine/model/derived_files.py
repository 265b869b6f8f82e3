"""What dyngen derives from a model file, kept between starts.

Parsing a GGUF file's metadata (its whole vocabulary and merges) takes seconds, and
converting its tokenizer takes more; a restarted engine or a new replica would pay both
again for the same file. The results are kept in a folder per model file, keyed by the
file's resolved path, size and modification time (and this module's format number), in
the same cache as the autotune choices and the native library. A changed or moved file
gets a new folder; an unreadable entry is derived again, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kernels.cache_dir import default_cache_dir

FORMAT = 1  # a change to what is stored here makes old folders unused
KEEP = 16  # model folders kept; the least recently written go first (tests make many tiny models)


@dataclass(frozen=True)
class DerivedFiles:
    """The folder of one model file's derived files."""

    folder: Path

    @staticmethod
    def of(model_path: Path, root: Path | None = None) -> DerivedFiles:
        st = model_path.stat()
        identity = json.dumps([str(model_path.resolve()), st.st_size, st.st_mtime_ns, FORMAT])
        digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
        base = root if root is not None else default_cache_dir() / "models"
        return DerivedFiles(base / f"{model_path.stem}-{digest}")

    @property
    def tokenizer(self) -> Path:
        """The tokenizer as transformers saves it (tokenizer.json, its config, the chat template)."""
        return self.folder / "tokenizer"

    @property
    def gguf_index(self) -> Path:
        """A GGUF file's scalar metadata and tensor table (gguf_source.GGUFIndex)."""
        return self.folder / "gguf-index.json"

    def packed(self, version: str) -> Path:
        """Packed linear blocks and float tables (packed_store.PackedStore), for one kernel `version`."""
        return self.folder / f"packed-{version}.pt"

    def publish_file(self, target: Path, text: str) -> None:
        """Write `text` to `target` whole or not at all (a rename), so a reader never sees half a file.
        A cache that cannot be written is only a slower next start."""
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, target)
        except OSError:
            return
        self._prune()

    def publish_written(self, target: Path, write: Callable[[Path], None]) -> None:
        """Let `write` fill a fresh file, then rename it to `target` (as publish_file)."""
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
            os.close(fd)
            try:
                write(Path(tmp))
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)  # left only on failure
        except OSError:
            return
        self._prune()

    def publish_folder(self, target: Path, write: Callable[[Path], None]) -> None:
        """Let `write` fill a fresh folder, then move it to `target` in one rename (as publish_file)."""
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name, suffix=".tmp"))
            try:
                write(tmp)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; left only on failure
        except OSError:
            return
        self._prune()

    def _prune(self) -> None:
        """Keep the KEEP most recently written model folders beside this one."""
        try:
            folders = sorted(
                (p for p in self.folder.parent.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime
            )
        except OSError:
            return
        for old in folders[:-KEEP]:
            if old != self.folder:
                shutil.rmtree(old, ignore_errors=True)
