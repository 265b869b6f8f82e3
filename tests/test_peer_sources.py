"""The benchmark peers' code names no package index: pip fetches their sources from the indexes
its own configuration and environment name (benchmarks/peers/llamacpp.py). A URL there may only
be a loopback address, of a peer server this machine starts."""

from __future__ import annotations

import re
from pathlib import Path

PEERS = Path(__file__).resolve().parent.parent / "benchmarks" / "peers"
URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://([^/:\s\"'{}]*)")
# A dotted name ending in a common top-level domain: a host written without a scheme.
HOST = re.compile(r"\b(?:[a-z0-9-]+\.)+(?:org|com|net|io|dev|co|ai|app|cloud)\b", re.IGNORECASE)
INDEX_WORDS = ("pypi", "index-url", "index_url")
LOOPBACK = {"127.0.0.1", "localhost", "[::1]"}


def test_no_package_index_address_in_the_peers_code() -> None:
    files = [p for p in sorted(PEERS.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    assert any(p.name == "llamacpp.py" for p in files)
    found = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            bad = [h for h in URL.findall(line) if h not in LOOPBACK] + HOST.findall(line)
            bad += [w for w in INDEX_WORDS if w in line.lower()]
            if bad:
                found.append(f"{path.relative_to(PEERS)}:{n}: {bad}")
    assert not found, "\n".join(found)
