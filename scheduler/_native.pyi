# The C module's signatures (scheduler/_native.c says what each does).
from array import array
from collections.abc import Sequence
from typing import Any

import numpy.typing as npt

# What the C reads and writes in place: the index's columns and the fleet's arrays.
Buffer = array[Any] | npt.NDArray[Any]

DONE: int
NEEDS_PYTHON: int
OVER_BOUND: int

def walk(
    keys: Buffer,
    stamp: Buffer,
    holder: Buffer,
    tiers: Buffer,
    shift: int,
    masks: list[int],
    wanted: int,
    block_keys: list[int],
    clock: int,
    blocks: Buffer,
    device: Buffer,
) -> int: ...
def store(
    keys: Buffer,
    stamp: Buffer,
    holder: Buffer,
    tiers: Buffer,
    shift: int,
    block_keys: list[int],
    pos: int,
    worker: int,
    bit: int,
    clock: int,
    live: int,
    tombs: int,
    pairs: int,
    max_pairs: int,
) -> tuple[int, int, int, int, int, int, int]: ...
def unset(
    keys: Buffer,
    stamp: Buffer,
    holder: Buffer,
    tiers: Buffer,
    shift: int,
    block_keys: list[int],
    pos: int,
    worker: int,
    bits: int,
    live: int,
    tombs: int,
    pairs: int,
) -> tuple[int, int, int, int, int, int]: ...
def choose_prefill(
    load: Buffer,
    rate: Buffer,
    budget: Buffer,
    kv: Buffer,
    kv_cap: Buffer,
    holding: Buffer,
    colocated: Buffer,
    rank: Buffer,
    slots: Buffer,
    rows: Buffer,
    blocks: Buffer,
    device: Buffer,
    prompt: int,
    block_size: int,
    fetch_credit: float,
    decode_tokens: int,
    check_kv: bool,
    limit: float,
    limit2: float,
    queue_weight: float,
    kv_tie: bool,
    placed: Buffer,
    room_edge: Buffer,
    factor: Buffer,
    prefill_scale: float,
    both_scale: float,
    filled: Buffer,
    by_filled: bool,
) -> tuple[int, float] | None: ...
def choose_decode(
    load: Buffer,
    budget: Buffer,
    running: Buffer,
    rank: Buffer,
    slots: Buffer,
    tokens: int,
    saved: Buffer | None,
    weight: float,
) -> int: ...
def share_add(refs: dict[int, int], keys: Sequence[int], fresh: list[int] | None) -> int: ...
def share_remove(refs: dict[int, int], keys: Sequence[int], gone: list[int] | None) -> int: ...
def hold_keys(held_by: dict[int, int], holding: dict[int, int], slot: int, keys: Sequence[int], held: bool) -> None: ...
def decode_sharing(
    held_by: dict[int, int], holding: dict[int, int], keys: Sequence[int], block_size: int, out: Buffer
) -> bool: ...
