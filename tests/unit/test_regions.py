"""RegionRouter: which region serves a request, on small hand-built cases.

Every region here prefills at 10,000 tokens/s on one instance unless a case says
otherwise, so a prompt's cost in seconds is its uncached tokens / 10,000 and the
break-evens can be written down by hand.
"""

from __future__ import annotations

import pytest

from switchyard.scheduler import RegionRouter
from switchyard.schemas import RegionSummary, SessionPlacement

RATE = 10_000.0  # tokens/s of one prefill instance


def summary(
    region: str,
    *,
    seq: int = 1,
    wait: float = 0.0,
    workers: int = 1,
    saturated: bool = False,
    scheduler: str = "s1",
) -> RegionSummary:
    return RegionSummary(
        region=region,
        scheduler_id=f"{region}-{scheduler}",
        seq=seq,
        sent_at=0.0,
        predicted_wait_s=wait,
        prefill_tokens_per_s=RATE * workers,
        prefill_workers=workers,
        saturated=saturated,
    )


def placed(region: str, prompt_tokens: int) -> SessionPlacement:
    return SessionPlacement(region=region, prompt_tokens=prompt_tokens, at=0.0, expires_at=1e9)


def router(policy="geo", rtts=None, now: float = 0.0, **waits) -> RegionRouter:
    """A router at ``us`` that heard every region of ``waits`` (name -> predicted wait) at ``now``."""
    r = RegionRouter("us", policy=policy, dark_after_s=3.0)
    for name, wait in waits.items():
        r.observe(summary(name, wait=wait), now)
    for name, rtt in (rtts or {"eu": 0.03, "ap": 0.07}).items():
        r.measured(name, rtt)
    return r


def test_home_by_default():
    r = router(us=0.5, eu=0.0, ap=0.0)  # home busier, but not saturated
    route = r.route(4000, None, 1.0)
    assert (route.region, route.reason) == ("us", "home")
    assert route.predicted_ttft_s == pytest.approx(0.5 + 0.4)


def test_home_before_any_summary():
    assert RegionRouter("us").route(1000, None, 0.0).region == "us"


def test_unknown_policy_refused():
    with pytest.raises(ValueError, match="region policy"):
        RegionRouter("us", policy="nearest")  # type: ignore[arg-type]


# --- a bound session: its region's queue + uncached prefill + RTT against recomputing ---------
# Prompt 10,000 tokens, 8,000 of them held in eu: home costs 1.0 s, eu wait + 0.2 + RTT.


@pytest.mark.parametrize(("eu_wait", "expected"), [(0.7, "eu"), (0.8, "us")])
def test_session_follows_its_region_while_its_queue_is_short_enough(eu_wait, expected):
    r = router(us=0.0, eu=eu_wait)  # break-even: 0.7 + 0.2 + 0.03 = 0.93 < 1.0 < 1.03
    route = r.route(10_000, placed("eu", 8000), 1.0)
    assert route.region == expected
    assert route.reason == ("session" if expected == "eu" else "home")


@pytest.mark.parametrize(("rtt", "expected"), [(0.75, "eu"), (0.85, "us")])
def test_session_follows_its_region_while_it_is_near_enough(rtt, expected):
    r = router(rtts={"eu": rtt}, us=0.0, eu=0.0)  # 0.2 + 0.75 < 1.0 < 0.2 + 0.85
    assert r.route(10_000, placed("eu", 8000), 1.0).region == expected


def test_session_region_costs_its_cached_prefix_only():
    r = router(us=0.0, eu=0.5)
    route = r.route(10_000, placed("eu", 8000), 1.0)
    assert route.predicted_ttft_s == pytest.approx(0.5 + 0.2 + 0.03)


def test_one_prompt_runs_on_one_instance_not_on_the_whole_fleet():
    # Home has 100 instances, so its queue drains fast, but a 10,000-token prompt still
    # takes 1 s on one of them: the 8,000 tokens cached in eu win over 30 ms.
    r = RegionRouter("us")
    r.observe(summary("us", workers=100), 0.0)
    r.observe(summary("eu"), 0.0)
    r.measured("eu", 0.03)
    assert r.route(10_000, placed("eu", 8000), 1.0).region == "eu"


def test_session_at_home_stays_home():
    r = router(us=0.5, eu=0.0)
    assert r.route(10_000, placed("us", 8000), 1.0).reason == "home"


def test_bound_session_weighs_its_region_against_home_only():
    # eu holds the prefix but is slow; ap is idler than home, but home is not saturated:
    # the session is recomputed at home, not sent to a third region.
    r = router(us=0.5, eu=3.0, ap=0.0)
    route = r.route(10_000, placed("eu", 8000), 1.0)
    assert (route.region, route.reason) == ("us", "home")


def test_bound_session_that_recomputes_spills_when_home_is_saturated():
    r = router(eu=3.0, ap=0.0)  # eu: its queue is longer than recomputing
    r.observe(summary("us", saturated=True), 0.0)
    route = r.route(10_000, placed("eu", 8000), 1.0)
    assert (route.region, route.reason) == ("ap", "spill")


