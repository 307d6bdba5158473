"""The edge's limits through the real HTTP stack (ingress.edge, ingress.app): JSON depth,
header bytes and fields, connections, streams, slow heads and bodies, idle connections,
clients that stop reading, and a huge prompt tokenized without holding up anyone else.

Raw sockets where a real client would not misbehave that way. Every limit is small here
(a second), so a test waits at most a few seconds for one to fire."""

from __future__ import annotations

import contextlib
import gc
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from switchyard.procs import nats_server
from switchyard.workers.sim import SimCostModel
from tests.support.stack import MODEL, running_stack, wait_until

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Tell me about the switchyard."}]
LIMITS = {
    "max_connections": 8,
    "max_header_bytes": 8192,
    "max_headers": 50,
    "header_timeout_s": 1.0,
    "body_timeout_s": 1.0,
    "keep_alive_timeout_s": 1.0,
    "send_timeout_s": 1.0,
}


@pytest.fixture(scope="module")
def stack(module_nats):
    with running_stack(module_nats.url, ingress_overrides=LIMITS) as stack:
        yield stack


@pytest.fixture(scope="module")
def slow_stack():
    """Decode at 20 tokens/s, so a request stays in flight for as long as a test needs. Its
    own NATS: on the other stack's, its requests could be placed on that stack's workers."""
    with (
        nats_server() as nats,
        running_stack(
            nats.url,
            decode_cost=SimCostModel(decode_step_base_s=0.05),
            ingress_overrides={**LIMITS, "max_streams": 2},
        ) as stack,
    ):
        yield stack


def connect(stack) -> socket.socket:
    host, port = stack.ingress.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_quietly(sock: socket.socket, data: bytes) -> None:
    """The server may refuse and close before it has read everything we send."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(data)


def read_all(sock: socket.socket, timeout_s: float = 5.0) -> bytes:
    """Everything until the server closes; raises TimeoutError if it never does."""
    sock.settimeout(timeout_s)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def status_and_error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, msgspec.json.decode(body)["error"]


def dechunk(body: bytes) -> bytes:
    """A chunked body's content."""
    out = b""
    while True:
        size, _, body = body.partition(b"\r\n")
        if not (n := int(size, 16)):
            return out
        out, body = out + body[:n], body[n + 2 :]


def head(path: str = "/v1/models", method: str = "GET", extra: bytes = b"") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nhost: test\r\n".encode() + extra


def refusals(stack, reason: str) -> float:
    """``switchyard_edge_refusals_total{reason}`` as the ingress's GET /metrics shows it."""
    text = httpx.get(stack.ingress.url + "/metrics", timeout=5).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "switchyard_edge_refusals")
    return next(s.value for s in family.samples if s.name.endswith("_total") and s.labels["reason"] == reason)


@contextlib.contextmanager
def counted(stack, reason: str, times: int = 1) -> Iterator[None]:
    """The block makes the edge count ``times`` refusals for ``reason``, no more."""
    before = refusals(stack, reason)
    yield
    assert wait_until(lambda: refusals(stack, reason) >= before + times)
    assert refusals(stack, reason) == before + times


def still_serving(stack) -> bool:
    return httpx.get(stack.ingress.url + "/v1/models", timeout=5).status_code == 200


# --- JSON depth ---------------------------------------------------------------------------------------


