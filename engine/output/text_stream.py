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
3. Banned strings (optional). A second automaton holds back whole tokens while their text
   could still become a banned string; the tokens before the held run are released. If a
   banned string completes, push reports the output token it started in and the stream
   accepts no more tokens until `rewind` takes it back to just before that token (the
   generator then bans that token there and samples again). Held text and tokens are never
   released, so a banned string is never streamed, even in part. Banned strings are checked
   before stop strings: the stop matcher only ever sees released text.

Token healing drops the first characters of the output (`skip_prefix`: the text of the prompt
token the generator took back and regenerated), so callers see only what the prompt lacked.
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
class BannedMatch:
    """A banned string completed; the output must be rewound to before output token `token`."""

    token: int  # index among the output tokens pushed so far (0 = the first output token)
    string: str


@dataclass(frozen=True, slots=True)
class TextDelta:
    """What one push made safe to show."""

    text: str  # whole characters only, never reaching into a stop string or a possible one
    stop_string: str | None  # the stop string that matched; `text` ends right before it
    tokens_consumed: int  # pushed tokens up to the one completing the match (all of them if none)
    # Output tokens whose text is now final, oldest held first: the tokens to stream with `text`.
    # Equal to tokens_consumed without banned strings; fewer while a banned string may be forming.
    released: int = 0
    banned: BannedMatch | None = None  # set: call rewind(banned.token) before pushing again


@dataclass(frozen=True, slots=True)
class _Held:
    """A pushed token whose text is held back, and the stream's state before it was pushed."""

    piece: str
    detok: tuple[tuple[int, ...], int, int, int]
    ban_state: int
    skip: str


