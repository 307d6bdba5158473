"""The batch logic without a bus: input files checked as OpenAI's service checks them, the
output and error files in OpenAI's format, the status machine's pure steps (cancel, the
final status, the list's pages), the runner's headroom rule and its fairness."""

from __future__ import annotations

import json

import msgspec
import pytest

from switchyard.ingress.batch_config import BatchRunnerConfig
from switchyard.ingress.batch_lines import MAX_ERRORS, check_input, output_files
from switchyard.ingress.batch_runner import (
    FairPicker,
    _Active,
    counts_of,
    final_status,
    has_headroom,
    mode_of,
    pick_region,
)
from switchyard.ingress.batch_store import BatchConflict
from switchyard.ingress.batches import BatchMaker, cancelled, page
from switchyard.ingress.errors import InvalidRequest
from switchyard.schemas import ClusterStatus, WorkerSummary
from switchyard.schemas.batch import Batch, LineError, LineResult, RequestCounts

MODEL = "switchyard-sim"
CHAT = "/v1/chat/completions"


def line(custom_id: str = "a", url: str = CHAT, method: str = "POST", **body) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body}).encode()


def check(*lines: bytes, endpoint: str = CHAT, max_lines: int = 100):
    return check_input(b"\n".join(lines) + b"\n", endpoint, MODEL, max_lines=max_lines)


def batch(**fields) -> Batch:
    base = {
        "id": "batch_1",
        "endpoint": CHAT,
        "input_file_id": "file-1",
        "completion_window": "24h",
        "status": "in_progress",
        "created_at": 100,
        "expires_at": 100 + 86400,
        "tenant": "t",
    }
    return Batch(**(base | fields))


def test_a_good_file_gives_one_line_each_with_its_body_as_written() -> None:
    checked = check(line("a"), line("b", max_tokens=3))
    assert checked.errors == []
    assert [(x.line, x.custom_id) for x in checked.lines] == [(1, "a"), (2, "b")]
    assert json.loads(checked.lines[1].body)["max_tokens"] == 3


def test_blank_lines_are_skipped_and_line_numbers_kept() -> None:
    checked = check(line("a"), b"", line("b"))
    assert [x.line for x in checked.lines] == [1, 3]


