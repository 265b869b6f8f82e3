"""The prefix-affinity key: the documented rule, test vectors any client can check itself against."""

from __future__ import annotations

import hashlib

import pytest

from dyngen_client import AFFINITY_HEADER, Chat, affinity_key
from dyngen_client.affinity import affinity_metadata, canonical_text


def test_test_vectors_of_docs_scaling() -> None:
    # The same values are printed in docs/SCALING.md for clients in other languages.
    assert affinity_key("Hello") == "185f8db32271fe25"
    assert affinity_key(Chat((("system", "You are terse."), ("user", "Hi")))) == "c29e6f9b1a47d500"
    assert affinity_key([1, 2, 3]) == "8a2ddba46c83c920"
    assert canonical_text([1, 2, 3]) == "1 2 3 "


def test_requests_sharing_the_leading_characters_share_the_key() -> None:
    system = ("system", "You are a support agent for ACME. " * 100)
    a = Chat((system, ("user", "Where is my order?")))
    b = Chat((system, ("user", "How do I reset my password?")))
    assert len(canonical_text(a)) > 2048
    assert affinity_key(a) == affinity_key(b)  # the system prompt alone fills the 2048 characters
    assert affinity_key(a, chars=10_000) != affinity_key(b, chars=10_000)
    other = Chat((("system", "You are a poet."), ("user", "Where is my order?")))
    assert affinity_key(other) != affinity_key(a)


def test_key_is_sha256_of_the_leading_code_points() -> None:
    text = "é" * 3000  # 2 UTF-8 bytes each: the cut counts characters, not bytes
    assert affinity_key(text) == hashlib.sha256(("é" * 2048).encode()).hexdigest()[:16]
    assert affinity_metadata(text, None) == ()
    assert affinity_metadata(text, 2048) == ((AFFINITY_HEADER, affinity_key(text)),)
    with pytest.raises(ValueError):
        affinity_key(text, 0)
