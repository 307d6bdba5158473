"""Log-probabilities as the two OpenAI endpoints return them.

The engine sends, per output token, the sampled token's logprob and the ``k`` most likely
tokens at its position (``TokenLogprobs``, carried on the bus with the tokens). Chat shows each
token as ``{"token", "logprob", "bytes", "top_logprobs": [...]}`` under ``content``; completions
as parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs`` as token -> logprob maps,
the sampled token's included, and ``text_offset``). A token's text is its own, special tokens
spelled out; a byte-level token that is part of a character shows the replacement character,
and its ``bytes`` are those of that text (vLLM does the same).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from switchyard.schemas import TokenLogprobs

TokenText = Callable[[int], str]


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0  # JSON has no -inf; OpenAI's floor is -9999


def chat_logprobs(tokens: list[int], logprobs: list[TokenLogprobs], text: TokenText) -> dict[str, Any]:
    content = []
    for token, lp in zip(tokens, logprobs, strict=True):
        piece = text(token)
        content.append(
            {
                "token": piece,
                "logprob": _finite(lp.logprob),
                "bytes": list(piece.encode()),
                "top_logprobs": [
                    {"token": (alt := text(tid)), "logprob": _finite(value), "bytes": list(alt.encode())}
                    for tid, value in zip(lp.top_ids, lp.top_logprobs, strict=True)
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    tokens: list[int], logprobs: list[TokenLogprobs], text: TokenText, offset: int = 0
) -> dict[str, Any]:
    """``offset``: where the first token's text starts in the choice's text."""
    pieces, offsets, tops = [], [], []
    for token, lp in zip(tokens, logprobs, strict=True):
        piece = text(token)
        pieces.append(piece)
        offsets.append(offset)
        offset += len(piece)
        top = {text(tid): _finite(value) for tid, value in zip(lp.top_ids, lp.top_logprobs, strict=True)}
        top.setdefault(piece, _finite(lp.logprob))
        tops.append(top)
    return {
        "tokens": pieces,
        "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
