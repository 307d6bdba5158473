"""The ingress tokenizer against the shipped simulated model, and that model's reproducibility."""

from __future__ import annotations

import math
import os
import random
import shutil
import sys
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

import switchyard.ingress.tokenizer as tokenizer_module
from switchyard.ingress.errors import InvalidRequest
from switchyard.ingress.openai_types import template_kwargs
from switchyard.ingress.tokenizer import ModelInfo, ModelTokenizer, TokenizerError
from switchyard.models import build_tokenizer

SHIPPED = Path(build_tokenizer.__file__).parent / "sim-tiny"
# Built by the vLLM tests' fixture (tests/support/vllm_stack.py); used here when present.
TINY_LLAMA = Path(os.environ.get("SWITCHYARD_TINY_MODEL", Path(__file__).parents[2] / ".cache" / "tiny-llama"))
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


def test_chat_template_kwargs_reach_the_template_and_never_override_what_it_is_given(tok: ModelTokenizer) -> None:
    # Qwen3's switch, as the bundled template has it: an empty thought opens the answer.
    assert (
        tok.render_chat(CONVERSATION, kwargs={"enable_thinking": False}) == EXPECTED_CHATML + "<think>\n\n</think>\n\n"
    )
    assert tok.render_chat(CONVERSATION, kwargs={"enable_thinking": True}) == EXPECTED_CHATML
    assert tok.render_chat(CONVERSATION, kwargs={"unread_variable": 1}) == EXPECTED_CHATML
    overridden = {"messages": [], "add_generation_prompt": False, "eos_token": "x"}
    assert tok.render_chat(CONVERSATION, kwargs=overridden) == EXPECTED_CHATML


def test_chat_template_kwargs_may_not_name_what_the_ingress_sets(tok: ModelTokenizer) -> None:
    assert template_kwargs({"enable_thinking": False, "thinking": True}, tok.template_variables) == {
        "enable_thinking": False,
        "thinking": True,
    }
    # reasoning_effort as vLLM passes it: enable_thinking from it, unless the kwargs set that.
    assert template_kwargs(None, (), "none") == {"reasoning_effort": "none", "enable_thinking": False}
    assert template_kwargs({"enable_thinking": False}, (), "high") == {
        "reasoning_effort": "high",
        "enable_thinking": False,
    }
    for name in ("messages", "tools", "add_generation_prompt", "eos_token", "not a name", ""):
        with pytest.raises(InvalidRequest) as caught:
            template_kwargs({name: 1}, tok.template_variables)
        assert caught.value.param == "chat_template_kwargs" and repr(name) in caught.value.message


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


# --- the size check: min_tokens is a true lower bound --------------------------------------


def _models() -> list[Path]:
    return [SHIPPED, *([TINY_LLAMA] if (TINY_LLAMA / "tokenizer.json").is_file() else [])]


@pytest.fixture(scope="module", params=_models(), ids=lambda p: p.name)
def bounded(request) -> ModelTokenizer:
    return ModelTokenizer.load(request.param)


def _vocabulary_texts(tok: ModelTokenizer) -> st.SearchStrategy[str]:
    """Texts glued from whole tokens, the longest and the special ones included: the case
    where few tokens cover many bytes, so where a wrong bound would show."""
    pieces = [tok.decode([i]) for i in tok.sample_token_ids()] + ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    longest = sorted(pieces, key=lambda p: len(p.encode()))[-50:]
    return st.lists(st.sampled_from(longest) | st.sampled_from(pieces), max_size=40).map("".join)


def test_bytes_per_token_is_the_longest_token(bounded: ModelTokenizer) -> None:
    longest = max((bounded.decode([i]) for i in bounded.sample_token_ids()), key=lambda t: len(t.encode()))
    assert "\ufffd" not in longest
    assert bounded.bytes_per_token == len(longest.encode())
    assert bounded.min_tokens(longest) == len(bounded.encode(longest)) == 1  # the bound is tight here


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_min_tokens_never_exceeds_the_tokens(bounded: ModelTokenizer, data: st.DataObject) -> None:
    text = data.draw(st.text(max_size=300) | _vocabulary_texts(bounded) | st.text(alphabet=" \n\t", max_size=200))
    assert bounded.min_tokens(text) <= len(bounded.encode(text))


