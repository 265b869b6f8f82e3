"""`dyngen serve --device cuda[:N]`: is the device there? Asked before the front end starts.

The front end never imports torch (tests/test_frontend_imports.py), so a child Python asks torch
how many CUDA devices it sees; a device that is not there is refused with one line (exit 2)
instead of an engine that fails to start behind a listening server. `auto` and `cpu` cost nothing:
the engine resolves them (engine/device.py).
"""

from __future__ import annotations

import subprocess
import sys

from engine.device import DeviceUnavailableError, check_device_flag, cuda_problem

_ASK = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0, torch.__version__)"
ASK_TIMEOUT_SECONDS = 120.0  # a cold torch import on a slow disk


def check_device(flag: str) -> None:
    """DeviceUnavailableError naming why, if `flag` asks for a CUDA device torch does not see."""
    if not check_device_flag(flag).startswith("cuda"):
        return
    try:
        done = subprocess.run(
            [sys.executable, "-c", _ASK],
            capture_output=True,
            text=True,
            timeout=ASK_TIMEOUT_SECONDS,
            check=False,
        )
        count, version = done.stdout.split()
    except (OSError, subprocess.TimeoutExpired, ValueError):
        raise DeviceUnavailableError(f"--device {flag}: could not ask torch for its CUDA devices") from None
    problem = cuda_problem(flag, int(count), version)
    if problem is not None:
        raise DeviceUnavailableError(problem)
