"""Three regions on this machine, joined as a NATS supercluster through emulated WAN round
trips (us-eu 30 ms, us-ap 70 ms, eu-ap 140 ms), each with its own scheduler, sim workers and
ingress, driven through the official ``openai`` client.

- a session started in one region and continued from another region's ingress is served
  where its prefix is, and reports the cached tokens;
- a saturated region spills to the others instead of answering 429;
- a region whose every process is killed under load: the streams it served for other
  regions' clients end cleanly (continued elsewhere, or an error event), none hangs, new
  requests succeed elsewhere within seconds, and the session directory survives.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack

import msgspec
import openai
import pytest

from switchyard.ingress.batch_config import BatchRunnerConfig
from switchyard.ingress.batch_runner import BatchRunner
from switchyard.ingress.config import RegionsConfig
from switchyard.ingress.federation import Federation, directory_key
from switchyard.ingress.service import IngressService
from switchyard.scheduler.config import SchedulerConfig, SchedulerServiceConfig
from switchyard.scheduler.service import SchedulerService
from switchyard.workers.sim import SimCostModel
from tests.support.regions import Supercluster, local_supercluster
from tests.support.stack import MODEL, Stack, running_stack, wait_until

RTT = "us-eu=30,us-ap=70,eu-ap=140"
REGIONS = ["us", "eu", "ap"]
DARK_AFTER_S = 1.5
# A prompt token costs 0.1 ms to prefill: recomputing a 2,000-token session at home (0.2 s)
# loses to its region's cache across a 30-140 ms round trip.
PREFILL = SimCostModel(prefill_base_s=0.005, prefill_per_token_s=0.0001)
DECODE = SimCostModel(decode_step_base_s=0.01)


def _prompt(seed: int, words: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 997}" for i in range(words))


class Regions:
    def __init__(self, sc: Supercluster) -> None:
        self.sc = sc
        self.stacks: dict[str, Stack] = {}
        self.exits: dict[str, ExitStack] = {}

    def start(self, region: str, **scheduler) -> Stack:
        exits = ExitStack()
        stack = exits.enter_context(
            running_stack(
                self.sc.url(region),
                scheduler=SchedulerConfig(worker_expiry_s=1.0, **scheduler),
                prefill_cost=PREFILL,
                decode_cost=DECODE,
                scheduler_overrides={"region": region, "summary_interval_s": 0.2},
                ingress_overrides={
                    "region": region,
                    "regions": RegionsConfig(dark_after_s=DARK_AFTER_S, ping_interval_s=0.3),
                },
            )
        )
        self.stacks[region], self.exits[region] = stack, exits
        return stack

    def client(self, region: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.stacks[region].base_url, api_key="unused", max_retries=0)

    def federation(self, region: str) -> Federation:
        federation = self.stacks[region].ingress.federation
        assert federation is not None
        return federation

    def kill(self, region: str) -> None:
        """Every process of the region: its nats-server and relay SIGKILLed, its services
        (which can no longer say anything) stopped."""
        self.sc.kill(region)
        self.exits.pop(region).close()
        del self.stacks[region]

    def wait_all_heard(self, timeout_s: float = 15.0) -> None:
        names = sorted(self.stacks)

        def heard() -> bool:
            now = time.monotonic()
            return all(
                all(self.federation(r).router.alive(o, now) for o in names)
                and all(self.federation(r).router.rtt_s(o) is not None for o in names)
                for r in names
            )

        assert wait_until(heard, timeout_s), "the regions did not hear each other's summaries"

    def wait_idle(self, timeout_s: float = 20.0) -> None:
        """Until every ingress hears every region say it has nothing queued or prefilling
        (what an earlier test left), so that a test's routes depend on its own load only."""

        def idle() -> bool:
            for r in self.stacks:
                router = self.federation(r).router
                for o in self.stacks:
                    summary = router.summary(o)
                    if summary is None or summary.queued_tokens or summary.inflight_tokens:
                        return False
            return True

        assert wait_until(idle, timeout_s), "the regions did not go idle"

    def close(self) -> None:
        for exits in self.exits.values():
            exits.close()