def test_json_nested_100000_deep_is_a_400_naming_the_depth(stack):
    deep = b"[" * 100_000 + b"]" * 100_000
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "extra": %s}' % (MODEL.encode(), deep)
    response = httpx.post(stack.ingress.url + CHAT, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "json_too_deep" and "64 deep" in error["message"]
    assert still_serving(stack)


def test_json_nested_within_the_limit_is_served(stack):
    within = b"[" * 60 + b"]" * 60 + b', "text": "' + b"[" * 1000 + b'"'  # brackets in a string do not nest
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "extra": %s}' % (
        MODEL.encode(),
        within,
    )
    response = httpx.post(stack.ingress.url + CHAT, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


# --- tokenizing off the event loop -----------------------------------------------------------------------


def test_a_small_request_is_answered_while_a_long_prompt_is_tokenized(stack, monkeypatch):
    tokenizer = stack.ingress.tokenizer
    tokenizing, served = threading.Event(), threading.Event()
    encode = tokenizer.encode

    def held(text: str) -> list[int]:  # the long prompt stays in the tokenizer until the small one is served
        if len(text) > 50_000:
            tokenizing.set()
            served.wait(30)
        return encode(text)

    monkeypatch.setattr(tokenizer, "encode", held)
    finished: list[str] = []

    def long() -> None:
        # 99 KB: short enough to pass the size check (at most 25 bytes a token), ~18000 tokens once tokenized
        body = {"model": MODEL, "prompt": "switchyard " * 9_000, "max_tokens": 1}
        response = httpx.post(stack.ingress.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 400 and "the prompt has" in response.json()["error"]["message"]
        finished.append("long")

    thread = threading.Thread(target=long)
    thread.start()
    try:
        assert tokenizing.wait(30)
        response = httpx.post(
            stack.ingress.url + CHAT, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2}, timeout=60
        )
        assert response.status_code == 200
        finished.append("small")
    finally:
        served.set()
        thread.join(60)
    assert finished == ["small", "long"]


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
def test_a_multi_megabyte_prompt_is_refused_untokenized_while_another_is_tokenized(stack, monkeypatch, path):
    """The size check answers a prompt far past the context at once: its 7.7 MB never reach
    the tokenizer, while another client's prompt holds one of its threads."""
    tokenizer = stack.ingress.tokenizer
    tokenizing, refused = threading.Event(), threading.Event()
    tokenized: list[int] = []
    encode = tokenizer.encode

    def watched(text: str) -> list[int]:
        tokenized.append(len(text))
        if len(text) > 50_000:
            tokenizing.set()
            refused.wait(30)
        return encode(text)

    monkeypatch.setattr(tokenizer, "encode", watched)
    other = threading.Thread(
        target=httpx.post,
        args=(stack.ingress.url + "/v1/completions",),
        kwargs={"json": {"model": MODEL, "prompt": "switchyard " * 9_000, "max_tokens": 1}, "timeout": 60},
    )
    other.start()
    huge = "switchyard " * 700_000
    body = {"model": MODEL, "max_tokens": 1}
    body |= {"prompt": huge} if path != CHAT else {"messages": [{"role": "user", "content": huge}]}
    try:
        assert tokenizing.wait(30)
        response = httpx.post(stack.ingress.url + path, json=body, timeout=60)
        refused.set()
    finally:
        refused.set()
        other.join(60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "before tokenizing" in error["message"]
    assert all(size < 1_000_000 for size in tokenized)  # the other prompt only


# --- headers ---------------------------------------------------------------------------------------------


def test_ten_thousand_headers_are_a_431(stack):
    sock = connect(stack)
    fields = b"".join(b"x-h%d: v\r\n" % i for i in range(10_000))
    send_quietly(sock, head(extra=fields) + b"\r\n")
    status, error = status_and_error(read_all(sock))
    assert status == 431 and error["code"] == "request_header_fields_too_large"
    assert still_serving(stack)


def test_more_header_fields_than_the_limit_are_a_431_even_when_small(stack):
    sock = connect(stack)
    with counted(stack, "too_many_headers"):
        send_quietly(sock, head(extra=b"".join(b"x%d: v\r\n" % i for i in range(60))) + b"\r\n")  # 600 bytes
        status, error = status_and_error(read_all(sock))
    assert status == 431 and "at most 50 headers" in error["message"]


def test_a_one_megabyte_header_is_a_431(stack):
    sock = connect(stack)
    with counted(stack, "headers_too_large"):
        send_quietly(sock, head(extra=b"x-big: " + b"a" * 1024 * 1024 + b"\r\n") + b"\r\n")
        status, error = status_and_error(read_all(sock))
    assert status == 431 and "8192 bytes" in error["message"]
    assert still_serving(stack)


def test_headers_within_the_limits_are_served(stack):
    headers = {f"x-h{i}": "v" * 100 for i in range(40)}  # 40 fields, about 4.5 KB
    response = httpx.get(stack.ingress.url + "/v1/models", headers=headers)
    assert response.status_code == 200


# --- connections ------------------------------------------------------------------------------------------


def test_a_request_past_the_connection_limit_is_a_503_with_retry_after(stack):
    before = refusals(stack, "too_many_connections")
    held = [connect(stack) for _ in range(LIMITS["max_connections"])]
    try:
        sock = connect(stack)
        send_quietly(sock, head() + b"\r\n")
        response = read_all(sock)
        status, error = status_and_error(response)
        assert status == 503 and error["code"] == "too_many_connections"
        assert b"\r\nretry-after: 1\r\n" in response.partition(b"\r\n\r\n")[0].lower() + b"\r\n"
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: still_serving(stack))
    assert refusals(stack, "too_many_connections") == before + 1


# --- slow and idle clients ---------------------------------------------------------------------------------


def trickle(sock: socket.socket, data: bytes, every_s: float = 0.05, within_s: float = 5.0) -> bytes:
    """Sends ``data`` a byte at a time until the server answers; returns what it answered."""
    sock.settimeout(every_s)
    deadline = time.monotonic() + within_s
    for byte in data:
        if time.monotonic() > deadline:
            break
        send_quietly(sock, bytes([byte]))
        try:
            if first := sock.recv(65536):
                return first + read_all(sock)
        except TimeoutError:
            continue
        return b""  # closed without an answer
    raise AssertionError("the server took the whole trickle")


def test_a_head_trickled_byte_by_byte_is_cut_off_with_a_408(stack):
    sock = connect(stack)
    with counted(stack, "head_timeout"):
        status, error = status_and_error(trickle(sock, head(extra=b"x-slow: " + b"s" * 1000)))
    assert status == 408 and error["code"] == "request_timeout" and "request head" in error["message"]


def test_a_body_trickled_byte_by_byte_is_cut_off_with_a_408(stack):
    body = msgspec.json.encode({"model": MODEL, "messages": MESSAGES, "pad": "p" * 1000})
    sock = connect(stack)
    sock.sendall(
        head(CHAT, "POST", b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)),
    )
    with counted(stack, "body_timeout"):
        status, error = status_and_error(trickle(sock, body))
    assert status == 408 and "request body" in error["message"]
    assert wait_until(lambda: len(stack.ingress.router) == 0)


