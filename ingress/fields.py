"""Every request field the OpenAI endpoints may receive, and what the ingress does with it.

One table, ``FIELDS``: each OpenAI Chat Completions and Completions field (``openai``'s
``CompletionCreateParams``; ``tests/unit/test_fields.py`` fails when a release adds one) and the
common vLLM extensions, as

- ``supported``: decoded by the Structs of ``ingress.openai_types`` and honoured;
- ``refused``: it would change the output and is not implemented, so a value other than a
  neutral one (its default, or one that asks for nothing: ``tools: []``, ``n: 1``,
  ``logprobs: false``, ``top_k: -1``) is a 400 naming it, never silently ignored;
- ``no_effect``: accepted and ignored because it cannot change the output (``user``,
  ``metadata``, ``store``).

``check_fields`` runs after a body has decoded into its Struct: one more pass reads the
top-level keys with their values left as raw bytes (``msgspec.Raw``, no objects built), and only
a refused field's value is decoded, to test it. A field the table does not know, or knows only
for the other endpoint, is accepted and logged once per name (at most ``UNKNOWN_REMEMBERED``
names per process, so a stream of made-up names cannot grow memory).

Moving a field from refused to supported is one line here plus the code that honours it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from switchyard.ingress.errors import InvalidRequest

log = logging.getLogger(__name__)

Status = Literal["supported", "refused", "no_effect"]
Endpoint = Literal["chat", "completion"]
Neutral = Callable[[object], bool]

CHAT: frozenset[Endpoint] = frozenset({"chat"})
COMPLETION: frozenset[Endpoint] = frozenset({"completion"})
BOTH: frozenset[Endpoint] = CHAT | COMPLETION
UNKNOWN_REMEMBERED = 1000
_NAME_LOGGED_CHARS = 64


def _null(value: object) -> bool:
    return value is None


def _flag(default: bool) -> Neutral:
    return lambda value: value is None or value is default


def _number(neutral: float, *more: float) -> Neutral:
    values = (neutral, *more)
    return lambda value: (
        value is None or (isinstance(value, int | float) and not isinstance(value, bool) and value in values)
    )


def _one_of(*values: object) -> Neutral:
    return lambda value: value is None or any(value == v and type(value) is type(v) for v in values)


def _empty(value: object) -> bool:
    return value is None or value == [] or value == {}


@dataclass(frozen=True, slots=True)
class Field:
    status: Status
    endpoints: frozenset[Endpoint]
    reason: str = ""  # why it is refused, or why it cannot change the output
    neutral: Neutral = _null  # refused fields only: the values that ask for nothing


def _supported(endpoints: frozenset[Endpoint] = BOTH) -> Field:
    return Field("supported", endpoints)


def _refused(reason: str, neutral: Neutral = _null, endpoints: frozenset[Endpoint] = BOTH) -> Field:
    return Field("refused", endpoints, reason, neutral)


def _no_effect(reason: str, endpoints: frozenset[Endpoint] = BOTH) -> Field:
    return Field("no_effect", endpoints, reason)


_FUNCTIONS = "the deprecated functions API is not supported; use tools"
_LOGPROBS = "prompt logprobs are not supported"
_SAMPLING = "this sampling control is not supported"
_MULTIMODAL = "only text content is supported"
_TEMPLATE = "the model's own chat template is applied as is"
_RESPONSE = "the response carries only the standard OpenAI fields"

FIELDS: dict[str, Field] = {
    # --- OpenAI, both endpoints -------------------------------------------------------------
    "model": _supported(),
    "max_tokens": _supported(),
    "stream": _supported(),
    "stream_options": _supported(),
    "stop": _supported(),
    "temperature": _supported(),
    "top_p": _supported(),
    "seed": _supported(),
    "n": _supported(),
    "frequency_penalty": _supported(),
    "presence_penalty": _supported(),
    "logit_bias": _supported(),
    # chat: a boolean; completions: how many alternatives (0 still returns the chosen token's).
    "logprobs": _supported(),
    "user": _no_effect("an end-user id for the caller's own records"),
    # --- OpenAI, chat ---------------------------------------------------------------------------
    "messages": _supported(CHAT),
    "max_completion_tokens": _supported(CHAT),
    "top_logprobs": _supported(CHAT),
    "tools": _supported(CHAT),
    "tool_choice": _supported(CHAT),
    "functions": _refused(_FUNCTIONS, _empty, CHAT),
    "function_call": _refused(_FUNCTIONS, _one_of("none", "auto"), CHAT),
    "parallel_tool_calls": _supported(CHAT),
    "response_format": _supported(),
    "modalities": _refused("only text output is supported", _one_of(["text"]), CHAT),
    "audio": _refused("audio output is not supported", endpoints=CHAT),
    "prediction": _no_effect("a predicted output only speeds up generation; it never changes it", CHAT),
    "reasoning_effort": _supported(CHAT),  # a chat template variable, as vLLM passes it
    "verbosity": _refused(_TEMPLATE, _one_of("medium"), CHAT),
    "web_search_options": _refused("web search is not supported", endpoints=CHAT),
    "moderation": _refused("moderation is not supported", endpoints=CHAT),
    "metadata": _no_effect("tags for stored completions; nothing is stored", CHAT),
    "store": _no_effect("completions are never stored", CHAT),
    "safety_identifier": _no_effect("an end-user id for abuse detection upstream", CHAT),
    "prompt_cache_key": _no_effect("prefix caching is by content, salted per tenant", CHAT),
    "prompt_cache_options": _no_effect("prefix caching is by content, salted per tenant", CHAT),
    "prompt_cache_retention": _no_effect("prefix caching is by content, salted per tenant", CHAT),
    "service_tier": _no_effect("latency and price only; see the x-switchyard-priority header", CHAT),
    # --- OpenAI, completions --------------------------------------------------------------------
    "prompt": _supported(COMPLETION),
    "echo": _refused("echoing the prompt is not supported", _flag(False)),  # vLLM's chat extension too
    "best_of": _refused("only one candidate is generated", _number(1), COMPLETION),
    "suffix": _refused("insertion (suffix) is not supported", _one_of(""), COMPLETION),
    # --- vLLM extensions: sampling --------------------------------------------------------------
    "top_k": _supported(),  # vLLM: 0 or -1 means every token
    "min_p": _supported(),
    "repetition_penalty": _supported(),
    "length_penalty": _refused("beam search is not supported", _number(1)),
    "use_beam_search": _refused("beam search is not supported", _flag(False)),
    "min_tokens": _supported(),
    "ignore_eos": _supported(),
    "stop_token_ids": _supported(),
    "bad_words": _refused(_SAMPLING, _empty),
    "allowed_token_ids": _refused(_SAMPLING),
    "include_stop_str_in_output": _supported(),
    "skip_special_tokens": _refused("special tokens are always skipped", _flag(True)),
    "spaces_between_special_tokens": _refused("special tokens are always skipped", _flag(True)),
    "watermarking": _refused("watermarking is not supported"),
    "repetition_detection": _refused(_SAMPLING),
    "thinking_token_budget": _refused(_TEMPLATE),
    "include_reasoning": _supported(CHAT),  # false needs --reasoning-parser (ingress.reasoning)
    # --- vLLM extensions: structured outputs ----------------------------------------------------
    "structured_outputs": _supported(),
    "guided_json": _supported(),
    "guided_regex": _supported(),
    "guided_choice": _supported(),
    "guided_grammar": _supported(),
    "guided_decoding_backend": _no_effect("the engine's structured-output backend is its own to choose"),
    "guided_whitespace_pattern": _refused("whitespace in structured outputs is the backend's default"),
    # --- vLLM extensions: logprobs and extra response fields ------------------------------------
    "prompt_logprobs": _refused(_LOGPROBS),
    "logprob_token_ids": _refused(_LOGPROBS, _empty),
    "return_tokens_as_token_ids": _refused(_RESPONSE, _flag(False)),
    "return_token_ids": _refused(_RESPONSE, _flag(False)),
    "return_token_offsets": _refused(_RESPONSE, _flag(False)),
    "return_prompt_text": _refused(_RESPONSE, _flag(False), CHAT),
    "return_mm_kwargs": _refused(_RESPONSE, _flag(False)),
    "routed_experts_prompt_start": _refused(_RESPONSE, _number(0)),
    # --- vLLM extensions: the prompt ------------------------------------------------------------
    "add_special_tokens": _refused("prompts are tokenized without added special tokens", _flag(False)),
    "truncate_prompt_tokens": _refused("prompts are never truncated; a long one is a 400"),
    "truncation_side": _no_effect("it only matters with truncate_prompt_tokens, which is refused"),
    "add_generation_prompt": _refused(_TEMPLATE, _flag(True), CHAT),
    "continue_final_message": _refused(_TEMPLATE, _flag(False), CHAT),
    "chat_template": _refused(_TEMPLATE, endpoints=CHAT),
    "chat_template_kwargs": _supported(CHAT),
    "documents": _refused(_TEMPLATE, _empty, CHAT),
    "media_io_kwargs": _refused(_MULTIMODAL, _empty, CHAT),
    "mm_processor_kwargs": _refused(_MULTIMODAL, _empty, CHAT),
    "mm_payload": _refused(_MULTIMODAL, _one_of("tensors")),
    "prompt_embeds": _refused("prompt embeddings are not supported", endpoints=COMPLETION),
    # --- vLLM extensions: serving ---------------------------------------------------------------
    "priority": _no_effect("scheduling only; see the x-switchyard-priority header"),
    "request_id": _no_effect("the ingress names every request itself"),
    "session_id": _no_effect("scheduling only; see the x-session-affinity header"),
    "cache_salt": _no_effect("prefix caches are already salted per tenant (kvbus.keys)"),
    "stream_interval": _no_effect("how tokens are batched into chunks, not which tokens"),
    "kv_transfer_params": _refused("the scheduler places the KV cache itself"),
    "ec_transfer_params": _refused("the scheduler places the KV cache itself"),
    "vllm_xargs": _refused("engine arguments are not passed through", _empty),
}

_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_unknown: set[str] = set()  # names already logged; a race between threads only logs one twice


def check_fields(body: bytes, endpoint: Endpoint) -> None:
    """Refuse a field the table refuses (unless neutral); log one it does not know.

    ``body`` has already decoded into the endpoint's Struct, so it is a JSON object."""
    for name, raw in _KEYS.decode(body).items():
        field = FIELDS.get(name)
        if field is None or endpoint not in field.endpoints:
            _log_unknown(name, endpoint)
        elif field.status == "refused" and not field.neutral(msgspec.json.decode(raw)):
            raise InvalidRequest(
                f"`{name}` is not supported: {field.reason}.", code="unsupported_parameter", param=name
            )


def _log_unknown(name: str, endpoint: Endpoint) -> None:
    name = name[:_NAME_LOGGED_CHARS]
    if name in _unknown or len(_unknown) >= UNKNOWN_REMEMBERED:
        return
    _unknown.add(name)
    log.warning("Ignoring the unknown %s request field %r (logged once per name)", endpoint, name)