# --- an unbound request: home unless saturated, then the lowest TTFT + RTT open region --------


def test_unbound_request_spills_only_when_home_is_saturated():
    r = router(us=0.4, eu=0.0, ap=0.0)  # eu would be 0.37 s sooner: within the margin, home
    assert r.route(4000, None, 1.0).region == "us"
    r.observe(summary("us", seq=2, wait=2.5, saturated=True), 1.0)
    route = r.route(4000, None, 1.0)
    assert (route.region, route.reason) == ("eu", "spill")


def test_a_home_not_saturated_is_left_when_another_region_is_sooner_by_the_margin():
    r = router(us=1.9, eu=0.0, ap=0.0)  # below its threshold, but eu is 1.87 s sooner
    route = r.route(4000, None, 1.0)
    assert (route.region, route.reason) == ("eu", "spill")
    r = router(us=0.6, eu=0.0, ap=0.0)  # 0.57 s sooner: past the 0.5 s margin
    assert r.route(4000, None, 1.0).region == "eu"
    r = RegionRouter("us", spill_margin_s=5.0)
    for name, wait in (("us", 1.9), ("eu", 0.0)):
        r.observe(summary(name, wait=wait), 0.0)
    r.measured("eu", 0.03)
    assert r.route(4000, None, 1.0).region == "us"  # a wide margin: home


def test_spill_goes_to_the_lowest_ttft_plus_rtt_open_region():
    r = router(eu=0.3, ap=0.0)  # eu 0.3 + 0.03 > ap 0.0 + 0.07
    r.observe(summary("us", saturated=True), 0.0)
    assert r.route(4000, None, 1.0).region == "ap"
    r = router(eu=0.0, ap=0.0)
    r.observe(summary("us", saturated=True), 0.0)
    r.observe(summary("eu", seq=2, saturated=True), 0.0)  # the nearest, but saturated too
    assert r.route(4000, None, 1.0).region == "ap"


def test_every_region_saturated_means_the_least_bad_home_winning_ties():
    r = router()
    for name in ("us", "eu", "ap"):
        r.observe(summary(name, wait=2.5, saturated=True), 0.0)
    route = r.route(4000, None, 1.0)
    assert (route.region, route.reason) == ("us", "home")  # equal queues: no round trip wins
    r = router()
    for name, wait in (("us", 2.5), ("eu", 2.1), ("ap", 2.1)):
        r.observe(summary(name, wait=wait, saturated=True), 0.0)
    route = r.route(4000, None, 1.0)
    assert (route.region, route.reason) == ("eu", "spill")  # 2.1 + 0.03 beats 2.5 at home


# --- dark regions -----------------------------------------------------------------------------


def test_region_dark_after_its_summaries_stop():
    r = router(us=0.0, eu=0.0, ap=0.0)
    r.observe(summary("us", seq=2), 3.5)
    r.observe(summary("ap", seq=2), 3.5)
    assert r.alive("eu", 3.0) and r.dark(3.0) == []
    assert not r.alive("eu", 3.1)
    assert r.dark(3.1) == ["eu"]
    assert not r.alive("sa", 0.0)  # never heard: not alive, but not dark either
    assert "sa" not in r.dark(10.0)


def test_dark_region_never_chosen_and_its_sessions_go_home():
    r = router(us=0.0, eu=0.0, ap=0.0)
    for name in ("us", "ap"):
        r.observe(summary(name, seq=2, saturated=name == "us"), 4.0)
    # eu is dark at 4.0: its session is recomputed, and the spill goes to ap
    route = r.route(10_000, placed("eu", 9000), 4.0)
    assert (route.region, route.reason) == ("ap", "spill")
    r.observe(summary("us", seq=3), 4.0)
    route = r.route(10_000, placed("eu", 9000), 4.0)
    assert (route.region, route.reason) == ("us", "home")
    r.observe(summary("eu", seq=2), 4.5)  # back: its sessions follow it again
    assert r.route(10_000, placed("eu", 9000), 4.5).region == "eu"


def test_blind_never_picks_a_dark_region():
    r = router(policy="blind", us=1.0, eu=0.0, ap=0.5)
    r.observe(summary("us", seq=2, wait=1.0), 4.0)
    r.observe(summary("ap", seq=2, wait=0.5), 4.0)
    assert r.route(1000, None, 4.0).region == "ap"


def test_dark_home_sends_elsewhere():
    r = router(us=0.0, eu=0.2, ap=0.0)
    for name in ("eu", "ap"):
        r.observe(summary(name, seq=2, wait=0.2 if name == "eu" else 0.0), 4.0)
    assert r.route(1000, None, 4.0).region == "ap"  # ap 0.07 + 0.1 < eu 0.2 + 0.03 + 0.1


# --- exclude ----------------------------------------------------------------------------------


