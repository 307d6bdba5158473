"""End-to-end fixtures shared across modules: the vLLM reference outputs (one engine boot
per session, however many vllm modules use them)."""

from tests.support.vllm_stack import references_fixture

references = references_fixture()
