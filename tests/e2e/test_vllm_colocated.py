"""Real vLLM engines as colocated workers (role ``both``: ``switchyard up --prefill 0
--decode 0 --colocated 2``), KV between them through a real Mooncake Store, through the
real HTTP API.

A TPOT SLO no CPU engine can keep (1 ms) makes the scheduler lend one worker to decoding
after the first request; from then on the other prefills (``PrefillTask`` on a colocated
worker, its connector role ``kv_both``) and hands the KV to the lent one, until the
scheduler has measured what a handoff costs a prompt token (two handoffs of prompts of
different lengths). After that, each request whose handoff over its 16-token answer costs
more than a quarter of that SLO a token decodes where it was prefilled
(``Lending.keeps_local``): with a 1 ms SLO, most or all of them, depending on this
machine's speed. What the test proves, from the engines' own events rather than timing:
every greedy output is one engine's output alone, requests were handed from one
colocated engine to the other, and the lent engine loaded every whole block it was
handed (it did not recompute).
"""

from __future__ import annotations

import pytest

from switchyard.schemas import PrefillDone
from tests.support.stack import wait_until
from tests.support.vllm_stack import UpStack, assert_loaded, greedy_decodes, vllm_stack

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def stack(module_nats, tmp_path_factory) -> UpStack:
    log = tmp_path_factory.mktemp("vllm") / "up.log"
    extra = ["--prefill", "0", "--decode", "0", "--colocated", "2", "--ttft-slo-s", "600", "--tpot-slo-s", "0.001"]
    with vllm_stack(module_nats.url, log, kv_transfer="mooncake-store", extra=extra) as s:
        yield s


def test_colocated_engines_hand_off_and_keep_one_engines_greedy_output(stack, references, client, bus, tokenizer):
    assert wait_until(lambda: [w.role for w in bus.status().workers] == ["both", "both"], 30)
    handed = 0
    for prompt, finished in greedy_decodes(client, bus, tokenizer, references):
        prefilled = [e for e in bus.events if isinstance(e, PrefillDone) and e.request_id == finished.request_id]
        assert len(prefilled) == 1
        if prefilled[0].worker_id != finished.worker_id:  # prefilled on one, decoded on the other
            handed += 1
            assert_loaded(prompt, finished)
    # The first decode ran slower than the SLO: a worker was lent, and the next requests were
    # handed to it at least until two handoffs had measured the handoff's cost.
    assert handed >= 2, handed
