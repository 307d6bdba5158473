"""The audit after the bus may have lost messages (scheduler.audit): pure logic."""

from __future__ import annotations

import msgspec

from switchyard.scheduler.audit import Audit
from switchyard.schemas import HeldRequest, LoadReport
from tests.support.factories import load_report


def _held(*rids: str) -> list[HeldRequest]:
    return [HeldRequest(request_id=r, ingress_id="i", phase="decode", tokens=1, decode_tokens=1) for r in rids]


def _answer(worker: str, role: str, *rids: str) -> LoadReport:
    return msgspec.structs.replace(load_report(worker, role), held=_held(*rids))  # type: ignore[arg-type]


def test_requests_a_worker_answered_without_are_lost() -> None:
    audit = Audit(asked_at=0.0, placed={"a": "p1", "b": "p1", "c": "d1", "d": "d2"})
    audit.heard(_answer("p1", "prefill", "a"))
    audit.heard(_answer("d1", "decode"))
    audit.heard(load_report("d1", "decode"))  # an ordinary heartbeat says nothing of what it holds
    assert sorted(audit.lost()) == [("b", "p1"), ("c", "d1")]  # d2 did not answer: left to its expiry


def test_an_answer_in_parts_counts_every_part() -> None:
    audit = Audit(asked_at=0.0, placed={"a": "d1", "b": "d1"})
    audit.heard(_answer("d1", "decode", "a"))
    audit.heard(_answer("d1", "decode", "b"))
    assert audit.lost() == []


def test_what_a_worker_holds_and_the_scheduler_does_not_track_is_a_stray() -> None:
    answer = _answer("d1", "decode", "a", "gone", "b")
    assert [h.request_id for h in Audit.strays(answer, {"a", "b", "c"})] == ["gone"]
    assert Audit.strays(load_report("d1", "decode"), set()) == []  # a heartbeat holds nothing to say
