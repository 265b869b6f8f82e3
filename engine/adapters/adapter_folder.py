"""Where a LoRA adapter's two files are, and how they are opened without leaving a folder.

A run-time load names its folder relative to the operator's adapter folder (`--adapter-dir`);
the server's own adapters (`--lora`) are operator paths and are taken as given. A confined
folder is resolved with every symlink followed and must lie inside the root; so must each file,
which is then opened without following links and without blocking (a FIFO would hang a plain
open), checked to be a regular file within its size cap, and checked once more through the open
descriptor's own path, so a link swapped in after the check is still caught.

Every refusal of a place outside the root is the same message, whether or not anything exists
there: a caller learns nothing about the server's other files.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from engine.errors import InvalidRequestError, ModelNotFoundError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json: a few hundred bytes in practice
MAX_RELATIVE_PATH = 512  # characters of a run-time load's path


class AdapterPathError(InvalidRequestError):
    """A run-time load's path is not a place inside the adapter folder (or not allowed at all)."""


def outside(path: str) -> AdapterPathError:
    """The one refusal of a path that leaves the adapter folder, whatever lies there."""
    return AdapterPathError(
        f"adapter path {path[:80]!r} is not inside the server's adapter folder "
        "(give a name or a relative path within it, without '..')"
    )


def check_relative_path(path: str) -> PurePosixPath:
    """A run-time load's path as a relative path of plain names: refused before any file is
    touched if it is empty, too long, absolute, or steps up with '..'."""
    if not path:
        raise AdapterPathError("path: the adapter's folder is required (a name inside the adapter folder)")
    if len(path) > MAX_RELATIVE_PATH or "\x00" in path or "\\" in path:
        raise outside(path)
    relative = PurePosixPath(path)
    if relative.is_absolute() or ".." in relative.parts:
        raise outside(path)
    return relative


def _inside(root: Path, target: Path) -> bool:
    return target == root or root in target.parents


@dataclass(frozen=True)
class AdapterFolder:
    """An adapter's folder: `path` as it was named (shown to operators), `root` the folder every
    file must stay inside (None for the operator's own --lora folders)."""

    path: Path
    root: Path | None = None
    label: str = ""  # how callers named it (the relative path of a run-time load)

    @staticmethod
    def trusted(path: Path) -> AdapterFolder:
        return AdapterFolder(path, None, str(path))

    @staticmethod
    def confined(root: Path, relative: str) -> AdapterFolder:
        """`relative` inside `root`, symlinks resolved; AdapterPathError if it leaves `root`."""
        real_root = Path(os.path.realpath(root))
        target = Path(os.path.realpath(real_root / check_relative_path(relative)))
        if not _inside(real_root, target):
            raise outside(relative)
        return AdapterFolder(target, real_root, relative)

    def _file(self, name: str, cap: int) -> int:
        """An open descriptor of one of the folder's files: a regular file of at most `cap` bytes,
        inside the root. ModelNotFoundError if it is missing (only ever said of a place inside)."""
        where = self.path / name
        if self.root is not None:
            real = Path(os.path.realpath(where))
            if not _inside(self.root, real):
                raise outside(self.label)
            where = real
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if self.root is not None else 0)
        try:
            fd = os.open(where, flags)
        except FileNotFoundError:
            raise ModelNotFoundError(f"adapter folder {self.label!r} holds no {name}") from None
        except OSError as exc:
            raise InvalidRequestError(f"adapter folder {self.label!r}: {name} cannot be opened") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidRequestError(f"adapter folder {self.label!r}: {name} is not a regular file")
            if info.st_size > cap:
                raise InvalidRequestError(
                    f"adapter folder {self.label!r}: {name} is {info.st_size} bytes, over the server's "
                    f"limit of {cap}" + (" (--max-adapter-bytes)" if name == WEIGHTS_FILE else "")
                )
            if self.root is not None:
                opened = _descriptor_path(fd)
                if opened is not None and not _inside(self.root, opened):
                    raise outside(self.label)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_config(self) -> bytes:
        """adapter_config.json's bytes (at most MAX_CONFIG_BYTES)."""
        fd = self._file(CONFIG_FILE, MAX_CONFIG_BYTES)
        with os.fdopen(fd, "rb") as f:
            return f.read(MAX_CONFIG_BYTES + 1)

    @contextlib.contextmanager
    def weights(self, max_bytes: int) -> Iterator[str]:
        """A path that names the checked, open weights file while the context lasts (the open
        descriptor's /proc path where the system has one, so what is read is what was checked)."""
        fd = self._file(WEIGHTS_FILE, max_bytes)
        try:
            proc = Path(f"/proc/self/fd/{fd}")
            yield str(proc) if proc.exists() else str(self.path / WEIGHTS_FILE)
        finally:
            os.close(fd)


def _descriptor_path(fd: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None
