"""Tokens to text, with stop sequences.

Text that could be the start of a stop sequence is held back until it is clearly
not one, so a client never sees part of a stop string. On a match the text ends
just before it, and the request is finished with ``finish_reason="stop"``.
"""

from __future__ import annotations

from switchyard.ingress.tokenizer import IncrementalDecoder


class TextAssembler:
    def __init__(self, decoder: IncrementalDecoder, stops: list[str]) -> None:
        self._decoder = decoder
        self._stops = stops
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
        hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._pending = self._pending[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        cut = len(self._pending) if final else max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out
