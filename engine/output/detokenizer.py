"""Incremental detokenizing: one job's generated token ids in, final text out, UTF-8 safe.

Decoding only the newest token loses context (SentencePiece's leading space, word-level joins),
and re-decoding the whole output each step is O(n^2). So, as vLLM and TGI do, decode a small
window (a few already-emitted context tokens plus the unread ones) and emit what its text adds
past what was emitted. The context is only cut back every few tokens, so most tokens cost one
decode call, not two. A byte-level BPE token can end inside a multi-byte character, which decodes
to a trailing U+FFFD; the trailing U+FFFD run is held until a later token completes the character.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"

# The window grows only while its text ends in U+FFFD or gains nothing (skipped special
# tokens). A valid character spans at most 4 tokens, so past this many unread tokens the
# output is garbage bytes or a run of special tokens, and the context is moved on anyway.
_MAX_UNREAD = 16

# Context grows by each token whose text is complete and is cut back (to the tokens read since
# the last cut, one more decode) once it reaches this: ~1.1 decode calls per token, not 2.
_MAX_CONTEXT = 8


class Detokenizer:
    """Window-based incremental decode; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._window: list[int] = []
        self._read = 0  # window[:read] is context: its text was emitted under an earlier window
        self._prefix_len = 0  # len(decode(window[:read]))
        self._emitted = 0  # characters of decode(window) already emitted, >= prefix_len

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def step(self, token: int) -> str:
        self._window.append(token)
        text = self._decode(self._window)
        complete = not text.endswith(_REPLACEMENT)
        # Text before a trailing U+FFFD run is final, so a token holding "." plus the first
        # byte of an emoji still releases the "." now (a stop string may need it).
        stable = len(text) if complete else len(text.rstrip(_REPLACEMENT))
        out = text[self._emitted : stable]
        self._emitted = max(self._emitted, stable)
        if complete and len(text) > self._prefix_len:
            if self._read >= _MAX_CONTEXT:
                self._rebase(len(self._window), len(text))
            else:
                # The whole window becomes context: its text is `text`, so no second decode.
                self._read, self._prefix_len = len(self._window), len(text)
        elif len(self._window) - self._read > _MAX_UNREAD:
            out += self._force(text, complete)
        return out

    def save(self) -> tuple[tuple[int, ...], int, int, int]:
        return tuple(self._window), self._read, self._prefix_len, self._emitted

    def restore(self, saved: tuple[tuple[int, ...], int, int, int]) -> None:
        window, self._read, self._prefix_len, self._emitted = saved
        self._window = list(window)

    def flush(self) -> str:
        """Everything not yet emitted, a trailing U+FFFD included: nothing can complete it now."""
        text = self._decode(self._window)
        out = text[self._emitted :]
        self._window, self._read, self._prefix_len, self._emitted = [], 0, 0, 0
        return out

    def _rebase(self, cut: int, cut_len: int) -> None:
        """Make window[read:cut] the new context; cut_len is len(decode(window[:cut]))."""
        carry = max(0, self._emitted - cut_len)  # characters already emitted past the cut
        self._window = self._window[self._read :]
        self._read = cut - self._read
        self._prefix_len = len(self._decode(self._window[: self._read]))
        self._emitted = self._prefix_len + carry

    def _is_skipped_special(self, token: int) -> bool:
        return bool(self._tokenizer.decode([token])) and not self._decode([token])

    def _force(self, text: str, complete: bool) -> str:
        """Bound the window: move the context to the latest token boundary whose text is final."""
        if self._skip:
            # A decode drops skipped special tokens before anything else, so dropping them here
            # changes no text and keeps the context (a word-level decoder joins the words around
            # them; bytes of one character may sit on both sides of them).
            self._window[self._read :] = [
                t for t in self._window[self._read :] if not self._is_skipped_special(t)
            ]
            if len(self._window) - self._read <= _MAX_UNREAD:
                return ""
        if complete:  # textless tokens piled up; nothing is pending
            self._rebase(len(self._window), len(text))
            return ""
        for cut in range(len(self._window) - 1, self._read, -1):
            head = self._decode(self._window[:cut])
            # head is final if the full text extends it and its last character is either
            # whole or, if U+FFFD, already followed by another (so no byte can fix it).
            if text.startswith(head) and (len(text) > len(head) or not head.endswith(_REPLACEMENT)):
                out = text[self._emitted : len(head)]
                self._emitted = max(self._emitted, len(head))
                self._rebase(cut, len(head))
                return out
        # No final boundary (only with tokens that carry no bytes): emit the U+FFFDs as they are.
        out = text[self._emitted :]
        self._emitted = len(text)
        self._rebase(len(self._window), len(text))
        return out
