"""The engine process's configuration: what crosses the pipe, and only that."""

from __future__ import annotations

import json
from pathlib import Path

from service.config import ServiceConfig
from service.engine_config import EngineConfig, EngineSettings, SpeculationFlags


def test_engine_config_round_trips_through_json() -> None:
    config = EngineConfig(
        settings=EngineSettings(model=Path("/models/x.gguf"), quant="int4", page_size=32, kv_cache="int8"),
        speculation=SpeculationFlags(speculate="ngram", num_draft_tokens=3, draft_model="/models/d.gguf"),
        warmup=False,
        torch_threads=2,
        omp_wait_policy="passive",
        omp_spin_count=0,
    )
    assert EngineConfig.from_json(config.to_json()) == config
    shipped = EngineConfig(EngineSettings(model=None))
    assert EngineConfig.from_json(shipped.to_json()) == shipped


def test_the_service_config_hands_the_engine_its_settings_and_nothing_of_the_front_end() -> None:
    service = ServiceConfig(
        model="/models/x.gguf",
        quant="int8",
        cache_tokens=4096,
        speculate="ngram",
        warmup=False,
        port=6000,
        tls_cert="/certs/c.pem",
        auth_tokens_file="/etc/tokens",
    )
    engine = service.engine_config()
    assert engine.settings.model == Path("/models/x.gguf")
    assert engine.settings.quant == "int8" and engine.settings.cache_tokens == 4096
    assert engine.speculation.speculate == "ngram" and engine.warmup is False
    crossing = engine.to_json()
    for front_end_only in ("port", "tls_cert", "auth_tokens_file", "max_streams", "hang_seconds"):
        assert front_end_only not in json.loads(crossing) and front_end_only not in crossing


def test_defaults_agree() -> None:
    """ServiceConfig's engine flags default to the engine config's own defaults (defined once)."""
    assert ServiceConfig().engine_config() == EngineConfig(EngineSettings(model=None))
