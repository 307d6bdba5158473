"""``ingress.prompts``: one response from the generations of several prompts. Each part here
is a scripted ASGI app that writes what a ``Generation`` writes; the response's renumbering,
usage, failures and cancellation are what is checked (end to end through the ``openai`` client:
``tests/e2e/test_openai_api.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import anyio
import anyio.lowlevel
import msgspec
import pytest

from switchyard.ingress.prompts import Prompts

pytestmark = pytest.mark.anyio

SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
JSON = [(b"content-type", b"application/json")]


def sse(payload) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else msgspec.json.encode(payload)) + b"\n\n"


def chunk(rid: str, index: int, text: str, finish: str | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": 7, "model": "m", "choices": [choice]}


@dataclass
class Part:
    """A generation's stand-in: writes ``messages`` (waiting ``hold`` first, if set), then
    stays until its client leaves if ``hang``."""

    rid: str
    messages: list[dict]
    n: int = 1
    stream: bool = True
    include_usage: bool = False
    hang: bool = False
    hold: anyio.Event | None = None
    prompt_tokens: int = 3
    completion_tokens: int = 2
    left: bool = False  # heard its client leave
    created: int = 7
    model: str = "m"
    spec: SimpleNamespace = field(init=False)

    def __post_init__(self) -> None:
        self.spec = SimpleNamespace(request_id=self.rid, sampling=SimpleNamespace(n=self.n))

    def usage(self) -> dict:
        total = self.prompt_tokens + self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": 1},
        }

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                if (await receive())["type"] == "http.disconnect":
                    self.left = True
                    tg.cancel_scope.cancel()

            tg.start_soon(watch)
            if self.hold is not None:
                await self.hold.wait()
            for message in self.messages:
                await send(message)
                await anyio.lowlevel.checkpoint()
            if not self.hang:
                tg.cancel_scope.cancel()


def streamed(rid: str, texts: list[str], n: int = 1) -> list[dict]:
    body = b"".join(sse(chunk(rid, i % n, t)) for i, t in enumerate(texts))
    ending = b"".join(sse(chunk(rid, j, "", "length")) for j in range(n))
    usage = sse({"id": rid, "object": "text_completion", "created": 7, "model": "m", "choices": [], "usage": {}})
    return [
        {"type": "http.response.start", "status": 200, "headers": SSE},
        {"type": "http.response.body", "body": body, "more_body": True},
        {"type": "http.response.body", "body": ending + usage + b"data: [DONE]\n\n", "more_body": False},
    ]


def whole(rid: str, texts: list[str]) -> list[dict]:
    choices = [{"index": j, "text": t, "logprobs": None, "finish_reason": "length"} for j, t in enumerate(texts)]
    body = {"id": rid, "object": "text_completion", "created": 7, "model": "m", "choices": choices, "usage": {}}
    return [
        {"type": "http.response.start", "status": 200, "headers": JSON},
        {"type": "http.response.body", "body": msgspec.json.encode(body), "more_body": False},
    ]


def refused(status: int, message: str) -> list[dict]:
    body = msgspec.json.encode({"error": {"message": message, "type": "x", "param": None, "code": str(status)}})
    return [
        {"type": "http.response.start", "status": status, "headers": JSON},
        {"type": "http.response.body", "body": body, "more_body": False},
    ]


async def serve(parts: list[Part], leave: anyio.Event | None = None) -> tuple[int, bytes]:
    sent: list[dict] = []

    async def receive() -> dict:
        await (leave or anyio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    with anyio.fail_after(5):
        await Prompts(parts)({"type": "http"}, receive, send)  # type: ignore[arg-type]
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) <= 1, starts
    ends = [m for m in sent if m["type"] == "http.response.body" and not m.get("more_body", False)]
    assert len(ends) <= 1 and (not ends or ends[0] is sent[-1]), "the response ends once, last"
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return (starts[0]["status"] if starts else 0), body


def events(body: bytes) -> list:
    out = []
    for event in body.split(b"\n\n"):
        if event:
            assert event.startswith(b"data: ")
            data = event[6:]
            out.append(data.decode() if data == b"[DONE]" else msgspec.json.decode(data))
    return out


async def test_a_stream_renumbers_each_prompts_choices_and_ends_once_with_the_summed_usage():
    parts = [Part("a", streamed("a", ["x", "y", "z", "w"], n=2), n=2, include_usage=True)]
    parts.append(Part("b", streamed("b", ["p", "q"], n=2), n=2, include_usage=True))
    status, body = await serve(parts)
    got = events(body)
    assert status == 200 and got[-1] == "[DONE]" and got.count("[DONE]") == 1
    chunks = [e for e in got[:-1] if e["choices"]]
    assert {c["id"] for c in got[:-1]} == {"a"}  # the first prompt's id on every chunk
    texts = {}
    for c in chunks:
        choice = c["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "xz", 1: "yw", 2: "p", 3: "q"}  # prompt i's choice j is i * n + j
    usage = [e for e in got[:-1] if not e["choices"]]
    assert len(usage) == 1 and usage[0] is got[-2]
    assert usage[0]["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 4,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


async def test_a_whole_response_joins_the_prompts_choices_in_order():
    parts = [Part("a", whole("a", ["x"]), stream=False), Part("b", whole("b", ["y"]), stream=False)]
    parts.append(Part("c", whole("c", ["z"]), stream=False))
    status, body = await serve(parts)
    reply = msgspec.json.decode(body)
    assert status == 200 and reply["id"] == "a"
    assert [(c["index"], c["text"]) for c in reply["choices"]] == [(0, "x"), (1, "y"), (2, "z")]
    assert reply["usage"]["prompt_tokens"] == 9 and reply["usage"]["total_tokens"] == 15


async def test_a_prompt_that_fails_fails_the_response_and_cancels_the_others():
    slow = Part("b", whole("b", ["y"]), stream=False, hang=True)
    parts = [Part("a", refused(429, "over the key's limit"), stream=False), slow]
    status, body = await serve(parts)
    assert status == 429 and msgspec.json.decode(body)["error"]["message"] == "over the key's limit"
    assert slow.left  # told to stop, as if its client had left


async def test_a_prompt_refused_once_another_streams_becomes_an_error_event():
    go = anyio.Event()
    first = Part("a", streamed("a", ["x"])[:2], hang=True)  # streams, then waits
    late = Part("b", refused(503, "no worker"), hold=go)

    async def release() -> None:
        await anyio.sleep(0.05)
        go.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(release)
        status, body = await serve([first, late])
    got = events(body)
    assert status == 200 and got[0]["choices"][0]["text"] == "x"
    assert got[-1]["error"]["message"] == "no worker" and "[DONE]" not in got
    assert first.left


async def test_an_error_event_mid_stream_ends_the_response_there():
    error = sse({"error": {"message": "worker lost", "type": "server_error", "param": None, "code": "x"}})
    failing = Part(
        "a",
        [
            {"type": "http.response.start", "status": 200, "headers": SSE},
            {"type": "http.response.body", "body": sse(chunk("a", 0, "x")), "more_body": True},
            {"type": "http.response.body", "body": error, "more_body": True},
            {"type": "http.response.body", "body": b"", "more_body": False},
        ],
    )
    other = Part("b", streamed("b", ["y"])[:2], hang=True)
    status, body = await serve([failing, other])
    got = events(body)
    assert status == 200 and got[-1]["error"]["message"] == "worker lost" and "[DONE]" not in got
    assert other.left


async def test_a_client_that_leaves_cancels_every_prompt_and_gets_nothing_more():
    leave = anyio.Event()
    parts = [Part("a", streamed("a", ["x"])[:2], hang=True), Part("b", [], hang=True)]

    async with anyio.create_task_group() as tg:

        async def go() -> None:
            await anyio.sleep(0.05)
            leave.set()

        tg.start_soon(go)
        status, body = await serve(parts, leave)
    assert status == 200 and all(p.left for p in parts)
    assert "[DONE]" not in events(body)
