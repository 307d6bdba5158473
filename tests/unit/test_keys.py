"""Chained block keys: the one block-hash of Switchyard, and the facts the router relies on."""

from __future__ import annotations

import random

import pytest

from switchyard.kvbus.keys import ROOT_KEY, block_keys, hash_block_tokens, salt_for

SALT = salt_for("acme", "switchyard-sim")
SEED = 20240611


def _tokens(n: int, seed: int = SEED) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4096) for _ in range(n)]


def test_pinned_values() -> None:
    # Computed once and written down: any change to the layout, the hash or the salt
    # derivation changes these, which would silently invalidate every cache in a fleet
    # running mixed versions. Change them only together with WIRE_VERSION.
    assert SALT.hex() == "b8b0e84231f3a1234719418f63a74422"
    assert block_keys(list(range(1, 13)), 4, SALT) == [
        1810002644782186153,
        380403963536631056,
        8399491695450081961,
    ]


def test_keys_are_chained_through_hash_block_tokens() -> None:
    tokens = list(range(1, 13))
    k0 = hash_block_tokens(ROOT_KEY, tokens[0:4], SALT)
    k1 = hash_block_tokens(k0, tokens[4:8], SALT)
    k2 = hash_block_tokens(k1, tokens[8:12], SALT)
    assert block_keys(tokens, 4, SALT) == [k0, k1, k2]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_keys_of_a_prompt_prefix_its_extension(block_size: int) -> None:
    print(f"seed={SEED}")
    prompt = _tokens(50)
    extended = prompt + _tokens(37, seed=SEED + 1)
    short, long = block_keys(prompt, block_size, SALT), block_keys(extended, block_size, SALT)
    assert len(short) == len(prompt) // block_size
    assert long[: len(short)] == short
    assert len(long) == len(extended) // block_size


def test_trailing_partial_block_has_no_key() -> None:
    tokens = _tokens(16 * 3 + 15)
    keys = block_keys(tokens, 16, SALT)
    assert len(keys) == 3
    assert keys == block_keys(tokens[: 16 * 3], 16, SALT)
    assert block_keys(tokens[:15], 16, SALT) == []
    assert block_keys([], 16, SALT) == []


def test_different_tenant_gives_disjoint_keys() -> None:
    tokens = _tokens(128)
    a = block_keys(tokens, 16, salt_for("tenant-a", "m"))
    b = block_keys(tokens, 16, salt_for("tenant-b", "m"))
    other_model = block_keys(tokens, 16, salt_for("tenant-a", "m2"))
    assert len(a) == 8
    assert not set(a) & set(b)
    assert not set(a) & set(other_model)


def test_salt_separates_tenant_and_model_fields() -> None:
    # "ab" + "c" must not collide with "a" + "bc".
    assert salt_for("ab", "c") != salt_for("a", "bc")


def test_a_change_in_block_zero_changes_every_later_key() -> None:
    tokens = _tokens(16 * 6)
    changed = list(tokens)
    changed[5] = (changed[5] + 1) % 4096
    before, after = block_keys(tokens, 16, SALT), block_keys(changed, 16, SALT)
    assert all(x != y for x, y in zip(before, after, strict=True))


def test_a_change_in_a_later_block_keeps_the_keys_before_it() -> None:
    tokens = _tokens(16 * 6)
    changed = list(tokens)
    changed[16 * 3] ^= 1
    before, after = block_keys(tokens, 16, SALT), block_keys(changed, 16, SALT)
    assert before[:3] == after[:3]
    assert all(x != y for x, y in zip(before[3:], after[3:], strict=True))


def test_same_tokens_in_another_position_get_another_key() -> None:
    block = _tokens(8)
    keys = block_keys(block + block, 8, SALT)
    assert keys[0] != keys[1]


def test_keys_fit_in_64_bits() -> None:
    keys = block_keys(_tokens(256), 4, SALT)
    assert all(0 <= k < 2**64 for k in keys)
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("block_size", [0, -1, -16])
def test_non_positive_block_size_raises(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1, 2, 3], block_size, SALT)
