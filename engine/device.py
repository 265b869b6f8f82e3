"""Where the model runs: `--device {auto,cpu,cuda,cuda:N}`.

The flag is checked without torch (the front end's `dyngen serve` parses it, and asks a child
process whether torch sees CUDA before it starts anything: `service/device_check.py`); the engine
resolves it to a torch device when it loads the model. Asking for CUDA where there is none is
refused with one line, never silently run on the CPU; `auto` takes the CPU there.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from engine.errors import DyngenError, ErrorKind, InvalidRequestError

if TYPE_CHECKING:
    import torch

_FLAG = re.compile(r"auto|cpu|cuda(?::(\d{1,3}))?")


class DeviceUnavailableError(DyngenError):
    """The device asked for is not there (no CUDA in this torch build or on this machine)."""

    kind = ErrorKind.UNSUPPORTED


def check_device_flag(flag: str) -> str:
    """The flag as given if it names a device kind dyngen runs on; InvalidRequestError otherwise."""
    if not _FLAG.fullmatch(flag):
        raise InvalidRequestError(f"--device takes auto, cpu, cuda or cuda:N, got {flag!r}")
    return flag


def cuda_problem(flag: str, cuda_devices: int, torch_version: str) -> str | None:
    """Why `flag` cannot run where torch sees `cuda_devices` CUDA devices; None if it can."""
    match = _FLAG.fullmatch(check_device_flag(flag))
    assert match is not None
    if not flag.startswith("cuda"):
        return None
    if cuda_devices == 0:
        return f"--device {flag}: torch {torch_version} sees no CUDA device on this machine (use --device cpu or auto)"
    index = int(match.group(1) or 0)
    if index >= cuda_devices:
        return f"--device {flag}: torch sees {cuda_devices} CUDA device(s), numbered 0 to {cuda_devices - 1}"
    return None


def describe_device(device: torch.device) -> str:
    """For logs and GetModelInfo: "cpu", or "cuda:0 (NVIDIA H100 80GB HBM3, capability 9.0)"."""
    import torch

    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return f"cuda:{index} ({torch.cuda.get_device_name(index)}, capability {major}.{minor})"


def resolve_device(flag: str) -> torch.device:
    """The torch device of `flag`: auto is cuda where torch sees a CUDA device, else the CPU."""
    import torch

    check_device_flag(flag)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if flag == "auto":
        return torch.device("cuda" if count else "cpu")
    problem = cuda_problem(flag, count, torch.__version__)
    if problem is not None:
        raise DeviceUnavailableError(problem)
    return torch.device("cuda:0" if flag == "cuda" else flag)
