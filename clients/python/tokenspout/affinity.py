"""The affinity key: the `x-tokenspout-affinity` header that pins calls sharing a prefix to one replica.

A replica caches the prompts it has computed, so the next turn of a chat costs only its new
messages there, and its whole history anywhere else. Envoy (ring_hash) and HAProxy (balance hdr)
in deploy/ hash this header onto a replica. The rule, the same in every client (clients/README.md;
clients/affinity-vectors.json holds test vectors):

- a session id the caller gives: sent as it is (1 to 128 visible ASCII characters);
- a chat: "chat-" + the first 32 hex digits of SHA-256 over its leading messages, up to and
  including the first `user` message (all of them if none is), each as role, NUL, content, NUL
  in UTF-8. Every later turn of the chat resends those messages unchanged, so the key holds;
- a prompt: "text-" + the same digest of its first 256 characters (Unicode code points), the
  part a longer prompt that continues it shares;
- token ids: "tokens-" + the same digest of its first 256 ids, written in decimal and separated
  by single spaces.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenspout.v1 import generation_pb2 as pb

HEADER = "x-tokenspout-affinity"
PROMPT_CHARACTERS = 256
_SESSION_ID = re.compile(r"[\x21-\x7e]{1,128}")


def _digest(data: str) -> str:
    return hashlib.sha256(data.encode("utf-8")).hexdigest()[:32]


def session_key(session_id: str) -> str:
    if not _SESSION_ID.fullmatch(session_id):
        raise ValueError("session_id must be 1 to 128 visible ASCII characters (it travels as a header)")
    return session_id


def chat_key(messages: Sequence[tuple[str, str]]) -> str:
    """The key of a chat given as (role, content) pairs."""
    leading = []
    for role, content in messages:
        leading.append(f"{role}\0{content}\0")
        if role == "user":
            break
    return "chat-" + _digest("".join(leading))


def prompt_key(prompt: str) -> str:
    return "text-" + _digest(prompt[:PROMPT_CHARACTERS])


def token_ids_key(ids: Sequence[int]) -> str:
    return "tokens-" + _digest(" ".join(str(i) for i in ids[:PROMPT_CHARACTERS]))


def affinity_key(request: pb.GenerateStreamRequest | pb.GenerateRequest, session_id: str | None = None) -> str:
    """The key of a GenerateStreamRequest or GenerateRequest."""
    if session_id is not None:
        return session_key(session_id)
    if request.WhichOneof("input") == "chat":
        return chat_key([(m.role, m.content) for m in request.chat.messages])
    if request.WhichOneof("input") == "prompt_token_ids":
        return token_ids_key(request.prompt_token_ids.ids)
    return prompt_key(request.prompt)


def with_affinity(
    metadata: tuple[tuple[str, str], ...], request: pb.GenerateStreamRequest | pb.GenerateRequest, session_id: str | None
) -> tuple[tuple[str, str], ...]:
    return (*metadata, (HEADER, affinity_key(request, session_id)))

