"""Every wire message round-trips through the codec of its subject, and evolves safely.

The round-trip cases set every field to a non-default value (so a field the encoder
drops, or a default that wins over the sent value, is caught), and a catalogue test
checks that every Struct in ``schemas.messages.__all__`` appears, fully non-default,
somewhere in those cases: a new message or a new field without a case fails here.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import msgspec
import pytest

from switchyard.schemas import codec, messages, subjects
from switchyard.schemas import messages as m
from switchyard.schemas.codec import Codec

SPEC = m.RequestSpec(
    request_id="r-42",
    ingress_id="ing-7",
    model="sim-tiny",
    prompt_tokens=[5, 6, 7, 8, 9],
    block_size=4,
    block_keys=[2**63 + 11],
    sampling=m.SamplingParams(
        max_tokens=17,
        temperature=0.25,
        top_p=0.5,
        seed=1234,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={7: -100.0},
        min_tokens=3,
        ignore_eos=True,
        stop_token_ids=[2, 9],
        logprobs=5,
        n=3,
        structured=m.StructuredOutput(
            json_schema='{"type": "object"}', json_object=True, regex="a+", choice=["a", "b"], grammar="root ::= 'a'"
        ),
    ),
    tenant="acme",
    session="sess-1",
    priority=3,
    deadline_s=2.5,
    resume_from=2,
    attempt=1,
)
HANDLE = m.SimKvHandle(worker_id="p-1", block_keys=[2**64 - 1, 3], num_tokens=5)
STATS = m.EngineStats(
    prompt_tokens=700,
    computed_tokens=60,
    local_cache_hit_tokens=320,
    external_hit_tokens=320,
    kv_fallbacks=1,
    spec_drafts=5,
    spec_draft_tokens=15,
    spec_accepted_tokens=9,
)
USAGE = m.PromptUsage(prompt_tokens=5, cached_tokens=4, queued_s=0.125, prefill_s=0.5, batch_tokens=40)

# (codec of the subject, message): each message is sent on exactly this subject.
CASES: list[tuple[str, Codec[Any], msgspec.Struct]] = [
    ("submit", codec.SCHEDULER_REQUEST, m.SubmitRequest(spec=SPEC)),
    ("status", codec.SCHEDULER_REQUEST, m.StatusRequest()),
    ("admitted", codec.SCHEDULER_REPLY, m.Admitted(request_id="r-42", queue_position=3)),
    (
        "rejected",
        codec.SCHEDULER_REPLY,
        m.Rejected(request_id="r-42", reason="overloaded", message="busy", retry_after_s=2.5),
    ),
    (
        "cluster_status",
        codec.SCHEDULER_REPLY,
        m.ClusterStatus(
            workers=[
                m.WorkerSummary(
                    worker_id="d-1",
                    role="decode",
                    inflight_tokens=99,
                    running=2,
                    engine="vllm",
                    boot_s=31.5,
                    stats=STATS,
                    token_budget=4096,
                )
            ],
            queued_requests=4,
            queued_tokens=400,
            awaiting_decode=8,
            paused_requests=9,
            reclaimed_requests=2,
            session_bindings=7,
            sessions_dropped=1,
            abandoned_handoffs=3,
            strays_cancelled=5,
            strays_ignored=6,
        ),
    ),
    ("prefill_task", codec.WORKER_TASK, m.PrefillTask(spec=SPEC, queued_s=0.75, charged_tokens=3)),
    (
        "decode_task",
        codec.WORKER_TASK,
        m.DecodeTask(spec=SPEC, handle=HANDLE, first_token=777, usage=USAGE, charged_tokens=22),
    ),
    ("local_task", codec.WORKER_TASK, m.LocalTask(spec=SPEC, queued_s=0.25, charged_tokens=22)),
    ("task_ack", codec.TASK_ACK, m.TaskAck(request_id="r-42", accepted=True, reason="fine")),
    (
        "load",
        codec.WORKER_EVENT,
        m.LoadReport(
            worker_id="p-1",
            role="decode",
            seq=9,
            engine="sim",
            model="sim-tiny",
            block_size=32,
            token_budget=5000,
            inflight_tokens=123,
            running=4,
            interval_s=0.25,
            kv_seq=12,
            kv_capacity_tokens=90_000,
            boot_s=12.5,
            stats=STATS,
            device_class="H100x2",
            held=[
                m.HeldRequest(
                    request_id="r-42",
                    ingress_id="ing-7",
                    phase="decode",
                    tokens=22,
                    decode_tokens=22,
                    local=True,
                    attempt=1,
                )
            ],
        ),
    ),
    (
        "prefill_done",
        codec.WORKER_EVENT,
        m.PrefillDone(
            worker_id="p-1", request_id="r-42", handle=HANDLE, first_token=777, usage=USAGE, finished=True, spec=SPEC
        ),
    ),
    ("prefill_failed", codec.WORKER_EVENT, m.PrefillFailed(worker_id="p-1", request_id="r-42", message="oom")),
    (
        "finished",
        codec.WORKER_EVENT,
        m.RequestFinished(
            worker_id="d-1",
            request_id="r-42",
            generated_tokens=17,
            reason="stop",
            kv_expected_tokens=640,
            kv_loaded_tokens=608,
            step_s=0.021,
        ),
    ),
    *[
        (
            f"decode_task_{handle.__struct_config__.tag}",
            codec.WORKER_TASK,
            m.DecodeTask(spec=SPEC, handle=handle, first_token=777, usage=USAGE),
        )
        for handle in (
            m.MooncakeStoreKvHandle(worker_id="p-1", num_tokens=700, block_size=32),
            m.LmcacheKvHandle(worker_id="p-2", num_tokens=701, block_size=64),
            m.NixlKvHandle(
                worker_id="p-3",
                num_tokens=702,
                block_size=16,
                params='{"remote_block_ids": [1, 2], "remote_engine_id": "e"}',
            ),
        )
    ],
    ("leaving", codec.WORKER_EVENT, m.WorkerLeaving(worker_id="d-1")),
    ("roll_call", codec.ROLL_CALL, m.RollCall(scheduler_id="sched-1")),
    (
        "kv_events",
        codec.KV_EVENTS,
        m.KvEventBatch(
            worker_id="p-1",
            seq=7,
            events=[
                m.BlocksStored(keys=[1, 2**64 - 1], tier="host"),
                m.BlocksRemoved(keys=[3], tier="disk"),
                m.AllBlocksCleared(),
            ],
        ),
    ),
    ("kv_snapshot_request", codec.KV_SNAPSHOT_REQUEST, m.KvSnapshotRequest(scheduler_id="sched-2")),
    ("kv_snapshot", codec.KV_SNAPSHOT, m.KvSnapshot(worker_id="p-1", seq=7, blocks={"device": [1, 2], "cluster": [3]})),
    ("cancel", codec.CANCEL, m.Cancel(request_id="r-42", reason="deadline", attempt=1)),
    (
        "stream_batch",
        codec.STREAM_BATCH,
        m.StreamBatch(
            sender="d-1",
            chunks=[
                m.StreamChunk(
                    request_id="r-42",
                    seq=3,
                    token_ids=[1, 2],
                    finish_reason="length",
                    usage=USAGE,
                    error=m.StreamError(code="overloaded", message="shed", retry_after_s=3.0),
                    assigned="d-2",
                    index=2,
                    logprobs=[
                        m.TokenLogprobs(logprob=-0.5, top_ids=[1, 7], top_logprobs=[-0.5, -1.5]),
                        m.TokenLogprobs(logprob=-2.0, top_ids=[3], top_logprobs=[-0.25]),
                    ],
                ),
                m.StreamChunk(request_id="r-43", seq=0, token_ids=[9]),
            ],
        ),
    ),
    (
        "region_summary",
        codec.REGION_SUMMARY,
        m.RegionSummary(
            region="eu",
            scheduler_id="s-1",
            seq=12,
            sent_at=1.7e9,
            predicted_wait_s=0.75,
            prefill_tokens_per_s=24_000.0,
            queued_requests=3,
            queued_tokens=9000,
            inflight_tokens=4096,
            prefill_budget_tokens=65_536,
            decode_capacity_tokens=200_000,
            decode_demand_tokens=150_000,
            prefill_workers=2,
            decode_workers=1,
            saturated=True,
            spill_wait_s=2.0,
        ),
    ),
    (
        "session_placement",
        codec.SESSION_PLACEMENT,
        m.SessionPlacement(region="ap", prompt_tokens=2048, at=1.7e9, expires_at=1.7e9 + 600),
    ),
]


@pytest.mark.parametrize(("codec_", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_round_trip_through_subject_codec(codec_: Codec[Any], message: msgspec.Struct) -> None:
    decoded = codec_.decode(Codec.encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


def _walk(value: Any):
    """Every Struct instance inside ``value``, depth first."""
    if isinstance(value, msgspec.Struct):
        yield value
        for name in value.__struct_fields__:
            yield from _walk(getattr(value, name))
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _walk(item)


def _non_default(struct: msgspec.Struct) -> bool:
    for field in msgspec.structs.fields(struct):
        value = getattr(struct, field.name)
        if field.default is not msgspec.NODEFAULT and value == field.default:
            return False
        if field.default_factory is not msgspec.NODEFAULT and value == field.default_factory():
            return False
    return True


def _catalogue() -> set[type]:
    return {
        obj
        for name in messages.__all__
        if inspect.isclass(obj := getattr(messages, name)) and issubclass(obj, msgspec.Struct)
    }


def test_every_message_struct_has_a_fully_non_default_round_trip_case() -> None:
    covered = {type(s) for _, _, message in CASES for s in _walk(message) if _non_default(s)}
    missing = sorted(cls.__name__ for cls in _catalogue() - covered)
    assert not missing, f"no round-trip case with every field non-default for: {missing}"


def test_the_catalogue_is_not_trivially_empty() -> None:
    # Guards the coverage test above against a broken enumeration that finds nothing.
    names = {cls.__name__ for cls in _catalogue()}
    assert {"RequestSpec", "PrefillDone", "StreamChunk", "Cancel"} <= names
    assert len(names) >= 20


def test_every_union_variant_decodes_on_its_subject() -> None:
    unions = {
        codec.SCHEDULER_REQUEST: m.SchedulerRequest,
        codec.SCHEDULER_REPLY: m.SchedulerReply,
        codec.WORKER_TASK: m.WorkerTask,
        codec.WORKER_EVENT: m.WorkerEvent,
    }
    for codec_, union in unions.items():
        sent = {type(message) for _, c, message in CASES if c is codec_}
        assert sent == set(union.__args__), f"{union}: cases for {sent}"


def test_old_decoder_skips_an_unknown_appended_field() -> None:
    class PrefillFailedV2(msgspec.Struct, frozen=True, kw_only=True, tag="prefill_failed"):
        worker_id: str
        request_id: str
        message: str
        retryable: bool = True  # appended in a hypothetical next release

    new = PrefillFailedV2(worker_id="p-1", request_id="r-1", message="oom", retryable=False)
    decoded = codec.WORKER_EVENT.decode(msgspec.msgpack.encode(new))
    assert decoded == m.PrefillFailed(worker_id="p-1", request_id="r-1", message="oom")


def test_old_decoder_skips_unknown_fields_nested_and_untagged() -> None:
    spec = msgspec.to_builtins(SPEC) | {"expires_at": 3.5}
    spec["sampling"] |= {"mirostat_tau": 0.1}
    data = msgspec.msgpack.encode({"type": "submit", "spec": spec, "trace": {"a": [1, 2]}})
    assert codec.SCHEDULER_REQUEST.decode(data) == m.SubmitRequest(spec=SPEC)

    cancel = msgspec.msgpack.encode({"request_id": "r-1", "reason": "x", "origin": "ingress-2"})
    assert codec.CANCEL.decode(cancel) == m.Cancel(request_id="r-1", reason="x")


def test_missing_fields_with_defaults_take_their_defaults() -> None:
    # What an old sender (one release behind) looks like to a new decoder.
    data = msgspec.msgpack.encode({"sender": "d", "chunks": [{"request_id": "r-1", "seq": 4}]})
    chunk = codec.STREAM_BATCH.decode(data).chunks[0]
    assert chunk == m.StreamChunk(request_id="r-1", seq=4)
    assert chunk.token_ids == [] and chunk.error is None


@pytest.mark.parametrize(
    "codec_", [codec.SCHEDULER_REQUEST, codec.SCHEDULER_REPLY, codec.WORKER_TASK, codec.WORKER_EVENT]
)
def test_unknown_tag_is_a_validation_error(codec_: Codec[Any]) -> None:
    data = msgspec.msgpack.encode({"type": "bogus", "request_id": "r-1", "worker_id": "w"})
    with pytest.raises(msgspec.ValidationError, match="bogus"):
        codec_.decode(data)


def test_a_message_of_another_subject_is_a_validation_error() -> None:
    task = Codec.encode(m.PrefillTask(spec=SPEC, queued_s=0.0))
    with pytest.raises(msgspec.ValidationError):
        codec.WORKER_EVENT.decode(task)
    event = Codec.encode(m.WorkerLeaving(worker_id="w"))
    with pytest.raises(msgspec.ValidationError):
        codec.WORKER_TASK.decode(event)


def test_a_field_of_the_wrong_type_is_a_validation_error() -> None:
    data = msgspec.msgpack.encode({"type": "leaving", "worker_id": 7})
    with pytest.raises(msgspec.ValidationError, match=r"worker_id"):
        codec.WORKER_EVENT.decode(data)


def test_messages_are_frozen() -> None:
    cancel = m.Cancel(request_id="r-1")
    with pytest.raises(AttributeError):
        cancel.request_id = "r-2"  # type: ignore[misc]


# --- subjects ------------------------------------------------------------------------

# Module constants that are not subjects: the version, its root, and a queue-group name.
NOT_SUBJECTS = {
    "WIRE_VERSION",
    "ROOT",
    "SCHEDULER_QUEUE",
    "SCHEDULER_SENDER",
    "FED_PING_QUEUE",
    "SESSION_DIRECTORY_STREAM",
}
SUBJECT_RE = re.compile(r"^sy\.v1(\.[A-Za-z0-9_-]+)+$")


def _subject_constants() -> dict[str, str]:
    return {
        name: value
        for name, value in vars(subjects).items()
        if name.isupper() and isinstance(value, str) and name not in NOT_SUBJECTS
    }


def _all_subjects() -> list[str]:
    return [
        *_subject_constants().values(),
        subjects.worker_tasks("prefill-1a2b"),
        subjects.stream("ingress-9", "prefill-1a2b"),
        subjects.stream("eu.ingress-9", "prefill-1a2b"),
        subjects.fed_summary("eu"),
        subjects.fed_session("eu", "0f" * 16),
        *(subjects.to_region("ap", service) for service in subjects.FED_SERVICES),
    ]


def test_subject_constants_are_found() -> None:
    assert set(_subject_constants()) >= {"SUBMIT", "CANCEL", "WORKER_EVENTS", "ROLL_CALL"}


@pytest.mark.parametrize("subject", _all_subjects())
def test_subjects_carry_the_wire_version(subject: str) -> None:
    assert subject.startswith("sy.v1.")
    assert SUBJECT_RE.match(subject), f"{subject!r} has an empty token, a wildcard or a space"


def test_subjects_are_distinct_and_per_id() -> None:
    everything = _all_subjects()
    assert len(set(everything)) == len(everything)
    assert subjects.worker_tasks("a") != subjects.worker_tasks("b")
    assert subjects.stream("a", "w") != subjects.stream("b", "w") != subjects.stream("b", "v")
    assert subjects.stream_sender(subjects.stream("a", "prefill-0")) == "prefill-0"
    assert subjects.streams_of("a") == subjects.stream("a", "*")
    assert subjects.WIRE_VERSION == "v1" and subjects.ROOT == "sy.v1"


def test_a_cancel_covers_the_runs_up_to_its_attempt() -> None:
    everything = m.Cancel(request_id="r")
    assert everything.covers(0) and everything.covers(7)
    up_to_one = m.Cancel(request_id="r", attempt=1)
    assert up_to_one.covers(0) and up_to_one.covers(1) and not up_to_one.covers(2)
