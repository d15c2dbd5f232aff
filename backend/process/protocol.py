"""The engine process's protocol: what a front end and the engine say to each other.

This is the engine contract across processes (docs/engines.md, "The engine process"): small
enough that a front end in another language could speak it.

Transport: ZMQ over `ipc://` sockets in one run directory. The engine binds a ROUTER at
`engine.sock`; each front end connects a DEALER, whose identity is its index (`front_end_identity`),
and binds a PULL at `front-end-<index>.sock`, to which the engine connects a PUSH once the front end
says Hello. Every message is one frame: a msgspec msgpack array whose first item names its kind.

Front end -> engine:
  Hello      who it is (index, pid, where to send), sent until Welcome comes back
  Submit     a validated request (GenerationRequest); its events come back in Events
  Cancel     end a request at the next step; Release: its call is over (its places at the door)
  Pause      stop stepping a request whose caller reads slowly; Resume
  Compile    compile a constraint where the masks are applied: Compiled answers, by ticket
  Status     the engine's figures now: StatusReport answers, by ticket
  WatchCache its KV-cache event batches from a sequence or a snapshot: WatchAnswer, then CacheBatch
             each; UnwatchCache stops them

Engine -> front end:
  Welcome    the model's description, the engine's pid (a front end watches it: its exit is the
             engine's death) and how many times the engine was started before
  Events     one engine step's events for this front end's requests, in order, by request id
  Compiled   a compile's report, or why it failed
  StatusReport  EngineStats (also sent unasked, at most every STATS_INTERVAL_S, for metrics)
  WatchAnswer   whether a watch started (its start may be no longer kept)
  CacheBatch    one KV-cache event batch for a watch

Request ids are the front end's own: the engine tells front ends apart itself. A front end that
dies has its requests cancelled and released by the engine at once.
"""

from __future__ import annotations

import msgspec

from backend.common.cache_events import CacheEventBatch
from backend.common.stats import EngineStats
from backend.constraints import CompileReport, ConstraintSpec
from backend.events import ErrorEvent, TokenEvent
from backend.types import GenerationRequest, ModelInfo

VERSION = 1
"""Raised with every change a peer of the previous version would misread."""

ENGINE_SOCKET = "engine.sock"
STATS_INTERVAL_S = 0.25
"""How often the engine sends its figures unasked while they change."""


def front_end_socket(index: int) -> str:
    return f"front-end-{index}.sock"


def front_end_identity(index: int) -> bytes:
    return f"fe{index}".encode()


class _Message(msgspec.Struct, array_like=True, tag=True):
    """Tagged by class name: encoded as [name, fields...]."""


# -- front end -> engine ----------------------------------------------------------------------------


class Hello(_Message):
    front_end: int
    pid: int
    address: str
    """Where the engine sends this front end's messages (its PULL socket)."""
    version: int = VERSION


class Submit(_Message):
    request: GenerationRequest


class Cancel(_Message):
    request_id: str


class Release(_Message):
    request_id: str


class Pause(_Message):
    request_id: str


class Resume(_Message):
    request_id: str


class Compile(_Message):
    ticket: int
    spec: ConstraintSpec


class Status(_Message):
    ticket: int


class WatchCache(_Message):
    ticket: int
    watch: int
    """The front end's name for this watch, in every CacheBatch for it."""
    start: int | None = None
    snapshot: bool = False


class UnwatchCache(_Message):
    watch: int


ToEngine = Hello | Submit | Cancel | Release | Pause | Resume | Compile | Status | WatchCache | UnwatchCache


# -- engine -> front end ----------------------------------------------------------------------------


class Welcome(_Message):
    info: ModelInfo
    pid: int
    restarts: int
    """How many times the engine was started again after dying, before this one."""
    cache_events: tuple[str, str, str] = ("", "", "")
    """Where the engine publishes its KV-cache events over ZMQ: endpoint, replay endpoint, topic."""
    version: int = VERSION


class Events(_Message):
    events: list[tuple[str, TokenEvent | ErrorEvent]]
    """(request id, event), in the order the engine produced them."""


class Compiled(_Message):
    ticket: int
    report: CompileReport | None = None
    error: str = ""
    """Why it cannot be enforced (ConstraintError), with `kind` the constraint's kind."""
    kind: str = ""
    busy: int = 0
    """Not compiled: this many large compiles run already (TooManyCompiles)."""


class StatusReport(_Message):
    ticket: int
    """0: sent unasked."""
    stats: EngineStats


class WatchAnswer(_Message):
    ticket: int
    started: bool
    oldest_kept: int
    """When not started: the oldest batch the engine still keeps (ask for a snapshot)."""


class CacheBatch(_Message):
    watch: int
    batch: CacheEventBatch


ToFrontEnd = Welcome | Events | Compiled | StatusReport | WatchAnswer | CacheBatch

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode
decode_to_engine = msgspec.msgpack.Decoder(ToEngine).decode
decode_to_front_end = msgspec.msgpack.Decoder(ToFrontEnd).decode
