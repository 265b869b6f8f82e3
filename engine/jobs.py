"""What a generation is asked to do and why it stopped."""

from __future__ import annotations

import enum


class StopReason(enum.Enum):
    EOS = "eos"  # the model emitted one of its end-of-sequence tokens
    STOP_TOKEN = "stop_token"  # one of the request's stop token ids
    MAX_NEW_TOKENS = "max_new_tokens"
