"""A request's sampling, limits and output constraint, as the bus carries them (``SamplingParams``).

What the field types cannot check is checked here, each error a 400 naming its field:
``top_k`` (-1, 0 or positive), ``logit_bias`` keys (token ids of this model), ``stop_token_ids``
(likewise), ``min_tokens`` (at most the tokens asked for), ``top_logprobs`` (only with
``logprobs``), and at most one output constraint.

Output constraints: ``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs`` and its older ``guided_*`` fields, and a tool call that ``tool_choice``
forces (``ingress.tool_calls`` builds its schema). Each becomes one ``StructuredOutput``,
enforced by the engine's grammar backend. Disaggregation decides where token 0 is sampled: a
grammar's state cannot be handed from the prefill engine to the decode engine, so a constrained
request's prefill only computes the prompt's KV, and the decode engine samples every token with
the grammar whole (``SamplingParams.decode_samples_first``; docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from switchyard.ingress.errors import InvalidRequest
from switchyard.ingress.openai_types import ChatCompletionRequest, CompletionRequest
from switchyard.schemas import SamplingParams, StructuredOutput

MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_SCHEMA_BYTES = 64 * 1024


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    vocab_size: int,
    forced: StructuredOutput | None = None,
) -> SamplingParams:
    """``forced``: the constraint a forced tool call puts on the output (none with it may be given)."""
    top_k = 0 if body.top_k is None or body.top_k == -1 else body.top_k
    if top_k < 0:
        raise InvalidRequest("`top_k` must be -1 or 0 (every token) or a positive count.", param="top_k")
    if body.min_tokens > max_tokens:
        raise InvalidRequest(
            f"`min_tokens` ({body.min_tokens}) is more than the {max_tokens} tokens asked for.", param="min_tokens"
        )
    structured = _structured(body)
    if forced is not None:
        if structured is not None:
            raise InvalidRequest("A forced tool call cannot also have an output format.", param="tool_choice")
        structured = forced
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        top_k=top_k,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias, vocab_size),
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        stop_token_ids=_stop_token_ids(body.stop_token_ids, vocab_size),
        logprobs=_logprobs(body),
        structured=structured,
        n=body.n,
    )


def _logprobs(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if not body.logprobs:
        if body.top_logprobs:
            raise InvalidRequest("`top_logprobs` needs `logprobs` set to true.", param="top_logprobs")
        return None
    return body.top_logprobs or 0


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"`logit_bias` may hold at most {MAX_LOGIT_BIAS} tokens.", param="logit_bias")
    out = {}
    for key, value in bias.items():
        token = int(key) if key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"`logit_bias` keys must be token ids in [0, {vocab_size}), got {key[:32]!r}.", param="logit_bias"
            )
        out[token] = value
    return out


def _stop_token_ids(ids: list[int] | None, vocab_size: int) -> list[int]:
    if not ids:
        return []
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"At most {MAX_STOP_TOKEN_IDS} `stop_token_ids` are allowed.", param="stop_token_ids")
    if not all(0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"`stop_token_ids` must be token ids in [0, {vocab_size}).", param="stop_token_ids")
    return sorted(set(ids))


def _structured(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    """The one output constraint the request gives, if any."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", StructuredOutput(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequest(
                "`response_format` of type json_schema needs its `json_schema`.", param="response_format"
            )
        schema = fmt.json_schema.schema if fmt.json_schema.schema is not None else {"type": "object"}
        found.append(("response_format", StructuredOutput(json_schema=schema_text(schema, "response_format"))))
    so = body.structured_outputs
    if so is not None:
        given = [so.json is not None, bool(so.json_object), so.regex is not None, so.choice is not None]
        if so.grammar is not None:
            given.append(True)
        if sum(given) != 1:
            raise InvalidRequest(
                "`structured_outputs` takes exactly one of json, json_object, regex, choice, grammar.",
                param="structured_outputs",
            )
        found.append(("structured_outputs", _constraint(so.json, so.json_object, so.regex, so.choice, so.grammar)))
    guided: list[tuple[str, Any, Callable[[Any], StructuredOutput]]] = [
        ("guided_json", body.guided_json, lambda v: _constraint(json=v)),
        ("guided_regex", body.guided_regex, lambda v: _constraint(regex=v)),
        ("guided_choice", body.guided_choice, lambda v: _constraint(choice=v)),
        ("guided_grammar", body.guided_grammar, lambda v: _constraint(grammar=v)),
    ]
    found += [(name, make(value)) for name, value, make in guided if value is not None]
    if len(found) > 1:
        names = ", ".join(f"`{name}`" for name, _ in found)
        raise InvalidRequest(f"Give one output constraint, not several: {names}.", param=found[1][0])
    return found[0][1] if found else None


def _constraint(
    json: dict[str, Any] | str | None = None,
    json_object: bool | None = None,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
) -> StructuredOutput:
    if json is not None:
        return StructuredOutput(json_schema=schema_text(json, "structured_outputs"))
    if choice is not None and not choice:
        raise InvalidRequest("A choice constraint needs at least one choice.", param="structured_outputs")
    return StructuredOutput(json_object=bool(json_object), regex=regex, choice=choice, grammar=grammar)


def schema_text(schema: dict[str, Any] | str, param: str) -> str:
    """A JSON Schema as the bus carries it (JSON text), checked to be a JSON object."""
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)
        except msgspec.DecodeError:
            raise InvalidRequest("The JSON schema is not valid JSON.", param=param) from None
    if not isinstance(schema, dict):
        raise InvalidRequest("A JSON schema must be a JSON object.", param=param)
    text = msgspec.json.encode(schema).decode()
    if len(text) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(f"The JSON schema is over {MAX_SCHEMA_BYTES} bytes.", param=param)
    return text
