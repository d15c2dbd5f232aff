"""Python client for tokenspout.

`Client` and `AsyncClient` cover every RPC with typed arguments and results; `tokenspout.v1` holds
the generated messages and stubs for anything else.
"""

from tokenspout.aio import AsyncClient, AsyncStream
from tokenspout.client import Client, Stream
from tokenspout.connection import Tls
from tokenspout.errors import (
    AbortedError,
    CancelledError,
    ConflictError,
    DeadlineExceededError,
    FieldViolation,
    InternalError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    Reason,
    TokenspoutError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from tokenspout.requests import Constraint, Dry, GenerateOptions, Message, Mirostat, Output, Sampling, Stopping, Xtc
from tokenspout.responses import (
    CallerStatus,
    Cancelled,
    Chunk,
    Compiled,
    Finish,
    Generation,
    ModelInfo,
    Sample,
    ServerStatus,
    Token,
    Tokenized,
    TokenizeResult,
    TokenOffsets,
)
from tokenspout.retry import RetryPolicy

__all__ = [
    "AbortedError",
    "AsyncClient",
    "AsyncStream",
    "CallerStatus",
    "Cancelled",
    "CancelledError",
    "Chunk",
    "Client",
    "Compiled",
    "ConflictError",
    "Constraint",
    "DeadlineExceededError",
    "Dry",
    "FieldViolation",
    "Finish",
    "GenerateOptions",
    "Generation",
    "InternalError",
    "InvalidRequestError",
    "Message",
    "Mirostat",
    "ModelInfo",
    "NotFoundError",
    "Output",
    "OverloadedError",
    "PermissionDeniedError",
    "Reason",
    "RetryPolicy",
    "Sample",
    "Sampling",
    "ServerStatus",
    "Stopping",
    "Stream",
    "Tls",
    "Token",
    "TokenOffsets",
    "TokenizeResult",
    "Tokenized",
    "TokenspoutError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "Xtc",
]
