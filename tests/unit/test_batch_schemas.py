"""The batch messages (schemas.batch): each round-trips through its JSON decoder, an old
decoder skips a field appended later, and result keys are KV-safe and one per line."""

from __future__ import annotations

import re

import msgspec
import pytest

from switchyard.schemas import batch as b
from switchyard.schemas import subjects

BATCH = b.Batch(
    id="batch_0123",
    endpoint="/v1/chat/completions",
    input_file_id="file-1",
    completion_window="24h",
    status="in_progress",
    created_at=1,
    expires_at=86401,
    tenant="acme",
    errors=b.BatchErrors(data=[b.BatchError(code="invalid_json", message="bad", param="body", line=3)]),
    output_file_id="file-2",
    error_file_id="file-3",
    in_progress_at=2,
    finalizing_at=3,
    completed_at=4,
    failed_at=5,
    expired_at=6,
    cancelling_at=7,
    cancelled_at=8,
    request_counts=b.RequestCounts(total=3, completed=1, failed=1),
    metadata={"k": "v"},
    model="switchyard-sim",
)
ITEM = b.WorkItem(
    batch_id="batch_0123", custom_id="a b/ü", line=2, body='{"model":"m"}', endpoint="/v1/completions", tenant="t"
)
RESULT = b.LineResult(
    batch_id="batch_0123",
    custom_id="x",
    line=1,
    status_code=500,
    body="{}",
    request_id="cmpl-1",
    error=b.LineError(code="max_deliveries", message="m"),
)
SUBMIT = b.JobSubmit(
    endpoint="/v1/completions",
    jobs=[b.Job(custom_id="j1", body={"model": "m", "prompt": "hi"})],
    tenant="t",
    metadata={"a": "b"},
)


@pytest.mark.parametrize(
    ("decoder", "message"),
    [
        (b.BATCH, BATCH),
        (b.WORK_ITEM, ITEM),
        (b.LINE_RESULT, RESULT),
        (b.JOB_SUBMIT, SUBMIT),
        (b.JOB_REPLY, b.JobAccepted(batch=BATCH)),
        (b.JOB_REPLY, b.JobRejected(errors=[b.BatchError(code="c", message="m", line=1)])),
    ],
)
def test_round_trip(decoder: msgspec.json.Decoder, message: msgspec.Struct) -> None:
    assert decoder.decode(b.encode(message)) == message


def test_an_old_decoder_skips_an_appended_field() -> None:
    data = msgspec.json.encode(msgspec.to_builtins(ITEM) | {"deadline_s": 3.0})
    assert b.WORK_ITEM.decode(data) == ITEM


def test_the_public_object_hides_the_tenant() -> None:
    public = BATCH.public()
    assert "tenant" not in public
    assert public["object"] == "batch" and public["request_counts"] == {"total": 3, "completed": 1, "failed": 1}


def test_result_keys_are_kv_safe_and_per_line() -> None:
    key = b.result_key("batch_1", "any text / with . dots")
    assert re.fullmatch(r"[-/_=.a-zA-Z0-9]+", key)
    assert key.startswith("batch_1.") and key.count(".") == 1
    assert b.result_key("batch_1", "a") != b.result_key("batch_1", "b") != b.result_key("batch_2", "a")


def test_counts_and_terminal_states() -> None:
    assert b.RequestCounts(total=5, completed=2, failed=1).done == 3
    assert BATCH.terminal is False
    assert msgspec.structs.replace(BATCH, status="cancelled").terminal


def test_batch_subjects() -> None:
    assert subjects.batch_work("a.b", "batch_1") == "sy.v1.batch.work.a~b.batch_1"
    assert subjects.BATCH_SUBMIT.startswith("sy.v1.")
    assert subjects.batch_max_deliveries(b.WORK_STREAM).endswith("SWITCHYARD_BATCH_WORK.*")