@pytest.fixture(scope="module")
def regions(tmp_path_factory) -> Iterator[Regions]:
    with local_supercluster(REGIONS, tmp_path_factory.mktemp("regions"), rtt=RTT) as sc:
        fleet = Regions(sc)
        try:
            for region in REGIONS:
                # ap's queue takes little: a burst there is refused unless it spills
                fleet.start(region, **({"max_queued_tokens": 20_000} if region == "ap" else {}))
            fleet.wait_all_heard()
            yield fleet
        finally:
            fleet.close()


def _chat(client: openai.OpenAI, content: str, session: str | None = None, extra_headers=None, **kw):
    headers = ({"x-session-affinity": session} if session else {}) | (extra_headers or {})
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], extra_headers=headers, **kw
    )


def test_round_trips_are_measured_per_pair(regions: Regions) -> None:
    us = regions.federation("us").router
    eu = regions.federation("eu").router
    assert 0.025 < us.rtt_s("eu") < 0.030 + 0.25
    assert 0.065 < us.rtt_s("ap") < 0.070 + 0.25
    assert 0.135 < eu.rtt_s("ap") < 0.140 + 0.25


def test_a_session_continued_from_another_region_is_served_where_its_prefix_is(regions: Regions) -> None:
    text = _prompt(1, 500)
    first = _chat(regions.client("us"), text, session="traveller", max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    eu = regions.federation("eu")
    key = directory_key("default", "traveller")
    assert wait_until(lambda: eu.directory.lookup(key, time.time()) is not None, 5.0)
    assert eu.directory.lookup(key, time.time()).region == "us"
    before = dict(eu.routed)
    regions.wait_idle()  # the user reads the answer; us's next summaries say its prefill is done
    follow = text + " " + first.choices[0].message.content + " and then"
    second = _chat(regions.client("eu"), follow, session="traveller", max_tokens=4)
    # Served by us, whose prefill worker held the first turn's blocks
    assert eu.routed.get(("us", "session"), 0) == before.get(("us", "session"), 0) + 1
    # every whole block the two prompts share (the first ended with the assistant header)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32
    # The same continuation with no session stays in eu, and recomputes
    third = _chat(regions.client("eu"), follow + " again", max_tokens=4)
    assert third.usage.prompt_tokens_details.cached_tokens == 0


def test_a_saturated_region_spills_instead_of_refusing(regions: Regions) -> None:
    # ap's queue holds 20,000 prompt tokens: a burst of 48 x 2,000 would be refused there
    ap = regions.federation("ap")
    before = sum(n for (region, reason), n in ap.routed.items() if reason == "spill")
    client = regions.client("ap")
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        replies = list(pool.map(lambda i: _chat(client, _prompt(100 + i, 700), max_tokens=8), range(48)))
    assert all(r.usage.completion_tokens == 8 for r in replies)
    spilled = sum(n for (region, reason), n in ap.routed.items() if reason == "spill") - before
    assert spilled > 0, ap.routed


def test_a_client_may_pin_its_request_to_a_region(regions: Regions) -> None:
    us = regions.federation("us")
    before = us.routed.get(("ap", "pinned"), 0)
    reply = regions.client("us").chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stay in ap"}],
        max_tokens=3,
        extra_headers={"x-switchyard-region": "ap"},
    )
    assert reply.usage.completion_tokens == 3
    assert us.routed.get(("ap", "pinned"), 0) == before + 1
    with pytest.raises(openai.BadRequestError, match="Unknown region 'mars'"):
        regions.client("us").chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=3,
            extra_headers={"x-switchyard-region": "mars"},
        )


