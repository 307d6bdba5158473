"""The sim engine's structured outputs (workers.sim_structured): every text parses and validates.

Each realistic schema is checked over many keys (hypothesis draws them; a failure prints the
key) with an independent validator, ``jsonschema``'s Draft 2020-12 with its format checker,
plus the formats that checker skips without optional packages (date-time, time).
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.workers.sim_structured import REF_DEPTH, UnsupportedSchema, check_schema, instance_text
from switchyard.workers.sim_structured import __all__ as public_names

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is the independent validator (vLLM pulls it in)")

KEYS = st.integers(min_value=0, max_value=(1 << 64) - 1)

WEATHER = {  # an OpenAI function's parameters, as the docs show them
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}

ORDER = {  # nested objects and arrays of objects through $defs, formats, a nullable field
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "Order",
    "type": "object",
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "minLength": 3, "maxLength": 40},
                "zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
                "country": {"const": "FR"},
            },
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
        "Line": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-\\d{3}$"},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
            },
            "required": ["sku", "quantity", "price"],
        },
    },
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "placed": {"type": "string", "format": "date-time"},
        "deliver_on": {"type": "string", "format": "date"},
        "customer": {"type": "string", "format": "email"},
        "ship_to": {"$ref": "#/$defs/Address"},
        "bill_to": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}], "default": None},
        "lines": {"type": "array", "items": {"$ref": "#/$defs/Line"}, "minItems": 1, "maxItems": 5},
        "note": {"type": ["string", "null"], "maxLength": 20},
        "status": {"enum": ["placed", "paid", "shipped"]},
        "gift": {"type": "boolean"},
    },
    "required": ["id", "ship_to", "lines", "status"],
    "additionalProperties": False,
}

PYDANTIC = {  # what pydantic's model_json_schema() writes for optional fields and a nested model
    "$defs": {
        "Tag": {
            "properties": {"name": {"title": "Name", "type": "string"}, "weight": {"default": 1.0, "type": "number"}},
            "required": ["name"],
            "title": "Tag",
            "type": "object",
        }
    },
    "properties": {
        "title": {"title": "Title", "type": "string"},
        "rating": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "null"}], "default": None},
        "tags": {"items": {"$ref": "#/$defs/Tag"}, "type": "array", "title": "Tags"},
        "source": {"anyOf": [{"type": "string", "format": "uri"}, {"type": "null"}]},
    },
    "required": ["title", "rating", "tags", "source"],
    "title": "Review",
    "type": "object",
}

BOUNDS = {  # integer and number bounds, exclusive ones, and additionalProperties false
    "type": "object",
    "properties": {
        "small": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3},
        "big": {"type": "integer", "minimum": 1_000_000},
        "negative": {"type": "integer", "maximum": -50},
        "fraction": {"type": "number", "minimum": 0.1, "maximum": 0.2},
        "narrow": {"type": "number", "exclusiveMinimum": 0.29, "maximum": 0.3},
        "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "name": {"type": "string", "minLength": 12, "maxLength": 14},
    },
    "required": ["small", "big", "negative", "fraction", "narrow", "ratio", "name"],
    "additionalProperties": False,
}

COMBINED = {  # allOf merged, a oneOf tagged by const, a required name only additionalProperties covers
    "type": "object",
    "allOf": [
        {"properties": {"kind": {"type": "string"}, "at": {"type": "string", "format": "time"}}, "required": ["kind"]},
        {"properties": {"kind": {"enum": ["circle", "square", "other"]}}, "required": ["shape"]},
    ],
    "properties": {
        "shape": {
            "oneOf": [
                {"type": "object", "properties": {"r": {"type": "number", "minimum": 0}}, "required": ["r"]},
                {"type": "object", "properties": {"side": {"type": "integer"}}, "required": ["side"]},
            ]
        },
        "host": {"type": "string", "format": "hostname"},
        "ip": {"type": "string", "format": "ipv4"},
    },
    "required": ["count"],
    "additionalProperties": {"type": ["integer", "string"]},  # also covers kind and at
}

TREE = {  # recursion through definitions: it must end
    "definitions": {
        "node": {
            "type": "object",
            "properties": {
                "label": {"type": "string", "maxLength": 8},
                "children": {"type": "array", "items": {"$ref": "#/definitions/node"}},
                "parent": {"anyOf": [{"$ref": "#/definitions/node"}, {"type": "null"}]},
            },
            "required": ["label", "children", "parent"],
        }
    },
    "$ref": "#/definitions/node",
}


def tool(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [
    tool("get_weather", WEATHER),
    tool("ping", None),
    tool(
        "add_tag",
        {
            "type": "object",
            "properties": {"tag": {"$ref": "#/$defs/Tag"}, "pinned": {"type": "boolean"}},
            "required": ["tag"],
            "$defs": PYDANTIC["$defs"],
        },
    ),
]


def params_or_empty(params: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's _params_or_empty_object: no parameters still means an object."""
    return params if params else {"type": "object", "properties": {}}


