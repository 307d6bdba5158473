"""``ingress.reasoning``: a thinking model's reasoning split from its answer, delta by delta."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from switchyard.ingress.reasoning import ThinkSplitter, opens_thought


def split(thinking: bool, deltas: list[str]) -> tuple[str, str]:
    splitter = ThinkSplitter(thinking)
    pieces = [piece for delta in deltas for piece in splitter.push(delta)] + splitter.finish()
    reasoning = "".join(text for kind, text in pieces if kind == "reasoning")
    return reasoning, "".join(text for kind, text in pieces if kind == "content")


@pytest.mark.parametrize(
    ("thinking", "deltas", "expected"),
    [
        (False, ["<think>", "hmm", "</think>", "answer"], ("hmm", "answer")),  # Qwen3 writes its <think>
        (False, ["<th", "ink>hm", "m</th", "ink>ans", "wer"], ("hmm", "answer")),  # tags cut across deltas
        (False, ["\n<think>a</think>b"], ("a", "b")),  # whitespace before the opening tag
        (True, ["hmm ", "more</think>\n\nanswer"], ("hmm more", "\n\nanswer")),  # the prompt opened it
        (True, ["<think>\nhmm</think>x"], ("\nhmm", "x")),  # opened by both: the tag is not reasoning
        (False, ["hello <think> world"], ("", "hello <think> world")),  # not first: just text
        (True, ["cut off mid thou"], ("cut off mid thou", "")),  # max_tokens inside the thought
        (True, ["a </thi"], ("a </thi", "")),  # a tag that never closed is text
        (False, ["<"], ("", "<")),
        (False, ["  ", "hello"], ("", "  hello")),
        (True, ["a</think>b</think>c"], ("a", "b</think>c")),  # one thought: the rest is the answer
    ],
)
def test_reasoning_and_content_come_apart(thinking, deltas, expected) -> None:
    assert split(thinking, deltas) == expected


@given(
    st.booleans(),
    st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", " ", "\n", "a", "bc"]), max_size=12),
    st.data(),
)
def test_how_the_text_is_cut_into_deltas_changes_nothing(thinking, parts, data) -> None:
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert split(thinking, deltas) == split(thinking, [text])


def test_where_the_prompt_leaves_the_output() -> None:
    assert opens_thought("<|im_start|>assistant\n<think>")  # DeepSeek-V3.1's thinking, R1's
    assert not opens_thought("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, thinking off
    assert not opens_thought("<|im_start|>assistant\n")
