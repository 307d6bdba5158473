"""The Batch API end to end through the official ``openai`` client, on the sim stack with
``--auth keys`` and a batch runner sending lines back through the ingress with a
trusted-proxy key: files.create, batches.create, batches.retrieve until completed,
files.content (one line per input line, usage with prompt_tokens_details.cached_tokens,
the shared system prompt cached), batches.list in pages, batches.cancel; bad input as
OpenAI-shaped errors (a failed batch naming the lines, or 400/404); another tenant sees none
of it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest

from switchyard.ingress.auth import KeyStore
from switchyard.ingress.batch_config import BatchRunnerConfig
from switchyard.ingress.batch_runner import BatchRunner
from switchyard.workers.sim import SimCostModel
from tests.support.stack import MODEL, running_stack

SYSTEM = "You are a careful grader. " * 20  # a long prefix every line shares
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, str]:
    store = KeyStore(tmp_path_factory.mktemp("auth") / "keys.json")
    secrets = {name: store.create(tenant)[1] for name, tenant in (("alice", "acme"), ("bob", "other"))}
    runner_file = store.path.parent / "runner.key"
    runner_file.write_text(store.create("batch-runner", trusted_proxy=True)[1] + "\n")
    return secrets | {"path": str(store.path), "runner_file": str(runner_file)}


@pytest.fixture(scope="module")
def stack(module_nats, keys):
    overrides = {"auth": "keys", "keys_file": keys["path"]}
    decode = SimCostModel(decode_step_base_s=0.002)
    with running_stack(module_nats.url, ingress_overrides=overrides, decode_cost=decode) as stack:
        runner = BatchRunner(
            BatchRunnerConfig(
                nats_url=module_nats.url,
                ingress_url=stack.ingress.url,
                api_key_file=keys["runner_file"],
                scan_interval_s=0.1,
                batch_concurrency=4,
            )
        )
        stack.start(runner.run)
        yield stack


def client(stack, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=secret, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def alice(stack, keys) -> openai.OpenAI:
    return client(stack, keys["alice"])


def chat_line(i: int, max_tokens: int = 4, **extra) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
    return {"custom_id": f"q-{i}", "method": "POST", "url": CHAT, "body": body} | extra


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def upload(c: openai.OpenAI, data: bytes) -> str:
    return c.files.create(file=("input.jsonl", data), purpose="batch").id


def wait(c: openai.OpenAI, batch_id: str, *statuses: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = c.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}"
        time.sleep(0.1)


def lines_of(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def test_a_chat_batch_completes_with_one_output_line_per_input_line(alice):
    n = 12
    batch = alice.batches.create(
        input_file_id=upload(alice, jsonl([chat_line(i) for i in range(n)])),
        endpoint=CHAT,
        completion_window="24h",
        metadata={"job": "eval"},
    )
    assert batch.status == "in_progress" and batch.request_counts.total == n and batch.metadata == {"job": "eval"}
    done = wait(alice, batch.id, "completed")
    assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
    assert done.error_file_id is None and done.completed_at >= done.in_progress_at >= done.created_at
    out = lines_of(alice, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"q-{i}" for i in range(n))
    assert alice.files.retrieve(done.output_file_id).purpose == "batch_output"
    cached = []
    for x in out:
        assert x["error"] is None and x["response"]["status_code"] == 200
        body = x["response"]["body"]
        assert body["object"] == "chat.completion" and x["response"]["request_id"] == body["id"]
        assert body["choices"][0]["message"]["content"]
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert sum(cached) > 0  # the shared system prompt was found in the prefix cache


def test_metrics_show_batches_by_status_and_their_lines(stack, alice):
    import httpx

    batch = alice.batches.create(
        input_file_id=upload(alice, jsonl([chat_line(0)])), endpoint=CHAT, completion_window="24h"
    )
    wait(alice, batch.id, "completed")
    text = httpx.get(stack.ingress.url + "/metrics", timeout=10).text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("switchyard_batch"))
    assert float(samples['switchyard_batches{status="completed"}']) >= 1
    assert float(samples['switchyard_batch_lines{outcome="completed"}']) >= 1
    assert 'switchyard_batches{status="cancelling"}' in samples and "switchyard_batch_queue_depth" in samples
    # The runner sends its lines at batch priority: their tokens are counted apart (rate: tokens/s).
    assert float(samples['switchyard_batch_tokens_total{kind="completion"}']) >= 1
    assert float(samples['switchyard_batch_tokens_total{kind="prompt"}']) >= 1


def test_a_completions_batch(alice):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3}
    several = {"model": MODEL, "prompt": ["Once upon a time", "In a yard"], "max_tokens": 3}  # ingress.prompts
    lines = [{"custom_id": f"c-{i}", "method": "POST", "url": "/v1/completions", "body": body} for i in range(3)]
    lines.append({"custom_id": "two", "method": "POST", "url": "/v1/completions", "body": several})
    batch = alice.batches.create(
        input_file_id=upload(alice, jsonl(lines)), endpoint="/v1/completions", completion_window="24h"
    )
    done = wait(alice, batch.id, "completed")
    out = lines_of(alice, done.output_file_id)
    assert len(out) == 4 and all(x["response"]["body"]["object"] == "text_completion" for x in out)
    [two] = [x["response"]["body"] for x in out if x["custom_id"] == "two"]
    assert [c["index"] for c in two["choices"]] == [0, 1] and two["usage"]["completion_tokens"] == 6
    assert all("cached_tokens" in x["response"]["body"]["usage"]["prompt_tokens_details"] for x in out)


def test_a_line_the_model_refuses_is_in_the_error_file(alice):
    too_long = chat_line(1, max_tokens=10_000_000)  # past the context: the endpoint's 400
    batch = alice.batches.create(
        input_file_id=upload(alice, jsonl([chat_line(0), too_long])), endpoint=CHAT, completion_window="24h"
    )
    done = wait(alice, batch.id, "completed")
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    [error] = lines_of(alice, done.error_file_id)
    assert error["custom_id"] == "q-1" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["message"]
    assert error["response"]["request_id"]  # the ingress's x-request-id: an error body has no id


def test_list_in_pages_and_tenants_apart(stack, keys, alice):
    ids = [
        alice.batches.create(
            input_file_id=upload(alice, jsonl([chat_line(0)])), endpoint=CHAT, completion_window="24h"
        ).id
        for _ in range(3)
    ]
    first = alice.batches.list(limit=2)
    assert len(first.data) == 2 and first.has_more
    every = [b.id for b in alice.batches.list(limit=100).data]
    assert set(ids) <= set(every)
    assert [b.id for b in alice.batches.list(after=every[0], limit=100).data] == every[1:]
    assert [b.id for b in alice.batches.list(limit=2)] == every  # the client follows has_more and last_id
    bob = client(stack, keys["bob"])
    assert bob.batches.list().data == []
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        bob.batches.cancel(ids[0])


def test_cancel_drops_what_is_left(alice):
    n = 60
    batch = alice.batches.create(
        input_file_id=upload(alice, jsonl([chat_line(i, max_tokens=100) for i in range(n)])),
        endpoint=CHAT,
        completion_window="24h",
    )
    cancelling = alice.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = wait(alice, batch.id, "cancelled")
    counts = done.request_counts
    assert counts.completed + counts.failed == n and counts.failed > 0
    errors = lines_of(alice, done.error_file_id)
    assert len(errors) == counts.failed and {x["error"]["code"] for x in errors} == {"batch_cancelled"}
    assert len(lines_of(alice, done.output_file_id)) == counts.completed
    with pytest.raises(openai.ConflictError):
        alice.batches.cancel(batch.id)


@pytest.mark.parametrize(
    ("lines", "code", "line"),
    [
        ([json.dumps(chat_line(0)).encode(), b"{this is not json"], "invalid_json_line", 2),
        ([json.dumps(chat_line(0)).encode(), json.dumps(chat_line(0)).encode()], "duplicate_custom_id", 2),
        ([json.dumps(chat_line(0, url="/v1/completions")).encode()], "invalid_url", 1),
    ],
)
def test_a_bad_file_fails_the_batch_naming_the_line(alice, lines, code, line):
    data = b"\n".join(lines) + b"\n"
    batch = alice.batches.create(input_file_id=upload(alice, data), endpoint=CHAT, completion_window="24h")
    assert batch.status == "failed" and batch.failed_at
    [error] = batch.errors.data
    assert (error.code, error.line) == (code, line) and error.message
    assert alice.batches.retrieve(batch.id).status == "failed"


def test_bad_requests_are_openai_errors(alice):
    with pytest.raises(openai.NotFoundError):
        alice.batches.create(input_file_id="file-0000000000000000000000ff", endpoint=CHAT, completion_window="24h")
    file_id = upload(alice, jsonl([chat_line(0)]))
    with pytest.raises(openai.BadRequestError) as window:
        alice.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="48h")  # type: ignore[arg-type]
    assert window.value.body["param"] == "completion_window"
    with pytest.raises(openai.BadRequestError) as endpoint:
        alice.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    assert endpoint.value.body["param"] == "endpoint"
    with pytest.raises(openai.NotFoundError):
        alice.batches.retrieve("batch_doesnotexist")


def test_the_batch_command_submits_waits_and_downloads(stack, keys, tmp_path, capsys, monkeypatch):
    from switchyard import cli

    monkeypatch.chdir(tmp_path)  # the error file lands in the working folder

    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line(i) for i in range(4)] + [chat_line(9, max_tokens=10_000_000)]))
    common = ["batch", "--url", stack.ingress.url, "--api-key", keys["alice"]]
    out = tmp_path / "out.jsonl"
    code = cli.main([*common, "submit", str(path), "--endpoint", CHAT, "--wait", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed
    batch_id = printed.out.splitlines()[0]
    assert f"output: {out}" in printed.out and "5/5 done (1 failed) completed" in printed.err
    assert len(out.read_text().splitlines()) == 4
    assert len(Path(f"{batch_id}_errors.jsonl").read_text().splitlines()) == 1
    assert cli.main([*common, "list", "--limit", "1"]) == 0 and batch_id in capsys.readouterr().out
    assert cli.main([*common, "status", batch_id]) == 0 and '"completed"' in capsys.readouterr().out
    assert cli.main([*common, "cancel", batch_id]) == 1 and "409" in capsys.readouterr().err
    path.write_bytes(b"{not json\n")
    assert cli.main([*common, "submit", str(path), "--endpoint", CHAT]) == 1
    assert "line 1: invalid_json_line" in capsys.readouterr().err
