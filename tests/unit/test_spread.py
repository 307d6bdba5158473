"""Where new content goes: ``switchyard`` spreads prompts cached nowhere over a disaggregated
prefill fleet, and over a colocated one while it is not busy (``Switchyard.spread``), and
workers of one device class share one prefill rate."""

from __future__ import annotations

import pytest

from switchyard.scheduler import Dispatch, SchedulerConfig, SchedulerCore
from switchyard.schemas import LocalTask, PrefillTask
from tests.support.factories import FakeClock, load_report, make_spec, prefill_done


def core_with(roles: dict[str, str], ttft_slo_s: float) -> tuple[SchedulerCore, FakeClock]:
    core, clock = SchedulerCore(SchedulerConfig(policy="switchyard", ttft_slo_s=ttft_slo_s)), FakeClock()
    for wid, role in roles.items():
        core.on_event(load_report(wid, role, budget=1_000_000, seq=1), clock.now)  # type: ignore[arg-type]
    return core, clock


def place_one_at_a_time(
    core: SchedulerCore, clock: FakeClock, n: int, prefill_s: dict[str, float] | None = None
) -> list[str]:
    """``n`` prompts of new content, each prefilled before the next arrives: every worker
    idle. Each takes 0.25 s, or its worker's ``prefill_s``."""
    where = []
    for i in range(n):
        spec = make_spec(f"r{i}", prompt_len=2_000)
        _, actions = core.submit(spec, clock.now)
        (task,) = [a for a in actions if isinstance(a, Dispatch) and isinstance(a.task, PrefillTask | LocalTask)]
        where.append(task.worker_id)
        took = (prefill_s or {}).get(task.worker_id, 0.25)
        clock.advance(took)
        core.on_event(prefill_done(spec, task.worker_id, prefill_s=took), clock.now)
        core.check_invariants()
    return where


@pytest.mark.parametrize("ttft_slo_s", [0.0, 2.0], ids=["no-slo", "slo"])
def test_prompts_cached_nowhere_go_round_an_idle_prefill_fleet(ttft_slo_s: float) -> None:
    # Before, the quickest always took them: among idle workers of equal rate the lowest id,
    # so p0's cache took every new document and churned while p1 and p2 kept old ones.
    core, clock = core_with({"p0": "prefill", "p1": "prefill", "p2": "prefill", "d0": "decode"}, ttft_slo_s)
    assert place_one_at_a_time(core, clock, 6) == ["p0", "p1", "p2", "p0", "p1", "p2"]


@pytest.mark.parametrize(("queued", "expected"), [(0, "p0"), (1, "p1")])
def test_a_worker_filled_longer_ago_takes_the_prompt_only_where_it_is_as_quick(queued: int, expected: str) -> None:
    # p1 took new content last; p0 took it before and has ``queued`` tokens ahead: as quick
    # as p1 (none), it takes the prompt; one token slower, it does not (first tokens are
    # never traded for the spread).
    core, clock = core_with({"p0": "prefill", "p1": "prefill", "d0": "decode"}, 2.0)
    core.fleet.mark_filled(core.workers["p0"])
    core.fleet.mark_filled(core.workers["p1"])
    if queued:
        core.workers["p0"].assign("ahead", queued)
    _, actions = core.submit(make_spec("r", prompt_len=2_000), clock.now)
    assert [a.worker_id for a in actions] == [expected]


@pytest.mark.parametrize(("busy", "expected"), [(False, "c2"), (True, "c0")], ids=["light", "busy"])
def test_on_a_colocated_fleet_ties_spread_only_while_it_is_not_busy(busy: bool, expected: str) -> None:
    # c2, c1, then c0 took new content. Not busy, c2 (filled longest ago) takes the next prompt, as
    # on a prefill fleet. Busy, the quickest does, ties to the lowest id: spread over more
    # workers, prompts stalled more decodes (tool agents at saturation: TPOT p90 43 -> 67 ms).
    core, clock = core_with({"c0": "both", "c1": "both", "c2": "both"}, 2.0)
    core.fleet.mark_filled(core.workers["c2"])
    core.fleet.mark_filled(core.workers["c1"])
    core.fleet.mark_filled(core.workers["c0"])
    core.fleet.busy = busy
    _, actions = core.submit(make_spec("r", prompt_len=2_000), clock.now)
    assert [a.worker_id for a in actions] == [expected]


def test_prompts_cached_nowhere_go_round_an_idle_colocated_fleet() -> None:
    # c0 measures a faster prefill (as a worker given whole prompts did, beside others that
    # computed short suffixes of cached prefixes). Learnt as its own factor, that took it
    # every prompt cached nowhere; the fleet is not busy, so the three share one rate.
    core, clock = core_with({"c0": "both", "c1": "both", "c2": "both"}, 2.0)
    where = place_one_at_a_time(core, clock, 6, prefill_s={"c0": 0.15})
    assert where == ["c0", "c1", "c2", "c0", "c1", "c2"]


def test_a_workers_device_class_comes_from_its_report_and_is_bounded() -> None:
    core, clock = SchedulerCore(SchedulerConfig()), FakeClock()
    core.on_event(load_report("p0", device_class="H100x2", seq=1), clock.now)
    core.on_event(load_report("p1", device_class="x" * 500, seq=1), clock.now)
    assert core.workers["p0"].device_class == "H100x2"
    assert core.workers["p1"].device_class == "x" * 64
    core.check_invariants()