def test_min_tokens_counts_utf8_bytes(tok: ModelTokenizer) -> None:
    assert tok.bytes_per_token is not None
    assert tok.min_tokens("") == 0
    assert tok.min_tokens("a" * tok.bytes_per_token) == 1
    assert tok.min_tokens("a" * tok.bytes_per_token + "a") == 2
    assert tok.min_tokens("日" * tok.bytes_per_token) == 3  # 3 bytes each


def _with(tok: ModelTokenizer, change) -> Tokenizer:
    """The shipped tokenizer with one pipeline step changed."""
    copy = Tokenizer.from_str(tok._tokenizer.to_str())
    change(copy)
    return copy


def test_a_normalizer_that_may_shrink_text_widens_the_bound(tok: ModelTokenizer) -> None:
    def nfkc(t: Tokenizer) -> None:
        t.normalizer = normalizers.NFKC()

    assert tokenizer_module._bytes_per_token(_with(tok, nfkc)) == 12 * 25
    # U+1D400, a bold A (4 bytes), becomes "A": a text of them is 4 times fewer tokens than a byte count says
    shrinking = ModelTokenizer(_with(tok, nfkc), None, {}, tok.info, tok.sample_token_ids(), 12 * 25)
    text = "\U0001d400" * 3000
    assert shrinking.min_tokens(text) <= len(shrinking.encode(text))


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda t: setattr(t, "normalizer", normalizers.Strip()), id="strip"),
        pytest.param(lambda t: setattr(t, "normalizer", normalizers.BertNormalizer()), id="bert"),
        pytest.param(
            lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit()])),
            id="whitespace-removed",
        ),
        pytest.param(lambda t: t.add_tokens([AddedToken("<mask>", lstrip=True)]), id="added-token-lstrip"),
        pytest.param(lambda t: t.add_tokens([AddedToken("<sep>", rstrip=True)]), id="added-token-rstrip"),
    ],
)
def test_a_step_that_may_hide_text_leaves_no_bound(tok: ModelTokenizer, change) -> None:
    assert tokenizer_module._bytes_per_token(_with(tok, change)) is None


def test_models_that_may_cover_any_length_leave_no_bound() -> None:
    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    fused_unk = Tokenizer(models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True))
    assert tokenizer_module._bytes_per_token(word_level) is None
    assert tokenizer_module._bytes_per_token(fused_unk) is None
    assert len(fused_unk.encode("\u00e9" * 1000).ids) == 1  # why: one <unk> for 2000 bytes


def test_byte_fallback_models_are_bounded_by_their_longest_entry() -> None:
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"\u2581hello": 256, "<unk>": 257}
    bpe = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    assert tokenizer_module._bytes_per_token(bpe) == len("\u2581hello".encode())


def _worst_ratio(pairs) -> float:
    return max(len(a.encode()) / len(b.encode()) for a, b in pairs if b)


def test_the_normalizer_factors_cover_every_code_point() -> None:
    """_NORMALIZER_SHRINK against Python's Unicode tables: a normal form shrinks a text at most
    by (one character's mapping) times (a composed character's decomposition)."""
    chars = [chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c < 0xE000]
    nfd = _worst_ratio((c, unicodedata.normalize("NFD", c)) for c in chars)
    nfkd = _worst_ratio((c, unicodedata.normalize("NFKD", c)) for c in chars)
    composition = _worst_ratio((unicodedata.normalize("NFD", c), c) for c in chars)
    lower = _worst_ratio((c, c.lower()) for c in chars)
    factors = tokenizer_module._NORMALIZER_SHRINK
    assert factors["NFD"] >= nfd and factors["NFKD"] >= nfkd and factors["Lowercase"] >= lower
    assert factors["NFC"] >= math.ceil(nfd * composition) and factors["NFKC"] >= math.ceil(nfkd * composition)
