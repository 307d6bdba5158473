"""The ingress tokenizer against the shipped simulated model, and that model's reproducibility."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

import switchyard.ingress.tokenizer as tokenizer_module
from switchyard.ingress.tokenizer import ModelInfo, ModelTokenizer, TokenizerError
from switchyard.models import build_tokenizer

SHIPPED = Path(build_tokenizer.__file__).parent / "sim-tiny"
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer.load(SHIPPED)


def test_shipped_model_loads(tok: ModelTokenizer) -> None:
    assert tok.info == ModelInfo(name="switchyard-sim", max_context=4096, vocab_size=4096, eos_token_id=4095)
    assert tok.sample_token_ids() == range(0, 4093)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Hello, world!",
        "  leading and trailing spaces  \n\ttabs\r\n",
        "日本語のテキストと中文分词",
        "emoji 😀🚀👍🏽 family 👨‍👩‍👧 flag 🇳🇴",
        "combining e\u0301 and zero\u200bwidth, RTL שלום مرحبا",
        "math ∑ ≤ ≥ × ±, symbols € £ °C, controls \x00\x1f",
        "🦀" * 50,
    ],
)
def test_encode_decode_round_trip(tok: ModelTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
]
EXPECTED_CHATML = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
)


def test_chat_template_renders_chatml(tok: ModelTokenizer) -> None:
    assert tok.render_chat(CONVERSATION) == EXPECTED_CHATML


def test_chat_special_tokens_encode_as_single_ids(tok: ModelTokenizer) -> None:
    ids = tok.encode_chat(CONVERSATION)
    im_start, im_end = 4094, 4095
    assert ids[0] == im_start
    assert ids.count(im_start) == 3
    assert ids.count(im_end) == 2
    assert tok.decode(ids) == "system\nYou are terse.\nuser\nHi there\nassistant\n"


def test_chat_template_failure_is_a_tokenizer_error(tok: ModelTokenizer) -> None:
    with pytest.raises(TokenizerError, match="content must be a string"):
        tok.render_chat([{"role": "user", "content": ["not", "a", "string"]}])


def _stream_decode(tok: ModelTokenizer, ids: list[int]) -> list[str]:
    stream = tok.decode_stream()
    return [stream.push(i) for i in ids] + [stream.flush()]


@pytest.mark.parametrize("use_decode_stream", [True, False], ids=["DecodeStream", "fallback"])
def test_incremental_decode_matches_decode(
    tok: ModelTokenizer, monkeypatch: pytest.MonkeyPatch, use_decode_stream: bool
) -> None:
    if not use_decode_stream:
        monkeypatch.setattr(tokenizer_module, "DecodeStream", None)
    seed = 1234
    print(f"seed={seed}")
    rng = random.Random(seed)
    ids = [rng.choice(tok.sample_token_ids()) for _ in range(500)]
    assert "".join(_stream_decode(tok, ids)) == tok.decode(ids)


@pytest.mark.parametrize("use_decode_stream", [True, False], ids=["DecodeStream", "fallback"])
def test_incremental_decode_holds_back_split_characters(
    tok: ModelTokenizer, monkeypatch: pytest.MonkeyPatch, use_decode_stream: bool
) -> None:
    if not use_decode_stream:
        monkeypatch.setattr(tokenizer_module, "DecodeStream", None)
    text = "emoji 😀🦀 and 日本語 and naïve"
    chunks = _stream_decode(tok, tok.encode(text))
    assert "".join(chunks) == text
    assert "" in chunks[:-1], "expected some token to end inside a multi-byte character"
    assert not any("\ufffd" in chunk for chunk in chunks)


def test_tokenizer_build_is_reproducible(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    build_tokenizer.build(first)
    build_tokenizer.build(second)
    for name in MODEL_FILES:
        shipped = (SHIPPED / name).read_bytes()
        assert (first / name).read_bytes() == shipped, f"{name} differs from the shipped file"
        assert (second / name).read_bytes() == shipped, f"{name} differs between builds"


def test_config_json_is_optional(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED / name, model_dir / name)
    info = ModelTokenizer.load(model_dir).info
    assert info == ModelInfo(name="my-model", max_context=4096, vocab_size=4096, eos_token_id=4095)


def test_missing_tokenizer_json_is_named(tmp_path: Path) -> None:
    for name in ("tokenizer_config.json", "config.json"):
        shutil.copy(SHIPPED / name, tmp_path / name)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json") as caught:
        ModelTokenizer.load(tmp_path)
    assert caught.value.path == tmp_path / "tokenizer.json"


def test_flush_releases_a_trailing_incomplete_character(tok: ModelTokenizer) -> None:
    # A token that is only the start of a multi-byte character, e.g. a lone UTF-8 lead byte.
    partial = next(i for i in tok.sample_token_ids() if tok.decode([i]).endswith("\ufffd"))
    ids = [*tok.encode("ok"), partial]
    stream = tok.decode_stream()
    pushed = "".join(stream.push(i) for i in ids)
    held = stream.flush()
    assert pushed == "ok"
    assert held.endswith("\ufffd")
    assert pushed + held == tok.decode(ids)
