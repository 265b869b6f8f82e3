"""Typed ids shared across the engine."""

from __future__ import annotations

from typing import NewType

PageId = NewType("PageId", int)
