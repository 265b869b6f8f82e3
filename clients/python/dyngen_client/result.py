"""A whole job's outcome, assembled from the events of its stream."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb

Event = pb.GenerateEvent  # a oneof of started / prefill / delta / finished


@dataclass(frozen=True)
class Result:
    job_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: pb.JobFinished

    @property
    def stop_reason(self) -> str:
        """`eos`, `stop_token`, `stop_string`, `max_new_tokens`, `cancelled`, ... (`unspecified`
        when the stream ended without a finish event)."""
        return stop_reason_name(self.finished.stop_reason)


def stop_reason_name(value: pb.StopReason.ValueType) -> str:
    return pb.StopReason.Name(value).removeprefix("STOP_REASON_").lower()


def collect(events: Iterable[Event]) -> Result:
    text: list[str] = []
    ids: list[int] = []
    finished = pb.JobFinished()
    job_id = ""
    for e in events:
        job_id = e.job_id
        if e.HasField("delta"):
            text.append(e.delta.text)
            ids.extend(e.delta.token_ids)
        elif e.HasField("finished"):
            text.append(e.finished.text)
            finished = e.finished
    return Result(job_id, "".join(text), tuple(ids), finished)