def test_a_region_that_refused_is_excluded():
    r = router(us=0.0, eu=0.0, ap=0.0)
    assert r.route(4000, None, 1.0, exclude=frozenset({"us"})).region == "eu"
    assert r.route(4000, None, 1.0, exclude=frozenset({"us", "eu"})).region == "ap"
    assert r.route(10_000, placed("eu", 9000), 1.0, exclude=frozenset({"eu"})).region == "us"


def test_nothing_left_means_home():
    r = router(us=0.0, eu=0.0, ap=0.0)
    route = r.route(4000, None, 1.0, exclude=frozenset({"us", "eu", "ap"}))
    assert route.region == "us"


# --- summaries and round trips ----------------------------------------------------------------


def test_older_summary_ignored_new_scheduler_accepted():
    r = RegionRouter("us")
    r.observe(summary("eu", seq=5, wait=1.0), 0.0)
    r.observe(summary("eu", seq=4, wait=9.0), 0.1)  # overtaken on the way
    assert r.summary("eu").predicted_wait_s == 1.0
    r.observe(summary("eu", seq=5, wait=9.0), 0.1)  # the same one again
    assert r.summary("eu").predicted_wait_s == 1.0
    r.observe(summary("eu", seq=1, wait=2.0, scheduler="s2"), 0.2)  # a new scheduler counts from 1
    assert r.summary("eu").predicted_wait_s == 2.0
    assert r.summary("eu").scheduler_id == "eu-s2"


def test_an_ignored_summary_does_not_keep_a_region_alive():
    r = RegionRouter("us", dark_after_s=3.0)
    r.observe(summary("eu", seq=5), 0.0)
    r.observe(summary("eu", seq=4), 2.0)
    assert not r.alive("eu", 3.5)


def test_rtt_moving_average():
    r = RegionRouter("us")
    assert r.rtt_s("eu") is None
    r.measured("eu", 0.1)
    assert r.rtt_s("eu") == pytest.approx(0.1)
    r.measured("eu", 0.2)
    assert r.rtt_s("eu") == pytest.approx(0.7 * 0.1 + 0.3 * 0.2)
    r.measured("us", 0.5)  # home: no gateway, stays 0
    assert r.rtt_s("us") == 0.0


def test_unmeasured_rtt_costs_as_the_worst_measured():
    r = RegionRouter("us")
    for name in ("us", "eu", "ap", "sa"):
        r.observe(summary(name), 0.0)
    r.measured("eu", 0.03)
    r.measured("ap", 0.14)
    assert r.predicted_ttft_s("sa", 1000) == pytest.approx(0.1 + 0.14)
    assert r.predicted_ttft_s("eu", 1000) == pytest.approx(0.1 + 0.03)


def test_sent_tokens_push_the_next_spill_elsewhere():
    r = router(eu=0.0, ap=0.0)
    r.observe(summary("us", saturated=True), 0.0)
    first = r.route(10_000, None, 1.0)  # eu: 1.0 + 0.03; it now counts 1 s queued there
    second = r.route(10_000, None, 1.0)  # eu 2.03 > ap 1.07
    assert (first.region, second.region) == ("eu", "ap")
    r.observe(summary("eu", seq=2), 1.5)  # a new summary: what was sent is in it now
    assert r.route(10_000, None, 1.5).region == "eu"


# --- the other policies -----------------------------------------------------------------------


def test_local_is_always_home():
    r = router(policy="local", eu=0.0, ap=0.0)
    r.observe(summary("us", wait=50.0, saturated=True), 0.0)
    for placement in (None, placed("eu", 9000)):
        route = r.route(10_000, placement, 1.0, exclude=frozenset({"us"}))
        assert (route.region, route.reason) == ("us", "local")


def test_blind_picks_the_least_queue_ignoring_session_and_rtt():
    r = router(policy="blind", rtts={"eu": 0.03, "ap": 5.0}, us=0.4, eu=0.2, ap=0.1)
    route = r.route(10_000, placed("eu", 9000), 1.0)
    assert (route.region, route.reason) == ("ap", "blind")


def test_ties_break_home_first_then_by_name():
    assert router(policy="blind", us=0.0, eu=0.0, ap=0.0).route(0, None, 1.0).region == "us"
    r = router(rtts={"eu": 0.05, "ap": 0.05}, eu=0.0, ap=0.0)
    r.observe(summary("us", saturated=True), 0.0)
    assert r.route(0, None, 1.0).region == "ap"
    r = router(policy="blind", us=0.0, eu=0.0, ap=0.0)
    assert r.route(0, None, 1.0, exclude=frozenset({"us"})).region == "ap"


def test_same_inputs_same_decisions():
    def decisions() -> list[str]:
        r = router(eu=0.0, ap=0.0)
        r.observe(summary("us", saturated=True), 0.0)
        return [r.route(2000 + 500 * i, None, 1.0).region for i in range(20)]

    first = decisions()
    assert first == decisions()
    assert set(first) == {"eu", "ap"}


def test_regions_lists_every_region_heard_or_measured():
    r = router(us=0.0, eu=0.0)
    assert r.regions() == ["ap", "eu", "us"]