def required_tools_schema(tools: list[dict[str, Any]], *, parallel: bool | None = None) -> dict[str, Any]:
    """What vLLM constrains ``tool_choice: required`` to (vllm/tool_parsers/utils.py,
    _get_json_schema_from_tools): an array of {name, parameters}, one branch per tool, with
    every tool's $defs lifted to the top."""
    branches, defs = [], {}
    for entry in tools:
        params = dict(entry["function"]["parameters"] or {})
        defs.update(params.pop("$defs", {}))
        branches.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [entry["function"]["name"]]},
                    "parameters": params_or_empty(params),
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


REQUIRED_TOOLS = required_tools_schema(TOOLS)
REALISTIC = {
    "weather": WEATHER,
    "order": ORDER,
    "pydantic": PYDANTIC,
    "bounds": BOUNDS,
    "combined": COMBINED,
    "tree": TREE,
    "required_tools": REQUIRED_TOOLS,
    "required_tools_single": required_tools_schema(TOOLS, parallel=False),
    "named_tool_without_params": params_or_empty(None),
}


def assert_formats(value: Any) -> None:
    """The formats jsonschema's checker skips without rfc3339-validator: parse them here."""
    if isinstance(value, dict):
        for item in value.values():
            assert_formats(item)
    elif isinstance(value, list):
        for item in value:
            assert_formats(item)
    elif isinstance(value, str) and value.endswith("Z") and value[:2].isdigit():  # date-time or time
        parse = datetime.datetime.fromisoformat if "T" in value else datetime.time.fromisoformat
        assert parse(value.replace("Z", "+00:00")).utcoffset() == datetime.timedelta(0)


def assert_valid(schema: dict[str, Any], text: str) -> Any:
    value = json.loads(text)
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).validate(
        value
    )
    assert_formats(value)
    return value


def depth_of(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    return 0


def test_public_names() -> None:
    assert sorted(public_names) == ["REF_DEPTH", "UnsupportedSchema", "check_schema", "instance_text"]


@pytest.mark.parametrize("name", sorted(REALISTIC))
@settings(max_examples=60, deadline=None)
@given(key=KEYS)
def test_every_text_validates(name: str, key: int) -> None:
    schema = REALISTIC[name]
    check_schema(schema)
    assert_valid(schema, instance_text(schema, key))


@settings(max_examples=60, deadline=None)
@given(key=KEYS)
def test_required_tool_calls_name_a_tool_and_fit_its_parameters(key: int) -> None:
    """The envelope the ingress turns into tool calls: each element one tool, its arguments valid alone."""
    calls = json.loads(instance_text(REQUIRED_TOOLS, key))
    by_name = {entry["function"]["name"]: entry["function"]["parameters"] for entry in TOOLS}
    assert len(calls) >= 1
    for call in calls:
        assert set(call) == {"name", "parameters"}
        params = dict(params_or_empty(by_name[call["name"]]))
        params.setdefault("$defs", REQUIRED_TOOLS.get("$defs", {}))
        jsonschema.Draft202012Validator(params).validate(call["parameters"])


def test_single_tool_call_when_parallel_calls_are_off() -> None:
    schema = required_tools_schema(TOOLS, parallel=False)
    assert all(len(json.loads(instance_text(schema, key))) == 1 for key in range(50))


def test_every_tool_gets_called_across_keys() -> None:
    names = {call["name"] for key in range(100) for call in json.loads(instance_text(REQUIRED_TOOLS, key))}
    assert names == {"get_weather", "ping", "add_tag"}


@settings(max_examples=60, deadline=None)
@given(key=KEYS)
def test_json_object_mode_writes_a_small_object(key: int) -> None:
    value = json.loads(instance_text(None, key))
    assert isinstance(value, dict)
    assert 1 <= len(value) <= 3


@pytest.mark.parametrize("schema", [None, WEATHER, ORDER, TREE, REQUIRED_TOOLS], ids=lambda s: str(bool(s)))
def test_same_key_same_text(schema: dict[str, Any] | None) -> None:
    for key in (0, 1, 2**63, 12345):
        assert instance_text(schema, key) == instance_text(schema, key)


def test_the_text_does_not_depend_on_the_process() -> None:
    """Pinned texts: a prefill and a decode worker, or two runs, must write the very same."""
    assert instance_text(WEATHER, 1) == '{"city": "tango orbit delta", "unit": "celsius"}'
    assert instance_text(WEATHER, 7) == '{"city": "willow"}'
    assert instance_text(None, 1) == '{"nova": false, "delta": 82.85}'


@pytest.mark.parametrize("name", ["weather", "order", "pydantic", "tree", "required_tools"])
def test_keys_give_varied_texts(name: str) -> None:
    texts = {instance_text(REALISTIC[name], key) for key in range(50)}
    assert len(texts) >= 10


def test_enum_values_and_optional_properties_vary() -> None:
    values = [json.loads(instance_text(WEATHER, key)) for key in range(100)]
    assert {v.get("unit") for v in values} == {None, "celsius", "fahrenheit"}


def test_bounds_at_their_edges() -> None:
    for key in range(200):
        value = json.loads(instance_text(BOUNDS, key))
        assert -3 < value["small"] < 3
        assert value["big"] >= 1_000_000
        assert value["negative"] <= -50
        assert 0.29 < value["narrow"] <= 0.3
        assert 12 <= len(value["name"]) <= 14


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "integer", "multipleOf": 3}, "multipleOf"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
        ({"not": {"type": "string"}}, "not"),
        ({"if": {"type": "string"}, "then": {"minLength": 1}}, "if"),
        ({"type": "array", "prefixItems": [{"type": "string"}]}, "prefixItems"),
        ({"type": "array", "items": [{"type": "string"}]}, "items"),
        ({"type": "object", "properties": {"a": {"type": "strng"}}}, "type"),
        ({"type": "string", "format": "ipv6"}, "format"),
        ({"type": "string", "pattern": "^(?=a)a+$"}, "pattern"),
        ({"type": "string", "pattern": "(a)\\1"}, "pattern"),
        ({"type": "string", "pattern": "\\bword"}, "pattern"),
        ({"type": "integer", "minimum": 0, "exclusiveMinimum": True}, "exclusiveMinimum"),
        ({"$ref": "https://example.com/schema.json"}, "$ref"),
        ({"$ref": "#/$defs/missing"}, "$ref"),
        ({"type": "object", "properties": {"deep": {"type": "object", "minProperties": 1}}}, "minProperties"),
    ],
)
def test_unsupported_keywords_are_named(schema: dict[str, Any], keyword: str) -> None:
    with pytest.raises(UnsupportedSchema) as caught:
        check_schema(schema)
    assert caught.value.keyword == keyword
    assert repr(keyword) in str(caught.value)
    with pytest.raises(UnsupportedSchema):
        instance_text(schema, 0)