@pytest.mark.parametrize(
    ("bad", "code", "param"),
    [
        (b"{not json", "invalid_json_line", None),
        (b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions"}', "invalid_request", None),
        (line("x", url="/v1/completions"), "invalid_url", "url"),
        (line("x", method="GET"), "invalid_method", "method"),
        (line("x", model="other"), "model_not_found", "body.model"),
        (line("x", stream=True), "invalid_request", "body.stream"),
        (line("x", temperature=9), "invalid_request", "body.temperature"),
        (line("x", messages="hi"), "invalid_request", "body.messages"),
    ],
)
def test_a_bad_line_fails_the_batch_naming_its_line(bad: bytes, code: str, param: str | None) -> None:
    checked = check(line("a"), bad)
    assert checked.lines == []
    [error] = checked.errors
    assert (error.line, error.code) == (2, code)
    if param is not None:
        assert error.param == param
    assert error.message


def test_a_body_field_the_endpoint_refuses_is_refused_here() -> None:
    bad = json.dumps(
        {
            "custom_id": "x",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": "p", "echo": True},
        }
    )
    [error] = check_input(bad.encode(), "/v1/completions", MODEL, max_lines=10).errors
    assert error.code == "unsupported_parameter" and error.param == "body.echo"


def test_a_duplicate_custom_id_is_named() -> None:
    [error] = check(line("a"), line("b"), line("a")).errors
    assert (error.code, error.line) == ("duplicate_custom_id", 3)
    assert "'a'" in error.message


def test_every_bad_line_is_listed_up_to_the_cap() -> None:
    assert [e.line for e in check(b"x", line("a"), b"y").errors] == [1, 3]
    assert len(check(*[b"x"] * (MAX_ERRORS + 20)).errors) == MAX_ERRORS


def test_an_empty_or_oversized_file_fails() -> None:
    assert [e.code for e in check_input(b"\n", CHAT, MODEL, max_lines=10).errors] == ["empty_file"]
    assert [e.code for e in check(line("a"), line("b"), max_lines=1).errors] == ["too_many_requests"]


def test_the_create_request_is_checked() -> None:
    maker = BatchMaker(store=None, model=MODEL)  # type: ignore[arg-type]  # no store is reached
    maker.check_request(CHAT, "24h", {"k": "v"})
    with pytest.raises(InvalidRequest) as window:
        maker.check_request(CHAT, "48h", None)
    assert window.value.param == "completion_window" and "24h" in window.value.message
    with pytest.raises(InvalidRequest) as endpoint:
        maker.check_request("/v1/embeddings", "24h", None)
    assert endpoint.value.param == "endpoint"
    with pytest.raises(InvalidRequest):
        maker.check_request(CHAT, "24h", {str(i): "v" for i in range(17)})


def result(custom_id: str, line_: int, status: int | None = 200, error: LineError | None = None) -> LineResult:
    body = json.dumps({"id": f"chatcmpl-{custom_id}", "usage": {"prompt_tokens": 3}}) if status else None
    return LineResult(
        batch_id="batch_1", custom_id=custom_id, line=line_, status_code=status, body=body, request_id="r", error=error
    )


def test_output_and_error_files_are_openai_lines_in_input_order() -> None:
    expired = LineError(code="batch_expired", message="late")
    results = [result("c", 3), result("a", 1), result("b", 2, status=400), result("d", 4, status=None, error=expired)]
    ok, failed = output_files(results)
    out = [json.loads(x) for x in ok.splitlines()]
    err = [json.loads(x) for x in failed.splitlines()]
    assert [x["custom_id"] for x in out] == ["a", "c"]
    assert out[0]["response"]["status_code"] == 200 and out[0]["error"] is None
    assert out[0]["response"]["body"]["usage"] == {"prompt_tokens": 3}
    assert out[0]["id"].startswith("batch_req_") and out[0]["id"] != out[1]["id"]
    assert [x["custom_id"] for x in err] == ["b", "d"]
    assert err[0]["response"]["status_code"] == 400
    assert err[1]["response"] is None and err[1]["error"] == {"code": "batch_expired", "message": "late"}
    assert counts_of(4, results) == msgspec.convert({"total": 4, "completed": 2, "failed": 2}, type(counts_of(0, [])))


def test_cancel_moves_a_live_batch_once_and_refuses_an_ended_one() -> None:
    moved = cancelled(batch())
    assert moved is not None and moved.status == "cancelling" and moved.cancelling_at
    assert cancelled(moved) is None
    assert cancelled(batch(status="validating")) is not None
    for status in ("completed", "failed", "expired", "cancelled", "finalizing"):
        with pytest.raises(BatchConflict):
            cancelled(batch(status=status))


def test_the_final_status() -> None:
    expired = result("a", 1, status=None, error=LineError(code="batch_expired", message=""))
    assert final_status(batch(), [result("a", 1)]) == "completed"
    assert final_status(batch(), [expired]) == "expired"
    assert final_status(batch(cancelling_at=5), [expired]) == "cancelled"
    assert mode_of(batch(), now=200) == "run"
    assert mode_of(batch(), now=100 + 86400) == "expire"
    assert mode_of(batch(status="cancelling"), now=200) == "cancel"


def test_pages_follow_after_and_limit() -> None:
    batches = [batch(id=f"batch_{i}", created_at=10 - i) for i in range(5)]  # newest first
    first = page(batches, None, 2)
    assert [b["id"] for b in first["data"]] == ["batch_0", "batch_1"]
    assert (first["first_id"], first["last_id"], first["has_more"]) == ("batch_0", "batch_1", True)
    last = page(batches, "batch_2", 5)
    assert [b["id"] for b in last["data"]] == ["batch_3", "batch_4"] and last["has_more"] is False
    assert page([], None, 20) == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    assert all("tenant" not in b for b in first["data"])


def status(requests: int, tokens: int) -> ClusterStatus:
    return ClusterStatus(workers=[], queued_requests=requests, queued_tokens=tokens)


def test_headroom_is_an_empty_queue_by_default_and_a_setting() -> None:
    cfg = BatchRunnerConfig()
    assert has_headroom(status(0, 0), cfg)
    assert not has_headroom(status(1, 10), cfg)
    assert not has_headroom(None, cfg)  # no scheduler answers: nothing is added
    loose = BatchRunnerConfig(headroom_queued_requests=2, headroom_queued_tokens=100)
    assert has_headroom(status(2, 100), loose) and not has_headroom(status(2, 101), loose)
    # a request a full worker refused waits too; a prefilled one waiting for decode room: decode is full
    paused = ClusterStatus(workers=[], queued_requests=2, queued_tokens=0, paused_requests=1)
    assert not has_headroom(paused, loose)
    assert not has_headroom(ClusterStatus(workers=[], queued_requests=0, queued_tokens=0, awaiting_decode=1), loose)


def test_headroom_keeps_a_share_of_every_roles_budget_free() -> None:
    def fleet(prefill_load: int, decode_load: int, budget: int = 1000) -> ClusterStatus:
        workers = [
            WorkerSummary(worker_id="p", role="prefill", inflight_tokens=prefill_load, running=1, token_budget=budget),
            WorkerSummary(worker_id="d", role="decode", inflight_tokens=decode_load, running=1, token_budget=budget),
        ]
        return ClusterStatus(workers=workers, queued_requests=0, queued_tokens=0)

    cfg = BatchRunnerConfig()  # 10% free
    assert has_headroom(fleet(900, 0), cfg) and has_headroom(fleet(0, 900), cfg)
    assert not has_headroom(fleet(901, 0), cfg) and not has_headroom(fleet(0, 950), cfg)
    assert has_headroom(fleet(5000, 5000, budget=0), cfg)  # budgets not said: the queue decides
    assert not has_headroom(fleet(600, 0), BatchRunnerConfig(headroom_free_budget=0.5))


def test_the_picker_serves_tenants_in_turn_then_their_batches() -> None:
    picker = FairPicker()
    ready = [("big", "b1"), ("big", "b2"), ("big", "b3"), ("small", "s1")]
    picks = [picker.pick(ready) for _ in range(6)]
    tenants = [p[0] for p in picks if p]
    assert tenants == ["big", "small", "big", "small", "big", "small"]
    assert [p[1] for p in picks if p and p[0] == "big"] == ["b1", "b2", "b3"]
    assert picker.pick([]) is None


def test_a_batch_runs_one_line_until_its_shared_prefix_is_warm() -> None:
    cold = _Active(batch(request_counts=RequestCounts(total=9)), sub=None)
    assert cold.room(4)
    cold.in_flight = 1
    assert not cold.room(4)
    cold.warm = True
    assert cold.room(4)
    cold.in_flight = 4
    assert not cold.room(4)
    resumed = _Active(batch(request_counts=RequestCounts(total=9, completed=1)), sub=None)  # another runner's result
    resumed.in_flight = 3
    assert resumed.room(4) and resumed.room_left(4) == 1 and cold.room_left(4) == 0


def test_lines_run_home_while_it_has_headroom_else_in_the_first_other_region_that_has() -> None:
    cfg = BatchRunnerConfig()
    idle, busy = status(0, 0), status(3, 3000)
    assert pick_region(idle, [("eu", idle)], cfg) == ""
    assert pick_region(busy, [("eu", busy), ("ap", idle), ("us", idle)], cfg) == "ap"  # the caller's order
    assert pick_region(busy, [("eu", busy), ("ap", None)], cfg) is None  # ap did not answer: nowhere
    assert pick_region(None, [], cfg) is None