def test_a_connection_that_sends_nothing_is_closed(stack):
    with counted(stack, "idle"):
        sock = connect(stack)
        assert read_all(sock) == b""  # closed within the 5 s read_all waits: the limit is 1 s


def test_a_kept_alive_connection_is_closed_when_idle(stack):
    with counted(stack, "idle", times=0):  # the normal end of a kept-alive connection
        sock = connect(stack)
        sock.sendall(head() + b"\r\n")
        assert read_all(sock).startswith(b"HTTP/1.1 200")  # answered, then closed within 5 s


# --- streams ----------------------------------------------------------------------------------------------


def open_stream(stack, max_tokens: int = 400) -> tuple[httpx.Client, httpx.Response, Iterator[str]]:
    client = httpx.Client(timeout=30)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "stream": True}
    response = client.send(client.build_request("POST", slow_url(stack), json=body), stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()  # kept: an iterator dropped half-read closes the connection
    next(lines)  # the role chunk: the request is in flight
    return client, response, lines


def slow_url(stack) -> str:
    return stack.ingress.url + CHAT


def test_a_stream_past_the_ingress_limit_is_a_429_with_retry_after(slow_stack):
    streams = [open_stream(slow_stack) for _ in range(2)]
    try:
        response = httpx.post(slow_url(slow_stack), json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "too_many_streams"
    finally:
        for client, response, _ in streams:
            response.close()
            client.close()
    assert wait_until(lambda: len(slow_stack.ingress.router) == 0)
    response = httpx.post(slow_url(slow_stack), json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
    assert response.status_code == 200


def server_side(client: socket.socket, servers: list[ServerState]) -> HttpToolsProtocol | None:
    """The server's protocol object for our connection (the stack runs in this process)."""
    ours = client.getsockname()
    return next((p for s in servers for p in list(s.connections) if p.client == ours), None)


def test_a_client_that_stops_reading_is_dropped_and_its_request_cancelled(slow_stack):
    decode = slow_stack.workers_of("decode")[0]
    dropped = refusals(slow_stack, "slow_reader")
    servers = [o for o in gc.get_objects() if isinstance(o, ServerState)]  # slow: before connecting
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connecting: a small window
    host, port = slow_stack.ingress.url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    # The kernel's buffers on the server's side too: a response of a few KB then outgrows
    # them, as one of megabytes would outgrow the usual ones.
    assert wait_until(lambda: server_side(sock, servers) is not None)
    server = server_side(sock, servers)
    assert server is not None
    server.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    body = msgspec.json.encode({"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "stream": True})
    sock.sendall(head(CHAT, "POST", b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)) + body)
    assert wait_until(lambda: decode.role.running() == 1, timeout_s=5)
    # We never read: the server's writes stall within seconds, and a second later it drops
    # us and cancels the request, which would otherwise decode for 100 s.
    assert wait_until(lambda: decode.role.running() == 0, timeout_s=15)
    assert wait_until(lambda: len(slow_stack.ingress.router) == 0)
    assert refusals(slow_stack, "slow_reader") == dropped + 1
    sock.close()


def test_a_slow_reader_that_keeps_reading_is_served_in_full(stack):
    servers = [o for o in gc.get_objects() if isinstance(o, ServerState)]  # slow: before connecting
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    host, port = stack.ingress.url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    assert wait_until(lambda: server_side(sock, servers) is not None)
    server = server_side(sock, servers)
    assert server is not None
    server.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    body = msgspec.json.encode({"model": MODEL, "messages": MESSAGES, "max_tokens": 4000})
    sock.sendall(head(CHAT, "POST", b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)) + body)
    # About 24 KB in one write, taken a little at a time: never drained for seconds, always moving.
    response, started = b"", time.monotonic()
    sock.settimeout(5)
    while not response.endswith(b"\r\n0\r\n\r\n"):  # the last chunk
        time.sleep(0.25)
        chunk = sock.recv(8192)
        assert chunk, "closed before the whole response"
        response += chunk
    assert time.monotonic() - started > 1.5  # longer than the send timeout, so it was tested
    reply = msgspec.json.decode(dechunk(response.partition(b"\r\n\r\n")[2]))
    assert reply["usage"]["completion_tokens"] == 4000
    sock.close()