class TextStream:
    """One job's token ids -> text deltas, UTF-8 safe, cut at the first stop string.

    Mutable and owned by its job. After a push reports a stop string, or after finish(),
    the stream is closed: push raises and finish returns "".
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop_strings: Sequence[str],
        skip_special_tokens: bool,
        banned_strings: Sequence[str] = (),
        skip_prefix: str = "",
    ) -> None:
        for name, strings in (("stop_strings", stop_strings), ("banned_strings", banned_strings)):
            if isinstance(strings, str):  # a str is a Sequence[str]: each character would be one
                raise TypeError(f"{name} must be a sequence of strings, not one string")
            if any(not s for s in strings):
                raise ValueError(f"{name} must not hold an empty string")
        self._detok = _Detokenizer(tokenizer, skip_special_tokens)
        self._stops = _StopMatcher(stop_strings)
        self._bans = _AhoCorasick(banned_strings) if banned_strings else None
        self._ban_state = 0
        self._held: list[_Held] = []
        self._skip = skip_prefix
        self._pushed = 0  # output tokens pushed and not rewound
        self._must_rewind = False
        self._closed = False
        # The stop string the held-back text completed at finish (text held for a banned string
        # that might follow reaches the stop strings only then); None when it completed none.
        self.finish_stop: str | None = None

    @property
    def held(self) -> int:
        """Output tokens pushed but not yet released (always 0 without banned strings)."""
        return len(self._held)

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        """Accept new tokens (several at once under speculative decoding)."""
        if self._closed:
            raise RuntimeError("push on a TextStream that already stopped or finished")
        if self._must_rewind:
            raise RuntimeError("push after a banned string matched, before rewind")
        parts: list[str] = []
        released = 0
        # Token by token, so a match is pinned to the token that completes it.
        for consumed, token in enumerate(token_ids, start=1):
            if self._bans is None:
                self._pushed += 1
                released += 1
                pieces: list[str] = [self._skipped(self._detok.step(token))]
            else:
                held = _Held("", self._detok.save(), self._ban_state, self._skip)
                self._pushed += 1
                piece = self._skipped(self._detok.step(token))
                match = self._hold(_Held(piece, held.detok, held.ban_state, held.skip))
                if isinstance(match, BannedMatch):
                    self._must_rewind = True
                    return TextDelta("".join(parts), None, consumed, released, match)
                pieces = match
            for piece in pieces:
                if self._bans is not None:
                    released += 1
                if not piece:
                    continue
                out, stop = self._stops.feed(piece)
                parts.append(out)
                if stop is not None:
                    self._closed = True
                    return TextDelta("".join(parts), stop, consumed, released)
        return TextDelta("".join(parts), None, len(token_ids), released)

    def rewind(self, token: int) -> None:
        """Take back output tokens `token` and later (they must still be held): the stream is as it
        was before token `token` was pushed."""
        first = self._pushed - len(self._held)
        if not first <= token < self._pushed:
            raise ValueError(f"can rewind only to a held token, in [{first}, {self._pushed}), not to {token}")
        at = self._held[token - first]
        self._detok.restore(at.detok)
        self._ban_state, self._skip = at.ban_state, at.skip
        del self._held[token - first :]
        self._pushed = token
        self._must_rewind = False

    def finish(self) -> str:
        """Release the held-back text at the end of a job that no stop string ended so far. That
        text may complete a stop string after all (`finish_stop`): it is cut there."""
        if self._closed:
            return ""
        self._closed = True
        # The flushed tail holds only U+FFFD (a genuine one, or an unfinished character),
        # which can complete a stop or banned string only if the caller put U+FFFD in one.
        tail = "".join(h.piece for h in self._held) + self._skipped(self._detok.flush())
        self._held = []
        if self._bans is not None:
            cut = min((i for s in self._bans.strings if (i := tail.find(s)) >= 0), default=len(tail))
            tail = tail[:cut]
        released, stop = self._stops.feed(tail)
        self.finish_stop = stop
        return released if stop is not None else released + self._stops.release()

    def _skipped(self, piece: str) -> str:
        """`piece` less what is left of the healed prefix."""
        if not self._skip or not piece:
            return piece
        n = min(len(self._skip), len(piece))
        if piece[:n] != self._skip[:n]:  # the output left the prefix: nothing more to drop
            self._skip = ""
            return piece
        self._skip = self._skip[n:]
        return piece[n:]

    def _hold(self, new: _Held) -> BannedMatch | list[str]:
        """Add a token to the held run; return the pieces of the tokens released from its front, or
        the banned match it completed."""
        bans = self._bans
        assert bans is not None
        self._held.append(new)
        before = sum(len(h.piece) for h in self._held[:-1])
        state = self._ban_state
        for i, ch in enumerate(new.piece):
            state = bans.step(state, ch)
            found = bans.match[state]
            if found >= 0:
                start = before + i + 1 - len(bans.strings[found])
                return BannedMatch(
                    self._pushed - len(self._held) + self._token_at(start), bans.strings[found]
                )
        self._ban_state = state
        keep_from = before + len(new.piece) - bans.depth[state]
        n = self._token_at(keep_from) if bans.depth[state] else len(self._held)
        # Textless tokens just before the held run (bytes of a character not yet complete, say)
        # belong with it: the character they start may start a banned string.
        while n > 0 and not self._held[n - 1].piece:
            n -= 1
        out = [h.piece for h in self._held[:n]]
        del self._held[:n]
        return out

    def _token_at(self, char: int) -> int:
        """Index in the held run of the token whose text holds held character `char`, moved back
        over the textless tokens right before it."""
        pos = 0
        for at, h in enumerate(self._held):
            if h.piece and pos <= char < pos + len(h.piece):
                k = at
                while k > 0 and not self._held[k - 1].piece:
                    k -= 1
                return k
            pos += len(h.piece)
        raise AssertionError(f"held character {char} is past the held text")


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


class _AhoCorasick:
    """An automaton over a set of strings, read a character at a time. A state is the longest
    suffix of the text read that is a prefix of some string; `depth[state]` is its length and
    `match[state]` the index of the longest string ending there (-1: none)."""

    def __init__(self, strings: Sequence[str]) -> None:
        self.strings = tuple(dict.fromkeys(strings))
        children: list[dict[str, int]] = [{}]
        depth = [0]
        match = [-1]
        for index, string in enumerate(self.strings):
            node = 0
            for ch in string:
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
        self.children = children
        self.fail = fail
        self.depth = depth
        self.match = match

    def step(self, state: int, ch: str) -> int:
        children, fail = self.children, self.fail
        while state and ch not in children[state]:
            state = fail[state]
        return children[state].get(ch, 0)


class _StopMatcher:
    """Aho-Corasick over the stop strings, fed the stream a character at a time."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._ac = _AhoCorasick(stop_strings)
        self._stops = self._ac.strings
        self._state = 0
        self._held = ""  # the last depth[state] characters of the stream, not yet released

    def feed(self, text: str) -> tuple[str, str | None]:
        """Return (text now safe to release, the stop string that matched or None)."""
        if not self._stops:
            return text, None
        buffer = self._held + text
        base = len(self._held)
        ac = self._ac
        children, fail, state = ac.children, ac.fail, self._state
        for i, ch in enumerate(text):
            while state and ch not in children[state]:
                state = fail[state]
            state = children[state].get(ch, 0)
            found = ac.match[state]
            if found >= 0:
                # The first stop string to complete; at a tie the longest, as it starts earliest.
                stop = self._stops[found]
                self._state, self._held = 0, ""
                return buffer[: base + i + 1 - len(stop)], stop
        self._state = state
        keep = len(buffer) - ac.depth[state]
        self._held = buffer[keep:]
        return buffer[:keep], None

    def release(self) -> str:
        held, self._held, self._state = self._held, "", 0
        return held