def test_the_path_points_at_the_keyword() -> None:
    with pytest.raises(UnsupportedSchema) as caught:
        check_schema({"type": "object", "properties": {"deep": {"type": "integer", "multipleOf": 2}}})
    assert caught.value.path == "/properties/deep"
    assert isinstance(caught.value, ValueError)  # the ingress answers it as a 400


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "minLength": 5, "maxLength": 2},
        {"type": "integer", "minimum": 3, "maximum": 2},
        {"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2},
        {"type": "array", "minItems": 3, "maxItems": 1},
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
        {"allOf": [{"enum": [1, 2]}, {"enum": [3]}]},
        {"type": "string", "format": "uuid", "maxLength": 10},
        {"allOf": [{"type": "object", "properties": {"a": {}}, "additionalProperties": False}, {"required": ["b"]}]},
        {
            "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
            "$ref": "#/$defs/a",
        },
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"oneOf": [{"type": "integer"}, {"type": "integer"}]},
    ],
)
def test_schemas_without_an_instance_are_refused(schema: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedSchema):
        instance_text(schema, 0)


def test_recursion_ends_within_the_depth_bound() -> None:
    # Each level of TREE is one reference deeper; past REF_DEPTH only required fields remain,
    # with empty arrays and the null branch: a node of the tree is two JSON levels.
    for key in range(100):
        value = assert_valid(TREE, instance_text(TREE, key))
        assert depth_of(value) <= 2 * (REF_DEPTH + 1) + 1


def test_max_chars_picks_the_minimal_instance() -> None:
    minimal = json.loads(instance_text(ORDER, 3, max_chars=1))
    assert set(minimal) == {"id", "ship_to", "lines", "status"}
    assert set(minimal["ship_to"]) == {"street", "zip"}
    assert len(minimal["lines"]) == 1
    assert minimal["status"] == "placed"
    assert_valid(ORDER, json.dumps(minimal))


def test_max_chars_keeps_a_text_that_fits() -> None:
    for key in range(20):
        text = instance_text(ORDER, key)
        assert instance_text(ORDER, key, max_chars=len(text)) == text


def test_max_chars_shrinks_to_fit_when_it_can() -> None:
    texts = [instance_text(PYDANTIC, key) for key in range(40)]
    budget = min(len(t) for t in texts) + 5
    for key in range(40):
        text = instance_text(PYDANTIC, key, max_chars=budget)
        assert len(text) <= max(budget, len(instance_text(PYDANTIC, key, max_chars=0)))
        assert_valid(PYDANTIC, text)


def test_json_object_mode_minimal_is_an_empty_object() -> None:
    assert instance_text(None, 5, max_chars=0) == "{}"


def test_patterns_are_matched() -> None:
    schema = {"type": "string", "pattern": "^(ab|cd)[x-z]{2,3}\\.[^0-9]+$"}
    texts = {instance_text(schema, key) for key in range(50)}
    assert len(texts) > 10
    for text in texts:
        assert_valid(schema, text)


def test_a_ref_beside_constraints_keeps_both() -> None:
    schema = {"$defs": {"n": {"type": "integer", "minimum": 0}}, "$ref": "#/$defs/n", "maximum": 3}
    assert {json.loads(instance_text(schema, key)) for key in range(60)} <= {0, 1, 2, 3}
