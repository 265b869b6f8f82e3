"""The pipe messages between front end and engine round-trip exactly, and engine events map to the proto."""

from __future__ import annotations

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.cache.kv_events import AllBlocksCleared, BlocksRemoved, BlockStored, KvEvent
from engine.jobs import (
    JobEvent,
    JobFinished,
    JobId,
    JobSpec,
    JobStarted,
    JobTimings,
    PrefillProgress,
    SamplingSettings,
    StopReason,
    TokenLogprob,
    TokensGenerated,
)
from engine.prompt.guidance import Guidance
from service.frontend.codec import event_to_proto
from service.ipc import (
    Accepted,
    AdapterView,
    EngineStats,
    ErrorCode,
    Message,
    Ready,
    Rejection,
    Submit,
    Tag,
    pack_adapters,
    pack_events,
    pack_kv_events,
    unpack_adapters,
    unpack_events,
    unpack_kv_events,
)


def test_messages_round_trip() -> None:
    for tag in Tag:
        msg = Message(tag, 2**63 + 5, b"\x00payload\xff")
        assert Message.decode(msg.encode()) == msg
    assert Accepted.from_bytes(Accepted("ab" * 16, 40).to_bytes()) == Accepted("ab" * 16, 40)
    r = Rejection(ErrorCode.QUEUE_FULL, 'queue holds 4 jobs "already"')
    assert Rejection.from_bytes(r.to_bytes()) == r
    job = JobId("f" * 32)
    events: list[JobEvent] = [
        JobStarted(job, "tag", 7, 4),
        PrefillProgress(job, None, 3, 7),
        TokensGenerated(job, "tag", "Hi", (5,), (TokenLogprob(5, -0.5, ((5, -0.5),), 0.9, ((5, 0.9),)),)),
        JobFinished(job, None, StopReason.STOP_STRING, None, "END", 10, 3, 0, JobTimings(0.1, 0.2, 0.3)),
    ]
    assert unpack_events(pack_events(events)) == events
    spec = JobSpec(
        (1, 2, 3),
        9,
        stop_token_ids=frozenset({4}),
        sampling=SamplingSettings(temperature=0.7, logit_bias=((3, -1.5),), seed=5),
        guidance=Guidance(1.5, (6, 7)),
        tenant="alice",
        priority=-3,
    )
    assert Submit.from_bytes(Submit(job, spec).to_bytes()) == Submit(job, spec)
    views = [AdapterView("a~1f", "a", "rank 8 on q_proj", 2, False), AdapterView("b", "", "rank 4", 0, True)]
    assert unpack_adapters(pack_adapters(views)) == views
    s = EngineStats(1, 2, 3, 4, 5, 6, 7, 8, 9)
    assert EngineStats.from_bytes(s.to_bytes()) == s
    ready = Ready(
        "m.gguf",
        "/tmp/t",
        4096,
        "lin",
        "cpu",
        "kv",
        "bfloat16",
        512,
        16384,
        64,
        "cpu",
        64,
        "slices",
        {"imports": 1.5},
    )
    assert Ready.from_bytes(ready.to_bytes()) == ready
    kv: list[KvEvent] = [
        AllBlocksCleared(),
        BlockStored(2**64 - 1, None, (1, 2), salted=True),
        BlocksRemoved((3,)),
    ]
    assert unpack_kv_events(pack_kv_events(kv)) == kv


def test_engine_events_become_generate_events() -> None:
    job = JobId("f" * 32)
    delta = event_to_proto(
        TokensGenerated(job, "tag", "Hi", (5,), (TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.0))),))
    )
    assert delta.identifier == "tag" and delta.delta.text == "Hi" and list(delta.delta.token_ids) == [5]
    assert [t.token_id for t in delta.delta.logprobs[0].top] == [5, 6]
    done = event_to_proto(
        JobFinished(job, None, StopReason.STOP_STRING, None, "END", 10, 3, 0, JobTimings(0.1, 0.2, 0.3))
    )
    f = done.finished
    assert (
        f.stop_reason == pb.STOP_REASON_STOP_STRING
        and f.stop_string == "END"
        and not f.HasField("stop_token")
    )
    assert (f.prompt_tokens, f.new_tokens) == (10, 3) and abs(f.timings.decode_seconds - 0.3) < 1e-9