def test_a_batch_runs_in_another_region_while_its_own_has_no_headroom(regions: Regions) -> None:
    # ap's scheduler is gone (no headroom to read at home); its ingress, JetStream and runner stay
    ap = regions.stacks["ap"]
    ap.stop_scheduler()
    try:
        runner = BatchRunner(
            BatchRunnerConfig(
                nats_url=regions.sc.url("ap"),
                ingress_url=ap.ingress.url,
                region="ap",
                scan_interval_s=0.1,
                remote_status_interval_s=0.2,
            )
        )
        ap.start(runner.run)
        lines = [
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": MODEL, "messages": [{"role": "user", "content": f"batch {i}"}], "max_tokens": 3},
            }
            for i in range(6)
        ]
        client = regions.client("ap")
        upload = client.files.create(
            file=("in.jsonl", b"".join(json.dumps(x).encode() + b"\n" for x in lines)), purpose="batch"
        )
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while (batch := client.batches.retrieve(batch.id)).status != "completed":
            assert batch.status not in ("failed", "expired", "cancelled"), batch
            assert time.monotonic() < deadline, batch
            time.sleep(0.2)
        assert batch.request_counts.completed == 6
        routed = regions.federation("ap").routed
        assert sum(n for (region, reason), n in routed.items() if reason == "pinned" and region != "ap") >= 6, routed
        output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in output) == [f"line-{i}" for i in range(6)]
        assert all(o["response"]["status_code"] == 200 for o in output)
    finally:
        ap.start(
            SchedulerService(
                SchedulerServiceConfig(
                    nats_url=regions.sc.url("ap"),
                    core=SchedulerConfig(worker_expiry_s=1.0, max_queued_tokens=20_000),
                    region="ap",
                    summary_interval_s=0.2,
                )
            ).run
        )
    assert wait_until(lambda: regions.federation("us").router.alive("ap", time.monotonic()), 15.0)


def test_a_region_killed_under_load_ends_cleanly_and_the_others_take_over(regions: Regions) -> None:
    # Sessions whose prefix is in eu, continued from us's ingress: served in eu, streaming
    sessions = [f"s-{i}" for i in range(6)]
    texts = {s: _prompt(200 + i, 700) for i, s in enumerate(sessions)}
    regions.wait_idle()
    for s in sessions:  # pinned: a busy eu could spill a new session's first turn
        _chat(regions.client("eu"), texts[s], session=s, max_tokens=2, extra_headers={"x-switchyard-region": "eu"})
    regions.wait_idle()
    us = regions.federation("us")
    keys = {s: directory_key("default", s) for s in sessions}
    assert wait_until(lambda: all(us.directory.lookup(k, time.time()) for k in keys.values()), 5.0)
    assert {us.directory.lookup(k, time.time()).region for k in keys.values()} == {"eu"}
    client = regions.client("us")

    def stream(s: str) -> tuple[str, int, float]:
        started = time.monotonic()
        tokens, outcome = 0, "no end"
        try:
            for chunk in _chat(client, texts[s] + " next", session=s, max_tokens=300, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    tokens += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    outcome = chunk.choices[0].finish_reason
        except openai.APIError as exc:  # an error event in the stream: a clean end
            outcome = f"error: {exc}"
        return outcome, tokens, time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        futures = [pool.submit(stream, s) for s in sessions]
        assert wait_until(lambda: us.routed.get(("eu", "session"), 0) >= len(sessions), 10.0), (
            us.routed,
            us.router.summary("eu"),
        )
        time.sleep(0.5)  # mid-stream
        killed_at = time.monotonic()
        regions.kill("eu")
        results = [f.result(timeout=40) for f in futures]
    for outcome, tokens, _took in results:
        assert outcome == "length" or outcome.startswith("error"), (outcome, tokens)
    # Continued in us or ap after eu went dark (mid-stream migration), not left hanging
    assert sum(1 for outcome, _, _ in results if outcome == "length") >= len(sessions) - 1, results
    assert us.lost >= 1
    # New requests entering at us succeed at once, and eu's sessions now stay out of eu
    reply = _chat(client, texts[sessions[0]] + " later", session=sessions[0], max_tokens=4)
    assert reply.usage.completion_tokens == 4
    assert time.monotonic() - killed_at < 40
    assert not us.router.alive("eu", time.monotonic())
    # The directory survives: a new ingress in ap reads every placement from ap's own stream
    ap = regions.stacks["ap"]
    fresh = IngressService(msgspec.structs.replace(ap.ingress.config, ingress_id="", port=0))
    ap.start(fresh.run)
    federation = fresh.federation
    assert federation is not None
    # ap's JetStream may be electing a meta leader (eu held it): the backlog comes once it answers
    assert wait_until(lambda: all(federation.directory.lookup(k, time.time()) for k in keys.values()), 30.0)
