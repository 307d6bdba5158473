"""A completions request of several prompts: one response from several generations.

``/v1/completions`` takes a list of prompts (texts, or token-id lists), as OpenAI's legacy API and
vLLM's server do. Each prompt is a request of its own (``Generation``: its own request id on the
bus, its own placement, cache hits and migrations, its own share of the key's limits), all
submitted before the response starts and run at once. The client gets one response:

- the choices of prompt ``i`` are numbered ``i * n + j`` (``j``: the choice of that prompt), the
  numbering OpenAI and vLLM use;
- one ``id`` and ``created`` (the first prompt's), on every chunk of a stream;
- ``usage`` summed over the prompts (cached tokens too); a stream's ``include_usage`` chunk is
  one, at the end, with the sum. With ``continuous_usage_stats`` each chunk carries its own
  prompt's usage so far, as vLLM's does.

Each generation writes its response as if alone (``Generation`` is an ASGI app); ``Prompts``
relays what they write. A stream's events are renumbered and sent as each arrives (each write of
a generation is whole events), so the prompts' deltas interleave as they come; each
generation's own ending (its usage chunk and ``[DONE]``) is dropped, and the response's is sent
once every prompt ended.

A prompt that fails fails the response: the first failure is what the client gets (its status
and body before a stream started, its error event after), and the other prompts are cancelled as
if their client had left. A client that leaves cancels them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from switchyard.ingress.generation import JSON_HEADERS, SSE_HEADERS, Generation, sse

_DONE = b"[DONE]"


@dataclass
class _Failure:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""


@dataclass
class Prompts:
    """The ASGI response of one completions request of several prompts (see the module's note)."""

    parts: list[Generation]
    # Set when the response is settled without the rest of the prompts: the client left, or one
    # failed. Each generation hears it as its client leaving.
    _stop: anyio.Event = field(default_factory=anyio.Event)
    _failure: _Failure | None = None
    _started: bool = False  # our own http.response.start went out

    def __post_init__(self) -> None:
        assert len(self.parts) > 1, "one prompt is a Generation alone"
        first = self.parts[0]
        self._n = first.spec.sampling.n
        self._id, self._created = first.spec.request_id, first.created
        self._stream, self._include_usage = first.stream, first.include_usage

    async def __call__(self, scope, receive, send) -> None:
        async def part_receive() -> dict:
            await self._stop.wait()
            return {"type": "http.disconnect"}

        bodies: list[bytearray] = [bytearray() for _ in self.parts]
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_disconnect, receive)
            async with anyio.create_task_group() as parts:
                for i, part in enumerate(self.parts):
                    relay = self._relay_stream(i, send) if self._stream else self._relay_body(bodies[i])
                    parts.start_soon(part, scope, part_receive, relay)
            tg.cancel_scope.cancel()  # every prompt ended: stop watching the client
        if self._stop.is_set() and self._failure is None:
            return  # the client left: nobody to answer
        if self._stream:
            await self._end_stream(send)
        else:
            await self._send_body(send, bodies)

    async def _watch_disconnect(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._stop.set()

    def _fail(self, failure: _Failure) -> None:
        if self._failure is None:
            self._failure = failure
        self._stop.set()

    # --- non-streaming ------------------------------------------------------------------

    def _relay_body(self, body: bytearray):
        refused: list[_Failure] = []  # this prompt's error answer

        async def relay(message: dict) -> None:
            if message["type"] == "http.response.start":
                if message["status"] != 200:
                    refused.append(_Failure(message["status"], list(message.get("headers", []))))
                    self._fail(refused[0])  # the response's answer, if it is the first
                return
            if refused:
                refused[0].body += message.get("body", b"")
            else:
                body.extend(message.get("body", b""))

        return relay

    async def _send_body(self, send, bodies: list[bytearray]) -> None:
        if self._failure is not None:
            return await self._send_failure(send)
        choices: list[dict] = []
        for i, raw in enumerate(bodies):
            for choice in msgspec.json.decode(bytes(raw))["choices"]:
                choice["index"] += i * self._n
                choices.append(choice)
        first = self.parts[0]
        body = {
            "id": self._id,
            "object": "text_completion",
            "created": self._created,
            "model": first.model,
            "choices": choices,
            "usage": self._usage(),
        }
        await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": msgspec.json.encode(body), "more_body": False})

    async def _send_failure(self, send) -> None:
        failure = self._failure
        assert failure is not None
        await send({"type": "http.response.start", "status": failure.status, "headers": failure.headers})
        await send({"type": "http.response.body", "body": failure.body, "more_body": False})

    # --- streaming ----------------------------------------------------------------------

    def _relay_stream(self, i: int, send):
        refused: list[_Failure] = []  # this prompt answered with an error before its stream began

        async def relay(message: dict) -> None:
            if self._stop.is_set():
                return  # settled (a failure went out, or the client left): nothing more is sent
            if message["type"] == "http.response.start":
                if message["status"] != 200:
                    refused.append(_Failure(message["status"], list(message.get("headers", []))))
                return
            raw = message.get("body", b"")
            if refused:
                refused[0].body += raw
                if not message.get("more_body", False):
                    await self._refused_part(send, refused[0])
                return
            events, failed = self._renumbered(i, raw)
            if events:
                await self._start(send)
                await send({"type": "http.response.body", "body": events, "more_body": True})
            if failed:
                self._fail(_Failure(200, SSE_HEADERS))

        return relay

    async def _refused_part(self, send, failure: _Failure) -> None:
        """A prompt refused before its stream began: the response's answer if nothing was sent
        yet, else an error event in the stream (the other prompts' deltas went out)."""
        if self._started:
            await send({"type": "http.response.body", "body": b"data: " + failure.body + b"\n\n", "more_body": True})
            self._fail(_Failure(200, SSE_HEADERS))
        else:
            self._fail(failure)

    def _renumbered(self, i: int, raw: bytes) -> tuple[bytes, bool]:
        """Prompt ``i``'s SSE events as the response's: its choices renumbered, the response's
        id; its usage-only chunk and its ``[DONE]`` dropped. And whether one was an error."""
        out: list[bytes] = []
        failed = False
        for event in raw.split(b"\n\n"):
            if not event.startswith(b"data: "):
                continue
            data = event[len(b"data: ") :]
            if data == _DONE:
                continue
            payload: dict[str, Any] = msgspec.json.decode(data)
            if "error" in payload:
                failed = True
            else:
                if not payload.get("choices"):
                    continue  # its usage chunk: the response sends the sum
                for choice in payload["choices"]:
                    choice["index"] += i * self._n
                payload["id"], payload["created"] = self._id, self._created
            out.append(sse(payload))
        return b"".join(out), failed

    async def _start(self, send) -> None:
        if not self._started:
            self._started = True
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

    async def _end_stream(self, send) -> None:
        if self._failure is not None and not self._started:
            return await self._send_failure(send)
        if self._failure is not None:  # its error event went out: the stream ends there
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await self._start(send)
        ending = b""
        if self._include_usage:
            chunk = {
                "id": self._id,
                "object": "text_completion",
                "created": self._created,
                "model": self.parts[0].model,
                "choices": [],
                "usage": self._usage(),
            }
            ending = sse(chunk)
        await send({"type": "http.response.body", "body": ending + b"data: [DONE]\n\n", "more_body": False})

    def _usage(self) -> dict:
        usages = [part.usage() for part in self.parts]
        prompt = sum(u["prompt_tokens"] for u in usages)
        completion = sum(u["completion_tokens"] for u in usages)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
            },
        }


__all__ = ["Prompts"]
