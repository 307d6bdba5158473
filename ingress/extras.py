"""The rest of the surface clients reach for: tokenizing as the API would, and request ids.

``POST /tokenize`` and ``POST /detokenize`` have vLLM's shapes. ``/tokenize`` returns the very
ids a completion (``prompt``) or a chat completion (``messages``, through the model's chat
template) would prefill, so a client can count and budget before it sends; ``/detokenize``
turns ids back into text.

``x-request-id``: a client's own id (at most 128 printable ASCII characters, no space) is
kept, any other is replaced by a fresh one; either is echoed on the response, set on the
request's span and named in its log lines. The bus keeps its own ids (unique by
construction: a client's could collide).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import msgspec
from starlette.datastructures import Headers, MutableHeaders

from switchyard.ingress.openai_types import ChatMessage, Tool

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # rendered by the chat template with the messages
    chat_template_kwargs: dict[str, Any] | None = None  # likewise (ingress.openai_types.template_kwargs)


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


def request_id_of(scope) -> str:
    """The request's id: the client's ``x-request-id`` if it is a safe one, else a new one."""
    given = Headers(scope=scope).get(REQUEST_ID_HEADER)
    return given if given is not None and _REQUEST_ID_RE.fullmatch(given) else uuid.uuid4().hex


class RequestIdMiddleware:
    """Decides each HTTP request's id (``scope["state"]["request_id"]``) and echoes it on the
    response, errors included."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = request_id

        async def echo(message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        await self.app(scope, receive, echo)


__all__ = ["REQUEST_ID_HEADER", "DetokenizeRequest", "RequestIdMiddleware", "TokenizeRequest", "request_id_of"]
