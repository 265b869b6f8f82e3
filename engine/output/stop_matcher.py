"""Stop-string matching over streamed text, and the Aho-Corasick automaton it runs on.

The automaton reads the text a character at a time. Its state is the longest suffix of the text
that is a prefix of some string: exactly the text to hold back. It reports the first string to
complete, so the result does not depend on how the text is split into tokens or pushes. The text
stream also runs one over its banned strings.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class AhoCorasick:
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


class StopMatcher:
    """Aho-Corasick over the stop strings, fed the stream a character at a time."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._ac = AhoCorasick(stop_strings)
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
