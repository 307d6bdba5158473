"""End-to-end fixtures shared across modules: the vLLM reference outputs (one engine boot
per session, however many vllm modules use them), and, for a module that defines its own
``stack`` (a running ``switchyard up --engine vllm``), a bus watcher, a client and the
tokenizer."""

import openai
import pytest

from switchyard.ingress.tokenizer import ModelTokenizer
from tests.support.vllm_stack import BusWatch, UpStack, reference_outputs, seeded_prompts, tiny_model


@pytest.fixture(scope="session")
def references() -> dict:
    prompts = seeded_prompts()
    return {"prompts": prompts, "outputs": reference_outputs(tiny_model(), prompts)}


@pytest.fixture(scope="module")
def bus(stack: UpStack) -> BusWatch:
    with BusWatch(stack.nats_url) as watch:
        yield watch


@pytest.fixture(scope="module")
def client(stack: UpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer.load(tiny_model())
