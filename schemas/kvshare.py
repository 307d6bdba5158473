"""The KV that sequences decoding on one engine hold, each prompt block counted once.

vLLM's prefix cache shares a block between every running sequence whose prompt starts
with it (the block's hash chains its prefix, so equal keys are equal prefixes): ten
questions about one document hold the document's KV once. A decode worker handed such a
request finds those blocks already on its GPU and pulls only the rest (its KV connector
asks for what the local prefix cache misses). The scheduler's ledger and the worker's own
room check both count a decode's KV this way, with this one class, so that they agree on
what fits: ``kv_tokens`` of each request, less the full prompt blocks another running
request there already holds (``saved``).
"""

from __future__ import annotations

from collections.abc import Container, Sequence


class SharedBlocks:
    """Reference counts of the prompt blocks of the requests an engine decodes."""

    __slots__ = ("_keys", "_refs", "block_size", "saved")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._refs: dict[int, int] = {}
        self._keys: dict[str, Sequence[int]] = {}
        # Tokens the per-request sum counts more than once: block_size for each reference to
        # a block beyond its first. Held KV = (sum of each request's kv_tokens) - saved.
        self.saved = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._keys

    def held(self) -> list[int]:
        """Every block key held here."""
        return list(self._refs)

    def sharing(self, keys: Sequence[int]) -> int:
        """Tokens of a prompt with these block keys already held here: its leading blocks
        that a running request holds. A block's key covers its prefix, so whoever holds a
        block holds the ones before it: the first block not held ends the run, and the run
        is every block of the prompt held here (what ``add`` would count)."""
        refs, held = self._refs, 0
        if not refs:
            return 0
        for key in keys:
            if key not in refs:
                break
            held += 1
        return held * self.block_size

    def add(self, request_id: str, keys: Sequence[int], fresh: list[int] | None = None) -> int:
        """A request starts decoding here; the tokens it shares with the others. The keys
        held here only from now on are appended to ``fresh``."""
        assert request_id not in self._keys, request_id
        refs, shared = self._refs, 0
        for key in keys:
            count = refs.get(key, 0)
            if count:
                shared += 1
            elif fresh is not None:
                fresh.append(key)
            refs[key] = count + 1
        self._keys[request_id] = keys
        self.saved += shared * self.block_size
        return shared * self.block_size

    def remove(self, request_id: str, gone: list[int] | None = None) -> int:
        """A request ended here (or never was): by how much ``saved`` fell. The keys no
        longer held here are appended to ``gone``."""
        keys = self._keys.pop(request_id, None)
        if keys is None:
            return 0
        refs, dropped = self._refs, 0
        for key in keys:
            count = refs[key] - 1
            if count:
                refs[key] = count
                dropped += 1  # still held by another: no longer counted twice
            else:
                del refs[key]
                if gone is not None:
                    gone.append(key)
        self.saved -= dropped * self.block_size
        return dropped * self.block_size

    def check(self, requests: Container[str]) -> None:
        """``saved`` is what the counts say, every count is what the requests hold, and
        every request is one of ``requests`` (the ledger's)."""
        assert all(rid in requests for rid in self._keys)
        counts: dict[int, int] = {}
        for keys in self._keys.values():
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
        assert counts == self._refs
        assert self.saved == self.block_size * sum(n - 1 for n in counts.values())


__all__ = ["SharedBlocks"]
