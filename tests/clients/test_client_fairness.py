"""The Python client's fair-sharing fields: priority and queue_timeout_ms go into both request kinds,
and GetServerStatus's per-caller list comes back typed."""

from __future__ import annotations

from tokenspout import CallerStatus, Reason, ServerStatus
from tokenspout.requests import generate_request
from tokenspout.responses import from_proto
from tokenspout.v1 import generation_pb2 as pb


def test_priority_and_queue_timeout_reach_both_request_kinds():
    for message_class in (pb.GenerateStreamRequest, pb.GenerateRequest):
        request = generate_request(message_class, "Hi", {"priority": -2, "queue_timeout_ms": 250})
        assert (request.priority, request.queue_timeout_ms) == (-2, 250)
        assert generate_request(message_class, "Hi", {}).priority == 0


def test_the_per_caller_status_is_typed():
    response = pb.GetServerStatusResponse(running_sequences=3, callers=[
        pb.CallerStatus(caller="team-a", running_sequences=2, queued_requests=5, shed_total=1, weight=2.0),
        pb.CallerStatus(caller="", running_sequences=1),
    ])
    status = from_proto(ServerStatus, response)
    assert status.callers == [
        CallerStatus(caller="team-a", running_sequences=2, queued_requests=5, shed_total=1, weight=2.0),
        CallerStatus(caller="", running_sequences=1),
    ]
    assert {Reason.CALLER_OVER_LIMIT, Reason.SHED, Reason.QUEUE_TIMEOUT, Reason.PRIORITY_NOT_ALLOWED} <= set(Reason)
