"""The baseline "one engine alone": a zero-cost engine serving OpenAI SSE itself.

The same HTTP stack as the ingress (Starlette on uvicorn with httptools and uvloop),
one process, no bus, no scheduler: every request streams ``max_tokens`` tokens, one
SSE event per token, yielding to the event loop between tokens as an engine step
would. What Switchyard keeps of this figure is what its fabric costs, the same ratio
that is published for routers in front of engines.

    python -m bench.direct_engine --port 8100
"""

from __future__ import annotations

import argparse
import time

import anyio
import anyio.lowlevel
import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route


async def chat(request: Request) -> StreamingResponse:
    body = msgspec.json.decode(await request.body())
    max_tokens = int(body.get("max_tokens", 16))
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    created = int(time.time())

    async def events():
        for i in range(max_tokens):
            chunk = {
                "id": "direct",
                "object": "chat.completion.chunk",
                "created": created,
                "model": "direct",
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": f" t{i}"},
                        "logprobs": None,
                        "finish_reason": "length" if i == max_tokens - 1 else None,
                    }
                ],
            }
            yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
            await anyio.lowlevel.checkpoint()
        if include_usage:
            usage = {
                "id": "direct",
                "object": "chat.completion.chunk",
                "created": created,
                "model": "direct",
                "choices": [],
                "usage": {"prompt_tokens": 1, "completion_tokens": max_tokens, "total_tokens": max_tokens + 1},
            }
            yield b"data: " + msgspec.json.encode(usage) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        http="httptools",
        loop="uvloop",
        access_log=False,
        timeout_keep_alive=65,
    )


if __name__ == "__main__":
    main()
