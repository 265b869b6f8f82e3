"""Per-job incremental detokenizer: generated token ids in, streamable text deltas out.

Two stages, each O(recent tokens + longest stop string) per token, never O(output):

1. Detokenizing. Decoding only the newest token loses context (SentencePiece's leading
   space, word-level joins), and re-decoding the whole output each step is O(n^2). So,
   as vLLM and TGI do, decode a small window (a few already-emitted context tokens plus
   the unread ones) and emit what its text adds past what was emitted. The context is
   only cut back every few tokens, so most tokens cost one decode call, not two. A byte-level BPE
   token can end inside a multi-byte character, which decodes to a trailing U+FFFD; the
   trailing U+FFFD run is held until a later token completes the character.
2. Stop strings. An Aho-Corasick automaton over the stop strings reads the text a
   character at a time. Its state is the longest suffix of the text that is a prefix of
   some stop string: exactly the text to hold back. It reports the first stop string to
   complete, so the result does not depend on how the text is split into tokens or pushes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"

# The window grows only while its text ends in U+FFFD or gains nothing (skipped special
# tokens). A valid character spans at most 4 tokens, so past this many unread tokens the
# output is garbage bytes or a run of special tokens, and the context is moved on anyway.
_MAX_UNREAD = 16

# Context grows by each token whose text is complete and is cut back (to the tokens read since
# the last cut, one more decode) once it reaches this: ~1.1 decode calls per token, not 2.
_MAX_CONTEXT = 8


@dataclass(frozen=True, slots=True)
class TextDelta:
    """What one push made safe to show."""

    text: str  # whole characters only, never reaching into a stop string or a possible one
    stop_string: str | None  # the stop string that matched; `text` ends right before it
    tokens_consumed: int  # pushed tokens up to the one completing the match (all of them if none)


class TextStream:
    """One job's token ids -> text deltas, UTF-8 safe, cut at the first stop string.

    Mutable and owned by its job. After a push reports a stop string, or after finish(),
    the stream is closed: push raises and finish returns "".
    """

    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str], skip_special_tokens: bool) -> None:
        if isinstance(stop_strings, str):  # a str is a Sequence[str]: each character would be a stop
            raise TypeError("stop_strings must be a sequence of strings, not one string")
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must not be empty")
        self._detok = _Detokenizer(tokenizer, skip_special_tokens)
        self._stops = _StopMatcher(stop_strings)
        self._closed = False

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        """Accept new tokens (several at once under speculative decoding)."""
        if self._closed:
            raise RuntimeError("push on a TextStream that already stopped or finished")
        parts: list[str] = []
        # Token by token, so a match is pinned to the token that completes it.
        for consumed, token in enumerate(token_ids, start=1):
            piece = self._detok.step(token)
            if not piece:
                continue
            released, stop = self._stops.feed(piece)
            parts.append(released)
            if stop is not None:
                self._closed = True
                return TextDelta("".join(parts), stop, consumed)
        return TextDelta("".join(parts), None, len(token_ids))

    def finish(self) -> str:
        """Release the held-back text at the end of a job that no stop string ended."""
        if self._closed:
            return ""
        self._closed = True
        # The flushed tail holds only U+FFFD (a genuine one, or an unfinished character),
        # which can complete a stop string only if the caller put U+FFFD in one.
        released, stop = self._stops.feed(self._detok.flush())
        return released if stop is not None else released + self._stops.release()


class _Detokenizer:
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


class _StopMatcher:
    """Aho-Corasick over the stop strings, fed the stream a character at a time."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stops = tuple(dict.fromkeys(stop_strings))
        children: list[dict[str, int]] = [{}]
        depth = [0]
        # Index into _stops of the longest stop string that is a suffix of the node's text, or -1.
        match = [-1]
        for index, stop in enumerate(self._stops):
            node = 0
            for ch in stop:
                nxt = children[node].get(ch)
                if nxt is None:
                    nxt = len(children)
                    children[node][ch] = nxt
                    children.append({})
                    depth.append(depth[node] + 1)
                    match.append(-1)
                node = nxt
            match[node] = index
        fail = [0] * len(children)
        queue = deque(children[0].values())
        while queue:  # breadth first, so every failure target is finished before it is used
            node = queue.popleft()
            for ch, child in children[node].items():
                f = fail[node]
                while f and ch not in children[f]:
                    f = fail[f]
                fail[child] = children[f].get(ch, 0)
                if match[child] < 0:
                    match[child] = match[fail[child]]
                queue.append(child)
        self._children = children
        self._fail = fail
        self._depth = depth
        self._match = match
        self._state = 0
        self._held = ""  # the last depth[state] characters of the stream, not yet released

    def feed(self, text: str) -> tuple[str, str | None]:
        """Return (text now safe to release, the stop string that matched or None)."""
        if not self._stops:
            return text, None
        buffer = self._held + text
        base = len(self._held)
        children, fail, state = self._children, self._fail, self._state
        for i, ch in enumerate(text):
            while state and ch not in children[state]:
                state = fail[state]
            state = children[state].get(ch, 0)
            found = self._match[state]
            if found >= 0:
                # The first stop string to complete; at a tie the longest, as it starts earliest.
                stop = self._stops[found]
                self._state, self._held = 0, ""
                return buffer[: base + i + 1 - len(stop)], stop
        self._state = state
        keep = len(buffer) - self._depth[state]
        self._held = buffer[keep:]
        return buffer[:keep], None

    def release(self) -> str:
        held, self._held, self._state = self._held, "", 0
        return held
