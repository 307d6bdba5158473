"""Ingress-side tokenizer: text and chat messages in, token ids out, and back again.

Design note
-----------
A model directory is read the way Hugging Face lays it out: `tokenizer.json` (the
`tokenizers` pipeline), `tokenizer_config.json` (special tokens, context length, chat
template) and an optional `config.json` (model facts). Both JSON files are decoded into
frozen msgspec Structs, so a malformed field fails at load with the file named, not later.

Chat rendering copies `transformers`' `apply_chat_template`: an
`ImmutableSandboxedEnvironment` with `trim_blocks`/`lstrip_blocks`, a `raise_exception`
global and a `tojson` filter that does not HTML-escape. The rendered text is encoded with
special-token recognition, so `<|im_start|>` becomes its single id; the router's block hashes
are computed over exactly these ids, so they must match what the engine would see.

Streaming detokenization uses `tokenizers.decoders.DecodeStream`, which holds back text
while the tail is an incomplete UTF-8 character. The invariant callers rely on:
`"".join(push(i) for i in ids) + flush() == decode(ids)`; `flush()` is '' unless the
stream stopped in the middle of a character.

A prompt's size bounds its token count from below, so a prompt far past the context is refused
before the seconds its tokenizing would take (`min_tokens`). The bound is exact by construction,
not measured: `bytes_per_token` is an upper bound on the input bytes one token can stand for,
derived at load from what the pipeline does, and `None` (no pre-check) for any step we cannot
bound. Between added tokens, a BPE model's tokens spell the normalized text exactly (a byte-level
token's characters are one byte each, a byte-fallback token `<0xAB>` one byte, other tokens their
UTF-8 bytes or more: `▁` is 3 bytes standing for at most 3), so no token covers more normalized
bytes than the longest vocabulary entry; an added token covers its own content. The normalizer
may shrink text (NFKC maps a 4-byte mathematical letter to one ASCII byte): each step's worst
ratio of input to output bytes multiplies the bound. What could hide text from the model (a
pre-tokenizer that removes whitespace, unknown characters fused into one `<unk>`, an added token
that swallows surrounding spaces, a word-level model) leaves the bound unset.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import jinja2
import jinja2.ext
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, pre_tokenizers

from switchyard.ingress.errors import IngressError

try:
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # tokenizers < 0.21; IncrementalDecoder falls back to re-decoding.
    _DecodeStream = None  # type: ignore[assignment,misc]
# Any: the tests take it away (None) to exercise the fallback.
DecodeStream: Any = _DecodeStream

__all__ = ["IncrementalDecoder", "ModelInfo", "ModelTokenizer", "TokenizerError"]

Message = dict[str, Any]
_T = TypeVar("_T")

# transformers writes int(1e30) when a tokenizer has no real limit; such a value says nothing.
_NO_LIMIT_THRESHOLD = 10**12
_REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(IngressError):
    """A model directory that cannot be used, or a chat template that failed.

    `path` is the offending file when there is one.
    """

    def __init__(self, message: str, *, path: Path | None = None) -> None:
        super().__init__(f"{path}: {message}" if path is not None else message)
        self.path = path


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_context: int
    vocab_size: int
    eos_token_id: int


class _NamedTemplate(msgspec.Struct, frozen=True):
    name: str
    template: str


class _TokenizerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of tokenizer_config.json we use; unknown fields are ignored."""

    # transformers writes a special token either as a string or as a serialized AddedToken.
    eos_token: str | dict[str, Any] | None = None
    bos_token: str | dict[str, Any] | None = None
    pad_token: str | dict[str, Any] | None = None
    model_max_length: int | float | None = None
    chat_template: str | list[_NamedTemplate] | None = None


