"""A thinking model's reasoning, apart from its answer (``--reasoning-parser think``).

Models such as Qwen3 and DeepSeek-R1 write their thinking between ``<think>`` and ``</think>``
before the answer. With a reasoning parser the chat endpoint returns that text as the
message's ``reasoning`` (``delta.reasoning`` when streamed), as vLLM's server does with its
``--reasoning-parser``, and only the rest as ``content`` (which the tool-call parser then reads).

Where the output starts is read off the prompt the chat template rendered: a template that
opens a thought for the model (DeepSeek-R1's, or DeepSeek-V3.1's with ``thinking``) ends its
prompt inside one, so the output is reasoning until ``</think>``; one that closes an empty
thought (Qwen3's with ``enable_thinking: false``) or opens none starts in the answer, where a
``<think>`` the model writes first starts its reasoning. A tag split across deltas is held back
until it is whole. An output cut off while thinking (``max_tokens``) has reasoning and no
content, as in vLLM.
"""

from __future__ import annotations

from typing import Literal

THINK_START = "<think>"
THINK_END = "</think>"

Piece = Literal["reasoning", "content"]


def opens_thought(prompt: str) -> bool:
    """Whether a rendered chat prompt ends inside a thought (its last tag is ``<think>``)."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


class ThinkSplitter:
    """One choice's text deltas, split into reasoning and content, in order."""

    def __init__(self, thinking: bool) -> None:
        self._thinking = thinking  # inside a thought now
        self._ended = False  # past the thought (or there is none): the rest is the answer
        self._at_start = True  # nothing sent yet: a <think> here opens (or repeats) the thought
        self._held = ""  # a tail that may be the start of a tag

    def push(self, text: str) -> list[tuple[Piece, str]]:
        text, self._held = self._held + text, ""
        out: list[tuple[Piece, str]] = []
        if self._at_start:
            text = self._opening(text)
        while text:
            if self._ended:
                out.append(("content", text))
                break
            text = self._in_thought(text, out)
        return _merged(out)

    def finish(self) -> list[tuple[Piece, str]]:
        """What was held back at the end of the output (no tag came of it)."""
        held, self._held = self._held, ""
        if not held:
            return []
        return [("reasoning" if self._thinking else "content", held)]

    def _opening(self, text: str) -> str:
        """The output's start: a ``<think>`` (after whitespace) opens the thought, or repeats
        the one the prompt opened, and is dropped; anything else settles where it is."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            self._at_start, self._thinking = False, True
            return stripped[len(THINK_START) :]
        if not stripped or THINK_START.startswith(stripped):
            self._held = text  # whitespace, or part of a <think>: wait for more
            return ""
        self._at_start = False
        self._ended = not self._thinking
        return text

    def _in_thought(self, text: str, out: list[tuple[Piece, str]]) -> str:
        end = text.find(THINK_END)
        if end >= 0:
            out.append(("reasoning", text[:end]))
            self._thinking, self._ended = False, True
            return text[end + len(THINK_END) :]
        keep = _partial_tail(text, THINK_END)
        out.append(("reasoning", text[: len(text) - keep]))
        self._held = text[len(text) - keep :]
        return ""


def _partial_tail(text: str, tag: str) -> int:
    """How many of the last characters of ``text`` may be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _merged(pieces: list[tuple[Piece, str]]) -> list[tuple[Piece, str]]:
    out: list[tuple[Piece, str]] = []
    for kind, text in pieces:
        if not text:
            continue
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


__all__ = ["THINK_END", "THINK_START", "Piece", "ThinkSplitter", "opens_thought"]
