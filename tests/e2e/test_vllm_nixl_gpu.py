"""NIXL on GPUs: KV pulled from the prefill engine's GPU memory straight into the decode
engine's. Needs two CUDA GPUs and vLLM's CUDA build with NIXL (``pip install
'switchyard[vllm]'``); run with SWITCHYARD_GPU=1. Everything around it (engine arguments,
the handle on the bus, the transfer params the decode engine gets) is tested on CPU in
tests/unit/test_vllm_config.py and tests/unit/test_vllm_keys.py."""

from __future__ import annotations

import openai
import pytest

from tests.support.stack import wait_until
from tests.support.vllm_stack import BLOCK, MAX_TOKENS, BusWatch, vllm_stack

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(900)]


def test_nixl_handoff_matches_one_engine(module_nats, tmp_path, references):
    from switchyard.ingress.tokenizer import ModelTokenizer
    from tests.support.vllm_stack import tiny_model

    tokenizer = ModelTokenizer.load(tiny_model())
    with (
        vllm_stack(
            module_nats.url, tmp_path / "up.log", kv_transfer="nixl", extra=["--gpu-memory-utilization", "0.3"]
        ) as stack,
        BusWatch(stack.nats_url) as bus,
    ):
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
        for prompt, expected in zip(references["prompts"], references["outputs"], strict=True):
            response = client.completions.create(
                model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            assert response.choices[0].text == tokenizer.decode(expected["tokens"])
            if len(expected["tokens"]) > 1:
                assert wait_until(lambda r=response: r.id in bus.finished(), 5)
                done = bus.finished()[response.id]
                assert done.kv_loaded_tokens == done.kv_expected_tokens == len(prompt) // BLOCK * BLOCK