class _ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of config.json we use; unknown fields are ignored."""

    served_model_name: str | None = None
    max_position_embeddings: int | None = None
    vocab_size: int | None = None
    eos_token_id: int | list[int] | None = None


def _token_text(token: str | dict[str, Any] | None) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _read_tokenizer(path: Path) -> Tokenizer:
    if not path.is_file():
        raise TokenizerError("missing", path=path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception
        raise TokenizerError(f"not a valid tokenizer: {exc}", path=path) from exc


def _read_struct(path: Path, kind: type[_T]) -> _T:
    try:
        return msgspec.json.decode(path.read_bytes(), type=kind)
    except FileNotFoundError as exc:
        raise TokenizerError("missing", path=path) from exc
    except msgspec.DecodeError as exc:
        raise TokenizerError(f"invalid: {exc}", path=path) from exc


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Same as transformers: jinja's built-in tojson HTML-escapes, which would change prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


def _chat_template_source(config: _TokenizerConfig) -> str | None:
    template = config.chat_template
    if isinstance(template, list):  # transformers' named templates; chat uses "default"
        return next((t.template for t in template if t.name == "default"), None)
    return template


def _compile_chat_template(config: _TokenizerConfig, path: Path) -> jinja2.Template | None:
    source = _chat_template_source(config)
    if source is None:
        return None
    try:
        return _chat_environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"chat_template does not compile: {exc}", path=path) from exc


def _ordinary_ids(tokenizer: Tokenizer, path: Path) -> range:
    """The contiguous id range left after trimming special tokens from both ends."""
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    start, stop = 0, tokenizer.get_vocab_size(with_added_tokens=True)
    while start in special:
        start += 1
    while stop - 1 in special:
        stop -= 1
    if any(start <= i < stop for i in special) or start >= stop:
        raise TokenizerError("special tokens are interleaved with ordinary ones", path=path)
    return range(start, stop)


def _max_context(model: _ModelConfig, tok: _TokenizerConfig, model_dir: Path) -> int:
    if model.max_position_embeddings is not None:
        return model.max_position_embeddings
    limit = tok.model_max_length
    if limit is None or limit >= _NO_LIMIT_THRESHOLD:
        raise TokenizerError(
            "no context length: config.json lacks max_position_embeddings and "
            "tokenizer_config.json lacks a real model_max_length",
            path=model_dir,
        )
    return int(limit)


def _eos_token_id(model: _ModelConfig, tok: _TokenizerConfig, tokenizer: Tokenizer, path: Path) -> int:
    if isinstance(model.eos_token_id, int):
        return model.eos_token_id
    if model.eos_token_id:  # a list: generation stops on any; the first is the canonical one
        return model.eos_token_id[0]
    eos = _token_text(tok.eos_token)
    eos_id = tokenizer.token_to_id(eos) if eos is not None else None
    if eos_id is None:
        raise TokenizerError(f"eos_token {eos!r} is not in the vocabulary", path=path)
    return eos_id


def _special_token_strings(config: _TokenizerConfig) -> dict[str, str]:
    """The special tokens a chat template may refer to, as transformers passes them."""
    tokens = {
        "bos_token": _token_text(config.bos_token),
        "eos_token": _token_text(config.eos_token),
        "pad_token": _token_text(config.pad_token),
    }
    return {name: text for name, text in tokens.items() if text is not None}


# How many input bytes one byte of a normalizer's output can stand for, at worst (checked over
# every code point against Python's unicodedata in tests/unit/test_tokenizer.py). A composed
# character's canonical decomposition is at most 3 times its bytes, and a single character
# maps to at least a third (NFD, U+1FEF) or a quarter (NFKD, U+107A5) of its bytes: so NFC is
# bounded by 3 * 3 and NFKC by 4 * 3. Lowercasing: the Kelvin sign (3 bytes) becomes "k".
_NORMALIZER_SHRINK = {"NFD": 3, "NFC": 9, "NFKD": 4, "NFKC": 12, "Lowercase": 3, "Prepend": 1}
# Pre-tokenizers that keep every character; Split and Punctuation unless told to remove matches.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"}


def _shrink(normalizer: dict[str, Any] | None) -> int | None:
    """The most input bytes one normalized byte can come from; None when unbounded."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factors = [_shrink(n) for n in normalizer["normalizers"]]
        return None if None in factors else math.prod(f for f in factors if f is not None)
    if kind == "Replace":  # a plain string replaced by one at least as long shrinks nothing
        pattern = normalizer["pattern"].get("String")
        content = normalizer["content"]
        return 1 if pattern is not None and len(content.encode()) >= len(pattern.encode()) else None
    return _NORMALIZER_SHRINK.get(str(kind))  # Strip, BertNormalizer, a regex... : not bounded


def _keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    if pre_tokenizer.get("type") == "Sequence":
        return all(_keeps_text(p) for p in pre_tokenizer["pretokenizers"])
    return pre_tokenizer.get("type") in _KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def _uses_byte_level(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_uses_byte_level(p) for p in pre_tokenizer["pretokenizers"])
    return pre_tokenizer.get("type") == "ByteLevel"


def _bytes_per_token(tokenizer: Tokenizer) -> int | None:
    """An upper bound on the input bytes one token of ``tokenizer.encode`` covers (module note)."""
    pipeline = json.loads(tokenizer.to_str())
    model = pipeline["model"]
    shrink = _shrink(pipeline.get("normalizer"))
    if model.get("type") != "BPE" or shrink is None or not _keeps_text(pipeline.get("pre_tokenizer")):
        return None
    added = tokenizer.get_added_tokens_decoder().values()
    if any(t.lstrip or t.rstrip for t in added):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    if _uses_byte_level(pipeline.get("pre_tokenizer")):
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        if not alphabet <= vocab.keys():  # a byte missing from the vocabulary would be dropped
            return None
        longest = max(sum(1 if c in alphabet else len(c.encode()) for c in token) for token in vocab)
    elif model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        longest = max(len(token.encode()) for token in vocab)
    else:  # an unknown character would be dropped, or become an <unk> of any length
        return None
    return shrink * max([longest, *(len(t.content.encode()) for t in added)])


