"""Typed ids shared across the engine and the service's front end (no torch: the front end imports it)."""

from __future__ import annotations

import secrets
from typing import NewType

PageId = NewType("PageId", int)
JobId = NewType("JobId", str)


def new_job_id() -> JobId:
    """128 random bits, hex: unguessable, so one caller cannot name another's job."""
    return JobId(secrets.token_hex(16))
