"""Structured outputs on the ``sim`` engine: a JSON instance of a schema, from an integer key.

The real engine honours ``response_format`` (``json_object``, ``json_schema``) and forced tool
calls (``tool_choice: required`` or a named function) with vLLM's grammar backend. The sim
engine has no model to constrain, so this module is its honest stand-in: it writes, as a pure
function of (schema, key), a JSON text that parses and validates against the schema. What is
tested through it is the fabric (ingress, bus, tool-call assembly), never the model.

Determinism: the only randomness is a splitmix64 stream seeded by ``key`` (the sim's sampling
key), so the same (schema, key) gives the same text on every worker, process and Python
version; different keys pick different branches, optional properties, lengths and values.

The text is ``json.dumps(value, separators=(", ", ": "))``: one line, ASCII, with the spaces a
model usually writes. Strings are short lower-case ASCII words, numbers small.

The subset of JSON Schema honoured (anything else is ``UnsupportedSchema``, naming the
keyword, so the caller answers a clear 400 rather than output that does not validate):

- ``type`` (one name or a list), ``enum``, ``const``;
- objects: ``properties``, ``required`` (always present), ``additionalProperties`` (no extra
  property is ever written, so ``false`` holds; a required name outside ``properties`` takes
  its value from an ``additionalProperties`` schema);
- arrays: ``items`` (one schema), ``minItems``, ``maxItems``;
- strings: ``minLength``, ``maxLength``, ``format`` (date, date-time, time, email, uuid, uri,
  hostname, ipv4), ``pattern`` when it is a plain regular expression: literals, classes,
  ``.``, ``\\d \\w \\s``, groups, ``|``, quantifiers, ``^``/``$`` at the ends (no
  look-around, back-references or word boundaries);
- numbers: ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum`` (numbers,
  not draft 4's booleans);
- ``anyOf`` (one branch), ``oneOf`` (one branch, checked to match no other), ``allOf``
  (merged: types, enums and bounds intersected, properties combined), each beside sibling
  keywords;
- ``$ref`` to a JSON pointer in the same document (``#/$defs/...``, ``#/definitions/...``,
  ``#``). Beyond ``REF_DEPTH`` references deep, the smallest instance is written (no optional
  property, ``minItems`` items, branches without a reference first), so recursion ends;
- annotations are ignored: ``title``, ``description``, ``default``, ``examples``,
  ``$schema``, ``$id``, ``$comment``, ``deprecated``, ``readOnly``, ``writeOnly``, and
  OpenAPI's ``nullable`` (which only ever widens what is valid).

A schema with no instance this module can find (``minLength`` above ``maxLength``, an empty
enum intersection, recursion that never ends) is ``UnsupportedSchema`` too.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from switchyard.workers.errors import WorkerError

__all__ = ["REF_DEPTH", "UnsupportedSchema", "check_schema", "instance_text"]

Schema = Mapping[str, Any]

REF_DEPTH = 4
"""References followed on one path before the instance is kept minimal."""

_ONE_OF_ROUNDS = 4  # draws per oneOf branch before it counts as covered by the others
_REF_LIMIT = REF_DEPTH + 32  # a path this deep in references has no finite instance
_MASK = (1 << 64) - 1

_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "nullable",
    }
)
_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")  # cheapest first
_INFER = (  # with no ``type``, the keywords say which kind is meant
    ("object", ("properties", "required", "additionalProperties")),
    ("array", ("items", "minItems", "maxItems")),
    ("string", ("minLength", "maxLength", "pattern", "format")),
    ("number", ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")),
)
_WORDS = (
    "alpha", "bravo", "cedar", "delta", "ember", "fjord", "gamma", "harbor", "indigo", "juniper",
    "kilo", "lumen", "maple", "nova", "orbit", "pixel", "quartz", "river", "sierra", "tango",
    "umber", "vivid", "willow", "xenon", "yonder", "zephyr",
)  # fmt: skip


class UnsupportedSchema(WorkerError, ValueError):
    """The schema asks for something the sim engine cannot honour.

    ``keyword`` names the keyword at fault, ``path`` is a JSON pointer to the schema object
    that holds it, ``reason`` says what is wrong.
    """

    def __init__(self, keyword: str, path: str, reason: str) -> None:
        self.keyword = keyword
        self.path = path
        self.reason = reason
        super().__init__(f"schema keyword {keyword!r} at {path or '#'}: {reason}")


class _NoInstance(WorkerError):
    """This branch of the schema has no instance: the caller tries another or gives up."""

    def __init__(self, keyword: str, path: str, reason: str) -> None:
        super().__init__(reason)
        self.keyword = keyword
        self.path = path
        self.reason = reason


def instance_text(schema: Schema | None, key: int, *, max_chars: int | None = None) -> str:
    """A JSON text valid against ``schema``, a pure function of (schema, key).

    ``schema=None`` is ``json_object`` mode: a small object with a few keys. With ``max_chars``,
    a text longer than that is written again as the minimal instance (no optional property,
    ``minItems`` items, one short word per string); if even that is longer, it is returned all
    the same and the caller decides (a sim that truncates would emit invalid JSON).
    """
    if schema is not None:
        check_schema(schema)
    text = _render(schema, key, lean=False)
    if max_chars is not None and len(text) > max_chars:
        try:
            text = _render(schema, key, lean=True)
        except UnsupportedSchema:
            pass  # the minimal choices fell where oneOf branches overlap: keep the full text
    return text


def check_schema(schema: Schema) -> None:
    """Raise ``UnsupportedSchema`` if ``schema`` leaves the subset this module honours."""
    if not isinstance(schema, Mapping):
        raise UnsupportedSchema("type", "", "a schema must be a JSON object")
    _Checker(schema).node(schema, "")


def _render(schema: Schema | None, key: int, *, lean: bool) -> str:
    rng = _Rng(key)
    if schema is None:
        value: Any = _Generator({}, rng, lean=lean).free_object("")
    else:
        generator = _Generator(schema, rng, lean=lean)
        try:
            value = generator.value(schema, "", 0)
        except _NoInstance as e:
            raise UnsupportedSchema(e.keyword, e.path, f"no instance found: {e.reason}") from None
        assert _Validator(schema).valid(schema, value), value  # the whole point of the module
    return json.dumps(value, separators=(", ", ": "))


class _Rng:
    """splitmix64: tiny, seedable by any integer, and the same stream on every platform."""

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK

    def next(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK
        x = self._state
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        return x ^ (x >> 31)

    def below(self, n: int) -> int:
        """0 <= result < n (n >= 1); the modulo bias is immaterial here."""
        return self.next() % n

    def between(self, lo: int, hi: int) -> int:
        return lo + self.below(hi - lo + 1)

    def chance(self, p: float) -> bool:
        return self.next() < p * (1 << 64)

    def pick(self, options: Sequence[Any]) -> Any:
        return options[self.below(len(options))]

    def order(self, n: int) -> list[int]:
        """A shuffled ``range(n)``."""
        out = list(range(n))
        for i in range(n - 1, 0, -1):
            j = self.below(i + 1)
            out[i], out[j] = out[j], out[i]
        return out


# --- references ---------------------------------------------------------------------------


def _resolve(root: Schema, ref: str, path: str) -> Any:
    """The schema a same-document ``$ref`` points to."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise UnsupportedSchema("$ref", path, f"only references within the schema (#/...), not {ref!r}")
    target: Any = root
    for raw in ref[2:].split("/") if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(target, Mapping) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            raise UnsupportedSchema("$ref", path, f"{ref!r} points nowhere")
    if not isinstance(target, (Mapping, bool)):
        raise UnsupportedSchema("$ref", path, f"{ref!r} is not a schema")
    return target


def _follow(root: Schema, node: Any, path: str) -> tuple[Any, int]:
    """``node`` with its chain of bare references followed; and how many were followed.

    A reference beside constraining keywords becomes an ``allOf`` of the target and them.
    """
    seen: set[str] = set()
    while isinstance(node, Mapping) and "$ref" in node:
        ref = node["$ref"]
        if ref in seen:
            raise UnsupportedSchema("$ref", path, f"{ref!r} refers only to itself")
        seen.add(ref)
        target = _resolve(root, ref, path)
        siblings = {k: v for k, v in node.items() if k != "$ref" and k not in _ANNOTATIONS}
        node = {"allOf": [target, siblings]} if siblings else target
    return node, len(seen)


# --- checking -----------------------------------------------------------------------------


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _schema_list(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0


class _Checker:
    """Walks a schema once, without following references, and refuses what is outside the subset."""

    def __init__(self, root: Schema) -> None:
        self.root = root

    def node(self, node: Any, path: str) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, Mapping):
            raise UnsupportedSchema("type", path, "a schema must be a JSON object or a boolean")
        for keyword, value in node.items():
            if keyword in _ANNOTATIONS:
                continue
            check = _CHECKS.get(keyword)
            if check is None:
                raise UnsupportedSchema(keyword, path, "not supported by the sim engine's structured outputs")
            check(self, value, path, keyword)

    def _fail(self, path: str, keyword: str, reason: str) -> NoReturn:
        raise UnsupportedSchema(keyword, path, reason)

    def type_(self, value: Any, path: str, keyword: str) -> None:
        names = value if isinstance(value, list) else [value]
        if not names or any(name not in _TYPES for name in names):
            self._fail(path, keyword, f"{value!r} is not a JSON type or a list of them")

    def properties(self, value: Any, path: str, keyword: str) -> None:
        if not isinstance(value, Mapping):
            self._fail(path, keyword, "must map names to schemas")
        for name, sub in value.items():
            self.node(sub, f"{path}/{keyword}/{name}")

    def required(self, value: Any, path: str, keyword: str) -> None:
        if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
            self._fail(path, keyword, "must be a list of property names")

    def subschema(self, value: Any, path: str, keyword: str) -> None:
        if isinstance(value, list):
            self._fail(path, keyword, "tuple form (a list of schemas) is not supported")
        self.node(value, f"{path}/{keyword}")

    def branches(self, value: Any, path: str, keyword: str) -> None:
        if not _schema_list(value):
            self._fail(path, keyword, "must be a non-empty list of schemas")
        for i, sub in enumerate(value):
            self.node(sub, f"{path}/{keyword}/{i}")

    def enum(self, value: Any, path: str, keyword: str) -> None:
        if not _schema_list(value):
            self._fail(path, keyword, "must be a non-empty list")

    def const(self, value: Any, path: str, keyword: str) -> None:
        pass  # any JSON value

    def count(self, value: Any, path: str, keyword: str) -> None:
        if not _count(value):
            self._fail(path, keyword, "must be a non-negative integer")

    def bound(self, value: Any, path: str, keyword: str) -> None:
        if not _number(value) or not math.isfinite(value):
            self._fail(path, keyword, "must be a finite number (draft 4's boolean form is not supported)")

    def pattern(self, value: Any, path: str, keyword: str) -> None:
        if not isinstance(value, str):
            self._fail(path, keyword, "must be a string")
        _Pattern.parse(value, path)

    def format_(self, value: Any, path: str, keyword: str) -> None:
        if value not in _FORMATS:
            self._fail(path, keyword, f"format {value!r} is not one of {', '.join(sorted(_FORMATS))}")

    def ref(self, value: Any, path: str, keyword: str) -> None:
        _resolve(self.root, value, path)

    def defs(self, value: Any, path: str, keyword: str) -> None:
        self.properties(value, path, keyword)


_CHECKS: dict[str, Callable[[_Checker, Any, str, str], None]] = {
    "type": _Checker.type_,
    "properties": _Checker.properties,
    "required": _Checker.required,
    "additionalProperties": _Checker.subschema,
    "items": _Checker.subschema,
    "anyOf": _Checker.branches,
    "oneOf": _Checker.branches,
    "allOf": _Checker.branches,
    "enum": _Checker.enum,
    "const": _Checker.const,
    "minItems": _Checker.count,
    "maxItems": _Checker.count,
    "minLength": _Checker.count,
    "maxLength": _Checker.count,
    "minimum": _Checker.bound,
    "maximum": _Checker.bound,
    "exclusiveMinimum": _Checker.bound,
    "exclusiveMaximum": _Checker.bound,
    "pattern": _Checker.pattern,
    "format": _Checker.format_,
    "$ref": _Checker.ref,
    "$defs": _Checker.defs,
    "definitions": _Checker.defs,
}


# --- validating (the subset's semantics, for oneOf, enum filtering and the final check) ----


def _json_equal(a: Any, b: Any) -> bool:
    """JSON equality: 1 equals 1.0, but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if _number(a) and _number(b):
        return bool(a == b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def _is_type(name: str, value: Any) -> bool:
    match name:
        case "null":
            return value is None
        case "boolean":
            return isinstance(value, bool)
        case "integer":
            return _number(value) and float(value).is_integer()
        case "number":
            return _number(value)
        case "string":
            return isinstance(value, str)
        case "array":
            return isinstance(value, list)
        case _:
            return isinstance(value, dict)


class _Validator:
    def __init__(self, root: Schema) -> None:
        self.root = root

    def valid(self, node: Any, value: Any) -> bool:
        node, _ = _follow(self.root, node, "")
        if isinstance(node, bool):
            return node
        return (
            self._kind(node, value)
            and self._combinators(node, value)
            and self._object(node, value)
            and self._array(node, value)
            and self.string_ok(node, value)
            and self.numeric_ok(node, value)
        )

    def _kind(self, node: Schema, value: Any) -> bool:
        names = node.get("type", list(_TYPES))
        names = names if isinstance(names, list) else [names]
        return (
            any(_is_type(name, value) for name in names)
            and ("enum" not in node or any(_json_equal(value, e) for e in node["enum"]))
            and ("const" not in node or _json_equal(value, node["const"]))
        )

    def _combinators(self, node: Schema, value: Any) -> bool:
        return (
            all(self.valid(sub, value) for sub in node.get("allOf", []))
            and ("anyOf" not in node or any(self.valid(sub, value) for sub in node["anyOf"]))
            and ("oneOf" not in node or sum(self.valid(sub, value) for sub in node["oneOf"]) == 1)
        )

    def _object(self, node: Schema, value: Any) -> bool:
        if not isinstance(value, dict):
            return True
        properties = node.get("properties", {})
        extra = node.get("additionalProperties", True)
        return all(name in value for name in node.get("required", [])) and all(
            self.valid(properties[name] if name in properties else extra, item) for name, item in value.items()
        )

    def _array(self, node: Schema, value: Any) -> bool:
        if not isinstance(value, list):
            return True
        return node.get("minItems", 0) <= len(value) <= node.get("maxItems", len(value)) and all(
            self.valid(node.get("items", True), item) for item in value
        )

    def string_ok(self, node: Schema, value: Any) -> bool:
        if not isinstance(value, str):
            return True
        pattern = node.get("pattern")
        return node.get("minLength", 0) <= len(value) <= node.get("maxLength", len(value)) and (
            pattern is None or re.search(pattern, value) is not None
        )

    def numeric_ok(self, node: Schema, value: Any) -> bool:
        if not _number(value):
            return True
        return (
            value >= node.get("minimum", value)
            and value <= node.get("maximum", value)
            and ("exclusiveMinimum" not in node or value > node["exclusiveMinimum"])
            and ("exclusiveMaximum" not in node or value < node["exclusiveMaximum"])
        )


# --- merging (allOf, and a chosen branch with its siblings) --------------------------------


def _type_set(node: Schema) -> set[str]:
    names = node.get("type", list(_TYPES))
    return set(names if isinstance(names, list) else [names])


def _meet_types(a: Schema, b: Schema, path: str) -> list[str]:
    left, right = _type_set(a), _type_set(b)
    both = left & right
    if ("integer" in left and "number" in right) or ("number" in left and "integer" in right):
        both.add("integer")  # every integer is a number
    if not both:
        raise _NoInstance("type", path, f"types {sorted(left)} and {sorted(right)} do not meet")
    return [name for name in _TYPES if name in both]


def _as_part(value: Any) -> Any:
    """What ``additionalProperties`` says of a name it covers: None when it says nothing."""
    return None if value is True else value


def _meet_properties(a: Schema, b: Schema, out: dict[str, Any], path: str) -> None:
    """Properties both sides allow; a name one side forbids (its additionalProperties false) is dropped."""
    ours, theirs = a.get("properties", {}), b.get("properties", {})
    our_extra, their_extra = a.get("additionalProperties", True), b.get("additionalProperties", True)
    merged: dict[str, Any] = {}
    for name in [*ours, *(n for n in theirs if n not in ours)]:
        parts = [ours[name] if name in ours else _as_part(our_extra)]
        parts.append(theirs[name] if name in theirs else _as_part(their_extra))
        if False in parts:
            continue  # never written; if required, the object has no instance
        present = [part for part in parts if part is not None]
        merged[name] = present[0] if len(present) == 1 else {"allOf": present}
    if "properties" in a or "properties" in b:
        out["properties"] = merged
    extras = [extra for extra in (_as_part(our_extra), _as_part(their_extra)) if extra is not None]
    out.pop("additionalProperties", None)
    if False in extras:
        out["additionalProperties"] = False
    elif extras:
        out["additionalProperties"] = extras[0] if len(extras) == 1 else {"allOf": extras}


def _merge(a: Schema, b: Schema, path: str) -> dict[str, Any]:
    """One schema whose instances are valid against both ``a`` and ``b`` (no ``$ref``/``allOf`` at top).

    Subschemas are combined lazily (``{"allOf": [x, y]}``), so recursive schemas merge in
    finite time.
    """
    out = {k: v for k, v in a.items() if k not in _ANNOTATIONS}
    for keyword, theirs in b.items():
        if keyword in _ANNOTATIONS or keyword in ("properties", "additionalProperties"):  # below
            continue
        out[keyword] = theirs if keyword not in out else _meet(keyword, out[keyword], theirs, a, b, path)
    _meet_properties(a, b, out, path)
    return out


def _meet(keyword: str, ours: Any, theirs: Any, a: Schema, b: Schema, path: str) -> Any:
    match keyword:
        case "type":
            return _meet_types(a, b, path)
        case "enum":
            both = [value for value in ours if any(_json_equal(value, other) for other in theirs)]
            if not both:
                raise _NoInstance("enum", path, "the enums share no value")
            return both
        case "const" if not _json_equal(ours, theirs):
            raise _NoInstance("const", path, "two different constants")
        case "required":
            return [*ours, *(name for name in theirs if name not in ours)]
        case "items":
            return {"allOf": [ours, theirs]}
        case "anyOf":
            return [{"allOf": [x, y]} for x in ours for y in theirs]
        case "minItems" | "minLength" | "minimum" | "exclusiveMinimum":
            return max(ours, theirs)
        case "maxItems" | "maxLength" | "maximum" | "exclusiveMaximum":
            return min(ours, theirs)
        case "oneOf" | "pattern" | "format" if ours != theirs:
            raise UnsupportedSchema("allOf", path, f"two different {keyword!r} in the branches of one allOf")
        case "$defs" | "definitions":
            return ours  # only ever reached through references into the root
    return ours


# --- strings ------------------------------------------------------------------------------

_PRINTABLE = "".join(chr(c) for c in range(32, 127))
_DIGITS = "0123456789"
_WORD_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"
_CLASSES = {"d": _DIGITS, "w": _WORD_CHARS, "s": " "}
_SPECIAL = set("^$\\.*+?()[]{}|")

# A pattern, parsed: alternatives of sequences of (atom, fewest, most); an atom is the
# characters it may be (a str) or a nested pattern (a list of alternatives).
_Alternatives = list[list[tuple[Any, int, int]]]


class _Pattern:
    """The plain regular expressions ``pattern`` may hold: parsed once, sampled per key."""

    def __init__(self, text: str, path: str) -> None:
        self.text, self.path, self.pos = text, path, 0

    @classmethod
    def parse(cls, text: str, path: str) -> _Alternatives:
        try:
            re.compile(text)
        except re.error as e:
            raise UnsupportedSchema("pattern", path, f"{text!r} is not a regular expression: {e}") from None
        body = text[1:] if text.startswith("^") else text
        if body.endswith("$") and not body.endswith("\\$"):
            body = body[:-1]
        parser = cls(body, path)
        tree = parser.alternatives()
        if parser.pos != len(body):
            parser.fail("an unbalanced ')'")
        return tree

    def fail(self, what: str) -> NoReturn:
        raise UnsupportedSchema("pattern", self.path, f"{self.text!r} uses {what}, beyond the sim's plain patterns")

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def take(self) -> str:
        char = self.peek()
        self.pos += 1
        return char

    def alternatives(self) -> _Alternatives:
        options = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.sequence())
        return options

    def sequence(self) -> list[tuple[Any, int, int]]:
        items: list[tuple[Any, int, int]] = []
        while self.peek() not in ("", "|", ")"):
            atom = self.atom()
            items.append((atom, *self.quantifier()))
        return items

    def atom(self) -> Any:
        char = self.take()
        if char == "(":
            if self.text.startswith("?:", self.pos):
                self.pos += 2
            elif self.peek() == "?":
                self.fail("a look-around or named group")
            inner = self.alternatives()
            if self.take() != ")":
                self.fail("an unclosed group")
            return inner
        if char == "[":
            return self.char_class()
        if char == "\\":
            return self.escape(in_class=False)
        if char == ".":
            return _WORD_CHARS
        if char in ("^", "$"):
            self.fail("an anchor inside the pattern")
        if char in "*+?{":
            self.fail(f"a quantifier {char!r} with nothing before it")
        return char

    def escape(self, *, in_class: bool) -> str:
        char = self.take()
        if char.lower() in _CLASSES:
            chars = _CLASSES[char.lower()]
            return chars if char.islower() else "".join(c for c in _PRINTABLE if c not in chars)
        if char in _SPECIAL or char in "-/ ,:;'\"#%&=!<>@~`" or (in_class and char == "]"):
            return char
        if char == "n":
            return "\n"
        if char == "t":
            return "\t"
        self.fail(f"the escape \\{char}")

    def char_class(self) -> str:
        negated = self.peek() == "^"
        self.pos += negated
        chars: list[str] = []
        first = True
        while (char := self.take()) != "]" or first:
            first = False
            if char == "":
                self.fail("an unclosed character class")
            single = self.escape(in_class=True) if char == "\\" else char
            if len(single) == 1 and self.peek() == "-" and self.text[self.pos + 1 : self.pos + 2] not in ("]", ""):
                self.pos += 1
                end = self.take()
                end = self.escape(in_class=True) if end == "\\" else end
                if len(end) != 1 or end < single:
                    self.fail("a bad range in a character class")
                single = "".join(chr(c) for c in range(ord(single), ord(end) + 1))
            chars.append(single)
        members = "".join(dict.fromkeys("".join(chars)))
        if negated:
            members = "".join(c for c in _WORD_CHARS + _PRINTABLE if c not in members)
            members = "".join(dict.fromkeys(members))
        if not members:
            self.fail("an empty character class")
        return members

    def quantifier(self) -> tuple[int, int]:
        char = self.peek()
        bounds = {"*": (0, -1), "+": (1, -1), "?": (0, 1)}.get(char)
        if bounds is not None:
            self.pos += 1
        elif char == "{":
            end = self.text.find("}", self.pos)
            found = re.fullmatch(r"(\d+)(,(\d*))?", self.text[self.pos + 1 : end]) if end > 0 else None
            if found is None:
                self.fail("a brace that is no quantifier")
            self.pos = end + 1
            fewest = int(found[1])
            most = fewest if found[2] is None else int(found[3]) if found[3] else -1
            bounds = (fewest, most)
        else:
            return 1, 1
        if self.peek() in ("?", "+"):
            self.pos += 1  # lazy or possessive: the same strings match
        return bounds


def _sample_pattern(tree: _Alternatives, rng: _Rng, lean: bool) -> str:
    sequence = tree[0] if lean else rng.pick(tree)
    out: list[str] = []
    for atom, fewest, most in sequence:
        top = fewest + 3 if most < 0 else most
        for _ in range(fewest if lean else rng.between(fewest, max(fewest, top))):
            out.append(rng.pick(atom) if isinstance(atom, str) else _sample_pattern(atom, rng, lean))
    return "".join(out)


def _word(rng: _Rng) -> str:
    return str(rng.pick(_WORDS))


def _uuid(rng: _Rng) -> str:
    digits = f"{rng.next():016x}{rng.next():016x}"
    digits = digits[:12] + "4" + digits[13:16] + "89ab"[rng.below(4)] + digits[17:]  # version 4, RFC variant
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


def _date(rng: _Rng) -> str:
    return f"{rng.between(2020, 2026)}-{rng.between(1, 12):02d}-{rng.between(1, 28):02d}"


def _time(rng: _Rng) -> str:
    return f"{rng.between(0, 23):02d}:{rng.between(0, 59):02d}:{rng.between(0, 59):02d}Z"


_FORMATS: dict[str, Callable[[_Rng], str]] = {
    "date": _date,
    "time": _time,
    "date-time": lambda rng: f"{_date(rng)}T{_time(rng)}",
    "email": lambda rng: f"{_word(rng)}.{_word(rng)}@example.com",
    "uuid": _uuid,
    "uri": lambda rng: f"https://example.com/{_word(rng)}",
    "hostname": lambda rng: f"{_word(rng)}.example.com",
    "ipv4": lambda rng: f"10.{rng.below(256)}.{rng.below(256)}.{rng.between(1, 254)}",
}


# --- generating ---------------------------------------------------------------------------


def _has_ref(node: Any) -> bool:
    """Whether a reference lies anywhere inside ``node`` (minimal mode tries such branches last)."""
    if isinstance(node, Mapping):
        return "$ref" in node or any(_has_ref(v) for k, v in node.items() if k not in ("const", "enum"))
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    return False


def _integer_bounds(node: Schema) -> tuple[int | None, int | None]:
    lows = [math.ceil(node["minimum"])] if "minimum" in node else []
    lows += [math.floor(node["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in node else []
    highs = [math.floor(node["maximum"])] if "maximum" in node else []
    highs += [math.ceil(node["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in node else []
    return (max(lows) if lows else None), (min(highs) if highs else None)


def _small_between(rng: _Rng, lo: int | None, hi: int | None, span: int) -> int:
    """An integer in [lo, hi] (None: open), near zero when the range allows it."""
    if lo is None and hi is None:
        lo, hi = 0, span
    elif lo is None:
        assert hi is not None
        lo = min(hi, 0) if hi >= 0 else hi - span
    elif hi is None:
        hi = lo + span
    near_lo = max(lo, -span // 10) if lo <= 0 <= hi else lo
    return rng.between(near_lo, min(hi, near_lo + span))


class _Generator:
    """Writes one instance; every choice draws from ``rng``, and ``lean`` keeps it minimal."""

    def __init__(self, root: Schema, rng: _Rng, *, lean: bool) -> None:
        self.root, self.rng, self.lean = root, rng, lean
        self.validator = _Validator(root)

    def value(self, node: Any, path: str, depth: int) -> Any:
        node, depth = self._flatten(node, path, depth)
        if "anyOf" in node or "oneOf" in node:
            return self._branch(node, path, depth)
        if "const" in node:
            return self._checked(node["const"], node, path, "const")
        if "enum" in node:
            return self._enum(node, path)
        names = _type_set(node) if "type" in node else self._inferred(node)
        return self._first_kind(node, names, path, depth)

    def _flatten(self, node: Any, path: str, depth: int) -> tuple[dict[str, Any], int]:
        """``node`` with its references followed and its ``allOf`` merged."""
        node, followed = _follow(self.root, node, path)
        depth += followed
        if depth > _REF_LIMIT:
            raise _NoInstance("$ref", path, "the references recurse without end")
        if node is True:
            return {}, depth
        if node is False:
            raise _NoInstance("false", path, "the schema false has no instance")
        if "allOf" not in node:
            return dict(node), depth
        merged = {k: v for k, v in node.items() if k != "allOf"}
        for sub in node["allOf"]:
            part, depth = self._flatten(sub, path, depth)
            merged = _merge(merged, part, path)
        return self._flatten(merged, path, depth)

    def _minimal(self, depth: int) -> bool:
        return self.lean or depth > REF_DEPTH

    def _branch(self, node: dict[str, Any], path: str, depth: int) -> Any:
        keyword = "anyOf" if "anyOf" in node else "oneOf"
        branches = node[keyword]
        rest = {k: v for k, v in node.items() if k != keyword}
        order = self.rng.order(len(branches))
        if self._minimal(depth):
            order.sort(key=lambda i: _has_ref(branches[i]))
        rounds = _ONE_OF_ROUNDS if keyword == "oneOf" else 1  # a value may fall where branches overlap
        for i in order * rounds:
            try:
                chosen, chosen_depth = self._flatten(branches[i], f"{path}/{keyword}/{i}", depth)
                value = self.value(_merge(rest, chosen, path), path, chosen_depth)
            except _NoInstance:
                continue
            if keyword == "anyOf" or not any(self.validator.valid(b, value) for j, b in enumerate(branches) if j != i):
                return value
        raise _NoInstance(
            keyword, path, "no branch has an instance" + (" matching it alone" if keyword == "oneOf" else "")
        )

    def _checked(self, value: Any, node: dict[str, Any], path: str, keyword: str) -> Any:
        rest = {k: v for k, v in node.items() if k not in ("const", "enum")}
        if not self.validator.valid(rest, value):
            raise _NoInstance(keyword, path, f"{value!r} breaks the schema's other keywords")
        return value

    def _enum(self, node: dict[str, Any], path: str) -> Any:
        rest = {k: v for k, v in node.items() if k != "enum"}
        fits = [value for value in node["enum"] if self.validator.valid(rest, value)]
        if not fits:
            raise _NoInstance("enum", path, "no value of the enum fits the schema's other keywords")
        return fits[0] if self.lean else self.rng.pick(fits)

    def _inferred(self, node: Schema) -> set[str]:
        for name, keywords in _INFER:
            if any(keyword in node for keyword in keywords):
                return {name}
        return {"null", "boolean", "integer", "string"} if self.lean else {"boolean", "integer", "number", "string"}

    def _first_kind(self, node: dict[str, Any], names: set[str], path: str, depth: int) -> Any:
        kinds = [name for name in _TYPES if name in names]
        if not self._minimal(depth):
            kinds = [kinds[i] for i in self.rng.order(len(kinds))]
        for kind in kinds:
            try:
                return self._kind(kind, node, path, depth)
            except _NoInstance:
                if kind == kinds[-1]:
                    raise
        raise AssertionError("unreachable: a type set is never empty")

    def _kind(self, kind: str, node: dict[str, Any], path: str, depth: int) -> Any:
        match kind:
            case "null":
                return None
            case "boolean":
                return self.rng.chance(0.5)
            case "integer":
                return self._integer(node, path)
            case "number":
                return self._number(node, path)
            case "string":
                return self._string(node, path)
            case "array":
                return self._array(node, path, depth)
            case _:
                return self._object(node, path, depth)

    def _integer(self, node: Schema, path: str) -> int:
        lo, hi = _integer_bounds(node)
        if lo is not None and hi is not None and lo > hi:
            raise _NoInstance("minimum", path, "no integer lies within the bounds")
        return _small_between(self.rng, lo, hi, 100)

    def _number(self, node: Schema, path: str) -> float | int:
        """A number with at most two decimals (an integer when the bounds leave no other)."""
        cents = {
            k: v * 100 for k, v in node.items() if k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
        }
        lo, hi = _integer_bounds(cents)
        if lo is None or hi is None or lo <= hi:
            chosen = _small_between(self.rng, lo, hi, 10_000)
            for candidate in (chosen, chosen + 1, chosen - 1):  # a cent either way, for float rounding
                if self.validator.numeric_ok(node, candidate / 100):
                    return candidate / 100
        low = node.get("minimum", node.get("exclusiveMinimum"))
        high = node.get("maximum", node.get("exclusiveMaximum"))
        if low is not None and high is not None and self.validator.numeric_ok(node, (low + high) / 2):
            return (low + high) / 2  # a range narrower than a cent
        raise _NoInstance("minimum", path, "no number lies within the bounds")

    def _string(self, node: Schema, path: str) -> str:
        fewest, most = node.get("minLength", 0), node.get("maxLength")
        if most is not None and fewest > most:
            raise _NoInstance("minLength", path, "minLength exceeds maxLength")
        if "pattern" in node or "format" in node:
            return self._shaped_string(node, path)
        text = _word(self.rng) if self.lean else " ".join(_word(self.rng) for _ in range(self.rng.between(1, 3)))
        while len(text) < fewest:
            text += " " + _word(self.rng)
        return text[:most] if most is not None else text

    def _shaped_string(self, node: Schema, path: str) -> str:
        """A string drawn from its pattern or format, drawn again if its length is wrong."""
        keyword = "pattern" if "pattern" in node else "format"
        if keyword == "pattern" and "format" in node:
            raise UnsupportedSchema("pattern", path, "pattern and format together are not supported")
        tree = _Pattern.parse(node["pattern"], path) if keyword == "pattern" else None
        for _ in range(16):
            text = (
                _sample_pattern(tree, self.rng, self.lean) if tree is not None else _FORMATS[node["format"]](self.rng)
            )
            if self.validator.string_ok(node, text):
                return text
        raise _NoInstance(keyword, path, "no string of the pattern or format fits the length bounds")

    def _array(self, node: Schema, path: str, depth: int) -> list[Any]:
        fewest, most = node.get("minItems", 0), node.get("maxItems")
        if most is not None and fewest > most:
            raise _NoInstance("minItems", path, "minItems exceeds maxItems")
        top = fewest + 2 if most is None else min(most, fewest + 2)
        count = fewest if self._minimal(depth) else self.rng.between(fewest, top)
        items = node.get("items", True)
        try:
            return [self.value(items, f"{path}/items", depth) for _ in range(count)]
        except _NoInstance:
            if fewest == 0:
                return []
            raise

    def _object(self, node: Schema, path: str, depth: int) -> dict[str, Any]:
        properties = node.get("properties", {})
        required = node.get("required", [])
        extra = node.get("additionalProperties", True)
        if not properties and not required and "properties" not in node:
            return self.free_object(path, extra, depth)
        out: dict[str, Any] = {}
        for name in [*properties, *(n for n in required if n not in properties)]:
            self._property(out, name, properties.get(name, extra), name in required, path, depth)
        return out

    def _property(self, out: dict[str, Any], name: str, sub: Any, required: bool, path: str, depth: int) -> None:
        if not required and (self._minimal(depth) or not self.rng.chance(0.6)):
            return
        try:
            out[name] = self.value(sub, f"{path}/properties/{name}", depth)
        except _NoInstance:
            if required:
                raise

    def free_object(self, path: str, values: Any = True, depth: int = 0) -> dict[str, Any]:
        """An object no schema shapes (json_object mode, or bare ``{"type": "object"}``): a few words."""
        if values is False or self._minimal(depth):
            return {}
        names = [_WORDS[i] for i in self.rng.order(len(_WORDS))[: self.rng.between(1, 3)]]
        out: dict[str, Any] = {}
        for name in names:
            try:
                out[name] = self.value(values, f"{path}/additionalProperties", depth)
            except _NoInstance:
                return {}
        return out
