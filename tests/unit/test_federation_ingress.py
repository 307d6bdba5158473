"""The federated ingress's own logic, without a bus: the session directory (newest wins,
expiry), where cancels go, a region gone dark failing what it had, another region's new
scheduler, and what a placement publishes."""

from __future__ import annotations

import anyio
import pytest

from switchyard.ingress.federation import Federation, SessionDirectory, directory_key
from switchyard.ingress.streams import StreamRouter
from switchyard.schemas import RegionSummary, SessionPlacement, StreamChunk, codec, subjects
from tests.support.factories import FakeClock, make_spec


class _Bus:
    """What Federation publishes (it only publishes; what it hears is fed in directly)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append((subject, data))


def _summary(region: str, seq: int = 1, scheduler: str = "s-1") -> RegionSummary:
    return RegionSummary(
        region=region, scheduler_id=scheduler, seq=seq, sent_at=0.0, predicted_wait_s=0.0, prefill_tokens_per_s=1e4
    )


def _federation(clock: FakeClock) -> tuple[Federation, _Bus]:
    bus = _Bus()
    return Federation(bus, "us", dark_after_s=3.0, session_ttl_s=600.0, clock=lambda: clock.now), bus


def test_the_directory_keeps_the_newest_placement_whatever_order_it_hears_them() -> None:
    d = SessionDirectory()
    new = SessionPlacement(region="eu", prompt_tokens=10, at=200.0, expires_at=900.0)
    old = SessionPlacement(region="ap", prompt_tokens=99, at=100.0, expires_at=900.0)
    d.learn("k", new)
    d.learn("k", old)  # from another region's stream, late
    assert d.lookup("k", 150.0) == new
    assert d.lookup("k", 901.0) is None  # expired
    assert d.lookup("other", 0.0) is None


def test_the_directory_forgets_the_least_recent_past_its_bound() -> None:
    d = SessionDirectory(max_entries=2)
    for i, key in enumerate("abc"):
        d.learn(key, SessionPlacement(region="us", prompt_tokens=1, at=float(i), expires_at=1e9))
    assert len(d) == 2 and d.lookup("a", 0.0) is None and d.lookup("c", 0.0) is not None


def test_a_session_key_is_per_tenant() -> None:
    assert directory_key("acme", "s") != directory_key("globex", "s")
    assert directory_key("a.b", "c") != directory_key("a", "b.c")


def test_a_placement_is_published_for_every_region_and_routes_the_next_turn_there() -> None:
    clock = FakeClock()
    fed, bus = _federation(clock)
    for region in ("us", "eu"):
        fed.heard(_summary(region))
    fed.router.measured("eu", 0.03)
    spec = make_spec(prompt_len=4000, session="trip")
    anyio.run(fed.placed, spec, "eu")
    subject, data = bus.published[-1]
    assert subject == subjects.fed_session("us", directory_key("default", "trip"))  # written under its own region
    assert codec.SESSION_PLACEMENT.decode(data).region == "eu"
    assert fed.cancel_subject(spec.request_id) == subjects.to_region("eu", "cancel")
    follow = make_spec(prompt=[*spec.prompt_tokens, 1, 2, 3], session="trip")
    assert fed.route(follow).region == "eu"
    fed.finished(spec.request_id)
    assert fed.cancel_subject(spec.request_id) == subjects.CANCEL
    # The same region again soon after: nothing new to say
    anyio.run(fed.placed, make_spec(prompt=spec.prompt_tokens[:100], session="trip"), "eu")
    assert len(bus.published) == 1


def test_a_request_without_a_session_publishes_no_placement() -> None:
    fed, bus = _federation(FakeClock())
    anyio.run(fed.placed, make_spec(), "us")
    assert bus.published == []


def test_a_region_gone_dark_fails_what_this_ingress_has_there_only() -> None:
    clock = FakeClock()
    fed, _ = _federation(clock)
    lost: list[tuple[str, str]] = []
    fed.on_lost(lambda rid, region: lost.append((rid, region)))
    for region in ("us", "eu", "ap"):
        fed.heard(_summary(region))
    in_eu, in_ap = make_spec(), make_spec()
    anyio.run(fed.placed, in_eu, "eu")
    anyio.run(fed.placed, in_ap, "ap")
    clock.now += 2.0
    fed.heard(_summary("us", seq=2))
    fed.heard(_summary("ap", seq=2))
    clock.now += 2.0  # eu silent for 4 s
    assert fed.router.dark(clock.now) == ["eu"]
    fed._fail_in("eu")
    assert lost == [(in_eu.request_id, "eu")] and fed.lost == 1
    assert fed.cancel_subject(in_ap.request_id) == subjects.to_region("ap", "cancel")


def test_another_regions_new_scheduler_resubmits_only_what_is_queued_there() -> None:
    clock = FakeClock()
    fed, _ = _federation(clock)
    told: list[tuple[str, list[str]]] = []
    fed.on_new_scheduler(lambda sid, rids: told.append((sid, rids)))
    fed.heard(_summary("eu", scheduler="s-1"))
    fed.heard(_summary("us", scheduler="h-1"))
    there, home = make_spec(), make_spec()
    anyio.run(fed.placed, there, "eu")
    anyio.run(fed.placed, home, "us")
    fed.heard(_summary("eu", seq=2, scheduler="s-1"))
    fed.heard(_summary("us", seq=9, scheduler="h-2"))  # home's own: its roll call says so
    assert told == []
    fed.heard(_summary("eu", seq=1, scheduler="s-2"))  # a standby took over in eu
    assert told == [("s-2", [there.request_id])]
    router = StreamRouter()
    queued, placed = router.open(there.request_id, 8), router.open(home.request_id, 8)
    router.route(StreamChunk(request_id=home.request_id, seq=0, assigned="w-1"), subjects.SCHEDULER_SENDER)
    assert router.scheduler_changed("s-2", [there.request_id, home.request_id]) == 1
    assert queued.chunks and queued.chunks[0].error.code == "scheduler_failover"
    assert not placed.chunks and placed.suspect_since is not None


@pytest.mark.parametrize("policy", ["local", "blind", "geo"])
def test_every_policy_routes_home_while_only_home_is_known(policy: str) -> None:
    clock = FakeClock()
    fed = Federation(_Bus(), "us", policy=policy, clock=lambda: clock.now)
    assert fed.route(make_spec(session="x")).region == "us"
