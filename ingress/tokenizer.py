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
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import jinja2
import jinja2.ext
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from switchyard.ingress.errors import IngressError

try:
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # tokenizers < 0.21; IncrementalDecoder falls back to re-decoding.
    _DecodeStream = None  # type: ignore[assignment,misc]
# Any: the tests take it away (None) to exercise the fallback.
DecodeStream: Any = _DecodeStream

__all__ = ["IncrementalDecoder", "ModelInfo", "ModelTokenizer", "TokenizerError"]

Message = dict[str, str]
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


class IncrementalDecoder:
    """Turns a stream of token ids into text, one id at a time.

    Holds text back while the decoded tail is an incomplete UTF-8 character, so a client
    never sees a replacement character that the next token would have completed.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True) if DecodeStream else None
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
        return self._tokenizer.decode(ids, skip_special_tokens=True)


class ModelTokenizer:
    """The tokenizer, chat template and model facts of one served model."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: jinja2.Template | None,
        special_tokens: dict[str, str],
        info: ModelInfo,
        ordinary_ids: range,
    ) -> None:
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._special_tokens = special_tokens
        self._ordinary_ids = ordinary_ids
        self.info = info

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
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no BOS/EOS added.

        Special-token text inside `text` is still recognised as the special id, as in
        transformers and vLLM. Through `encode_batch`, which releases the GIL while it works
        (`encode` holds it): the ingress tokenizes in threads, and a prompt of megabytes must
        not stop the event loop's thread for the seconds it takes.
        """
        return self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def render_chat(self, messages: Sequence[Message]) -> str:
        """The prompt text for `messages`, ending with the assistant's generation prompt."""
        if self._chat_template is None:
            raise TokenizerError(f"model {self.info.name!r} has no chat template")
        try:
            return self._chat_template.render(
                messages=list(messages), add_generation_prompt=True, **self._special_tokens
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        return self.encode(self.render_chat(messages))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def decode_stream(self) -> IncrementalDecoder:
        return IncrementalDecoder(self._tokenizer)

    def sample_token_ids(self) -> range:
        """Ids of the ordinary (non-special) tokens, for a simulated engine to draw from."""
        return self._ordinary_ids