class IncrementalDecoder:
    """Turns a stream of token ids into text, one id at a time.

    Holds text back while the decoded tail is an incomplete UTF-8 character, so a client
    never sees a replacement character that the next token would have completed.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if DecodeStream else None
        # Ids pushed since text was last returned: exactly what flush() still owes.
        self._pending: list[int] = []

    def push(self, token_id: int) -> str:
        """The text newly completed by `token_id`; '' while a character is incomplete."""
        self._pending.append(token_id)
        text = self._step(token_id)
        if text:
            self._pending.clear()
        return text

    def flush(self) -> str:
        """What push() held back: replacement characters for a trailing incomplete character.

        Decoding the held ids alone is exact for byte-level tokenizers because text is only
        released at a complete character, where a UTF-8 decoder carries no state. (A
        Metaspace decoder would strip a held leading space; only the last chunk is affected.)
        """
        text = self._decode(self._pending)
        self._pending.clear()
        return text

    def _step(self, token_id: int) -> str:
        if self._stream is not None:
            return self._stream.step(self._tokenizer, token_id) or ""
        text = self._decode(self._pending)
        return "" if text.endswith(_REPLACEMENT_CHAR) else text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)


class ModelTokenizer:
    """The tokenizer, chat template and model facts of one served model."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: jinja2.Template | None,
        special_tokens: dict[str, str],
        info: ModelInfo,
        ordinary_ids: range,
        bytes_per_token: int | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._special_tokens = special_tokens
        self._ordinary_ids = ordinary_ids
        self.info = info
        self.bytes_per_token = bytes_per_token  # see the module note; None: no bound known

    @property
    def template_variables(self) -> frozenset[str]:
        """The variables ``render_chat`` sets from the tokenizer (its special tokens)."""
        return frozenset(self._special_tokens)

    @classmethod
    def load(cls, model_dir: Path) -> ModelTokenizer:
        """Read a Hugging Face style model dir; config.json is optional."""
        model_dir = Path(model_dir)
        tokenizer = _read_tokenizer(model_dir / "tokenizer.json")
        tok_path = model_dir / "tokenizer_config.json"
        tok_config = _read_struct(tok_path, _TokenizerConfig)
        model_path = model_dir / "config.json"
        model_config = _read_struct(model_path, _ModelConfig) if model_path.is_file() else _ModelConfig()
        info = ModelInfo(
            name=model_config.served_model_name or model_dir.resolve().name,
            max_context=_max_context(model_config, tok_config, model_dir),
            vocab_size=model_config.vocab_size or tokenizer.get_vocab_size(with_added_tokens=True),
            eos_token_id=_eos_token_id(model_config, tok_config, tokenizer, tok_path),
        )
        return cls(
            tokenizer,
            _compile_chat_template(tok_config, tok_path),
            _special_token_strings(tok_config),
            info,
            _ordinary_ids(tokenizer, model_dir / "tokenizer.json"),
            _bytes_per_token(tokenizer),
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no BOS/EOS added.

        Special-token text inside `text` is still recognised as the special id, as in
        transformers and vLLM. Through `encode_batch`, which releases the GIL while it works
        (`encode` holds it): the ingress tokenizes in threads, and a prompt of megabytes must
        not stop the event loop's thread for the seconds it takes.
        """
        return self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def min_tokens(self, text: str) -> int:
        """A lower bound of ``len(self.encode(text))``, without tokenizing: ``text``'s UTF-8
        bytes over ``bytes_per_token``, rounded up (0 when no bound is known). Constant time
        for ASCII text, one encoding pass for the rest."""
        if self.bytes_per_token is None:
            return 0
        size = len(text) if text.isascii() else len(text.encode(errors="surrogatepass"))
        return -(-size // self.bytes_per_token)

    def render_chat(
        self,
        messages: Sequence[Message],
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages` (and `tools`, OpenAI's shape, as transformers passes
        them), ending with the assistant's generation prompt; `kwargs`: more template variables
        (a request's ``chat_template_kwargs``), never over the ones set here."""
        if self._chat_template is None:
            raise TokenizerError(f"model {self.info.name!r} has no chat template")
        ours = {"messages": list(messages), "tools": tools, "add_generation_prompt": True, **self._special_tokens}
        try:
            return self._chat_template.render({**(kwargs or {}), **ours})
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        return self.encode(self.render_chat(messages))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def decode_stream(self, *, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """``skip_special_tokens=False`` for a tool-call parser whose markers are special tokens."""
        return IncrementalDecoder(self._tokenizer, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens spelled out (a logprob's ``token``)."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def sample_token_ids(self) -> range:
        """Ids of the ordinary (non-special) tokens, for a simulated engine to draw from."""
        return self._ordinary_ids
