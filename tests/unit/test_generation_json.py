"""A generation's JSON answer (``ingress.generation._send_json``): what a request that does not
stream gets, and a stream that failed before its first token: the error's status, body and
headers (a Retry-After), as the app's own error handler sends them."""

from __future__ import annotations

import anyio
import msgspec

from switchyard.ingress.errors import RateLimited, generation_error
from switchyard.ingress.generation import _send_json


def _answer(error) -> tuple[int, dict[bytes, bytes], dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    anyio.run(_send_json, send, error)
    start, body = sent
    assert body["more_body"] is False
    return start["status"], dict(start["headers"]), msgspec.json.decode(body["body"])


def test_the_retry_after_of_an_error_is_sent():
    status, headers, body = _answer(RateLimited("Slow down; retry in about 3 s.", code="overloaded", retry_after_s=2.2))
    assert status == 429
    assert headers[b"retry-after"] == b"3" and headers[b"content-type"] == b"application/json"
    assert body["error"]["code"] == "overloaded"


def test_a_shed_stream_is_a_429_with_the_wait_it_was_told_and_none_it_was_not():
    status, headers, body = _answer(generation_error("overloaded", "was shed: overloaded", 4.0))
    assert status == 429 and headers[b"retry-after"] == b"4"
    assert body["error"]["type"] == "rate_limit_error"
    status, headers, _ = _answer(generation_error("overloaded", "was shed: overloaded"))
    assert status == 429 and b"retry-after" not in headers
