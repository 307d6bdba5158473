"""Tokens to text, with stop sequences.

Text that could be the start of a stop sequence is held back until it is clearly
not one, so a client never sees part of a stop string. On a match the text ends
just before it, and the request is finished with ``finish_reason="stop"``.
"""

from __future__ import annotations

from switchyard.ingress.tokenizer import IncrementalDecoder


class TextAssembler:
    """``stop_token_ids``: tokens that end the output (the engine stops at them); their own
    text is not shown. ``include_stop``: a stop string or stop token stays in the text
    (vLLM's ``include_stop_str_in_output``)."""

    def __init__(
        self,
        decoder: IncrementalDecoder,
        stops: list[str],
        *,
        stop_token_ids: frozenset[int] = frozenset(),
        include_stop: bool = False,
    ) -> None:
        self._decoder = decoder
        self._stops = stops
        self._stop_ids = stop_token_ids
        self._include = include_stop
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""  # decoded, not yet released
        self.stopped = False
        self.tokens = 0

    def push(self, token_ids: list[int]) -> str:
        """Feed tokens; return the text now safe to send."""
        for token in token_ids:
            if self.stopped:
                break
            self.tokens += 1
            if token in self._stop_ids and not self._include:
                continue  # the engine ends here; the token's text is not output
            self._pending += self._decoder.push(token)
            self._check_stop()
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """The stream ended: release what was held back."""
        if not self.stopped:
            self._pending += self._decoder.flush()
            self._check_stop()
        return self._release(final=True)

    def _check_stop(self) -> None:
        hits = [(i, len(s)) for i, s in ((self._pending.find(s), s) for s in self._stops) if i >= 0]
        if hits:
            at, length = min(hits)
            self._pending = self._pending[: at + length if self._include else at]
            self.stopped = True

    def _release(self, final: bool) -> str:
        cut = len(self._pending) if final else max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out
