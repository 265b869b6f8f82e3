"""Typed errors raised at the engine's edges.

Each carries a message written for the person who caused it (which file, which
field, which limit), so the CLI and the gRPC service can show it as is and map
its kind to an exit code or a status without parsing text.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """What went wrong, coarse enough to map onto CLI exit codes and gRPC statuses."""

    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    UNSUPPORTED = "unsupported"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    FAILED_PRECONDITION = "failed_precondition"  # the request is fine, the engine's state refuses it now
    ALREADY_EXISTS = "already_exists"
    INTERNAL = "internal"  # a fault inside the engine while running a job (the job failed, not the request)


class DyngenError(Exception):
    """Base of every error dyngen raises on purpose."""

    kind: ErrorKind = ErrorKind.INVALID_ARGUMENT
    spec_index: int | None = None  # DynamicGenerator.generate: which of its specs was refused


class ModelNotFoundError(DyngenError):
    """The model path does not exist or holds no loadable model."""

    kind = ErrorKind.NOT_FOUND


class UnsupportedModelError(DyngenError):
    """The model's architecture, a tensor's quant type or a config value is not supported."""

    kind = ErrorKind.UNSUPPORTED


class ModelFormatError(DyngenError):
    """The model files are present but malformed (missing tensor, wrong shape, bad metadata)."""

    kind = ErrorKind.INVALID_ARGUMENT


class PromptTooLongError(DyngenError):
    """A prompt (plus the tokens asked for) does not fit the context or the cache."""

    kind = ErrorKind.RESOURCE_EXHAUSTED


class InvalidRequestError(DyngenError):
    """A request's argument is out of range (names the field and the limit). `field` is the
    JobSpec field to blame, as a path (`sampling.top_p`), where one is: the service's BadRequest."""

    kind = ErrorKind.INVALID_ARGUMENT

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class CacheTooLargeError(DyngenError):
    """The KV cache asked for cannot be had: more than the machine's memory, or refused by the OS."""

    kind = ErrorKind.RESOURCE_EXHAUSTED


class QueueFullError(DyngenError):
    """The generator's queue holds max_q_size jobs already; try again later."""

    kind = ErrorKind.RESOURCE_EXHAUSTED


class JobNotFoundError(DyngenError):
    """No job with that id (never existed, or finished and forgotten)."""

    kind = ErrorKind.NOT_FOUND


class AdapterNotFoundError(DyngenError):
    """A request names a LoRA adapter that is not loaded."""

    kind = ErrorKind.NOT_FOUND


class AdapterInUseError(DyngenError):
    """An adapter cannot be unloaded while jobs run with it."""

    kind = ErrorKind.FAILED_PRECONDITION


class AdapterLimitError(DyngenError):
    """As many adapters as allowed are loaded already."""

    kind = ErrorKind.RESOURCE_EXHAUSTED


class FailedPreconditionError(DyngenError):
    """The request is fine, but the server is not set up for it (the message says which flag)."""

    kind = ErrorKind.FAILED_PRECONDITION


class AdapterExistsError(DyngenError):
    """An adapter of that name is loaded already."""

    kind = ErrorKind.ALREADY_EXISTS
