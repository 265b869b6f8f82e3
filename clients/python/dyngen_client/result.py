"""A whole job's outcome, assembled from the events of its stream."""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable
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


class _Joined:
    """The events of one stream, joined as they come."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.ids: list[int] = []
        self.finished = pb.JobFinished()
        self.job_id = ""

    def add(self, e: Event) -> None:
        self.job_id = e.job_id
        if e.HasField("delta"):
            self.text.append(e.delta.text)
            self.ids.extend(e.delta.token_ids)
        elif e.HasField("finished"):
            self.text.append(e.finished.text)
            self.finished = e.finished

    def result(self) -> Result:
        return Result(self.job_id, "".join(self.text), tuple(self.ids), self.finished)


def collect(events: Iterable[Event]) -> Result:
    """A stream's events (Client.generate, Client.stream) joined into its Result."""
    joined = _Joined()
    for e in events:
        joined.add(e)
    return joined.result()


async def acollect(events: AsyncIterable[Event]) -> Result:
    """collect for AsyncClient's streams."""
    joined = _Joined()
    async for e in events:
        joined.add(e)
    return joined.result()
