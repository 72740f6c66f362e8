"""What a request's tools allow a call to contain: the names, the argument keys, the value types.

Ling-3 writes argument values as raw text (docs/parsers.md §2): a string verbatim, anything else as
JSON. A call is kept only if it fits its tool's JSON schema; otherwise the parser returns its text as
content. The rules, in order: the key is a declared property (or the schema allows others), it is not
repeated, its value reads as one of the property's types, and the whole object then passes the schema
(required keys, enums, nested shapes) under `jsonschema`, a vLLM dependency.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Which JSON types a value may read as, tried in this order; a string always fits, so it comes last.
_TYPE_ORDER = ("null", "boolean", "integer", "number", "object", "array", "string")
_INTEGER = re.compile(r"-?\d+")
_MISSING = object()


class Violation(ValueError):
    """A call that does not fit its tool's schema; the message names the rule and the values."""


@dataclass(frozen=True)
class ToolSchema:
    """One callable tool: its name and the JSON schema of its arguments (None: free-form strings)."""

    name: str
    parameters: Mapping[str, Any] | None = None
    _properties: Mapping[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        props = (self.parameters or {}).get("properties")
        object.__setattr__(self, "_properties", props if isinstance(props, Mapping) else {})

    @property
    def closed(self) -> bool:
        """Whether only declared keys may appear (properties declared, additionalProperties not true)."""
        params = self.parameters or {}
        return "properties" in params and not params.get("additionalProperties", False)

    def key_could_be(self, prefix: str) -> bool:
        """Whether a key being written (`prefix`, unstripped) can still become an allowed key."""
        if not self.closed:
            return True
        head = prefix.lstrip()
        if head != head.rstrip():  # the key already ended: it must be whole
            return head.rstrip() in self._properties
        return any(k.startswith(head) for k in self._properties)

    def check_key(self, key: str, seen: Iterable[str]) -> None:
        if not key:
            raise Violation(f"tool {self.name!r}: an argument has an empty <arg_key>")
        if key in seen:
            raise Violation(
                f"tool {self.name!r}: argument {key!r} is given twice; a JSON object has each key once"
            )
        if self.closed and key not in self._properties:
            raise Violation(
                f"tool {self.name!r}: argument {key!r} is not in its schema; "
                f"the schema declares {sorted(self._properties)}"
            )

    def read_value(self, key: str, raw: str) -> Any:
        """`raw` as the value of `key`: verbatim for a string, parsed JSON for any other type."""
        prop = self._properties.get(key)
        if prop is None and isinstance((self.parameters or {}).get("additionalProperties"), Mapping):
            prop = self.parameters["additionalProperties"]  # type: ignore[index]
        types = _types_of(prop, self.parameters or {})
        for t in _TYPE_ORDER:
            if t in types and (value := _read_as(t, raw)) is not _MISSING:
                return value
        raise Violation(
            f"tool {self.name!r}: argument {key!r} = {raw[:80]!r} is not {' or '.join(sorted(types))} "
            "as its schema requires"
        )

    def check_arguments(self, args: Mapping[str, Any]) -> None:
        """The whole object against the schema: required keys, enums, bounds, nested shapes."""
        if not self.parameters:
            return
        error = _schema_error(self.parameters, args)
        if error is not None:
            raise Violation(f"tool {self.name!r}: arguments {json.dumps(args)[:120]} violate its schema: {error}")


def _read_as(json_type: str, raw: str) -> Any:
    """`raw` read as `json_type`, or _MISSING when it does not read as that type."""
    text = raw.strip()
    if json_type == "string":
        return raw
    if json_type == "null":
        return None if text.lower() == "null" else _MISSING
    if json_type == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _MISSING)
    if json_type == "integer":
        return int(text) if _INTEGER.fullmatch(text) else _MISSING
    try:
        value = json.loads(text)
    except ValueError:
        return _MISSING
    if not _finite(value):
        return _MISSING  # 1e999 would serialise as Infinity, which is not JSON
    expected = {"number": (int, float), "object": dict, "array": list}[json_type]
    return value if isinstance(value, expected) and not isinstance(value, bool) else _MISSING


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def _types_of(prop: Any, root: Mapping[str, Any], depth: int = 0) -> set[str]:
    """The JSON types a property schema admits; no type information means raw text (a string)."""
    if not isinstance(prop, Mapping) or depth > 8:
        return {"string"}
    ref = prop.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, Mapping) else None
        return _types_of(target, root, depth + 1)
    declared = prop.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list) and declared:
        return {t for t in declared if isinstance(t, str)}
    examples = prop["enum"] if isinstance(prop.get("enum"), list) else [prop["const"]] if "const" in prop else []
    if examples:
        return {_json_type(v) for v in examples}
    for combinator in ("anyOf", "oneOf", "allOf"):
        if isinstance(prop.get(combinator), list):
            return set().union(*(_types_of(p, root, depth + 1) for p in prop[combinator])) or {"string"}
    return {"string"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {dict: "object", list: "array"}.get(type(value), "string")


def _schema_error(schema: Mapping[str, Any], instance: Any) -> str | None:
    import jsonschema

    try:
        validator_cls = jsonschema.validators.validator_for(schema)
        validator_cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        logger.warning("ling3: a tool schema is not valid JSON Schema (%s); only keys and types are checked", e.message)
        return None
    error = jsonschema.exceptions.best_match(validator_cls(schema).iter_errors(instance))
    return None if error is None else error.message


def tool_schemas(tools: Sequence[Any] | None) -> dict[str, ToolSchema]:
    """Function tools of a chat request (`tool.function.name`) or a Responses request (`tool.name`)."""
    out: dict[str, ToolSchema] = {}
    for tool in tools or ():
        fn = _get(tool, "function")
        source = fn if fn is not None else tool
        name, params = _get(source, "name"), _get(source, "parameters")
        kind = _get(tool, "type")
        if isinstance(name, str) and name and kind in (None, "function"):
            out[name] = ToolSchema(name, params if isinstance(params, Mapping) else None)
    return out


def callable_tools(tools: Sequence[Any] | None, tool_choice: Any) -> dict[str, ToolSchema]:
    """The tools a call may name under `tool_choice`: none for "none", the named or allowed ones, else all."""
    schemas = tool_schemas(tools)
    if tool_choice == "none":
        return {}
    names = _chosen_names(tool_choice)
    return schemas if names is None else {n: schemas[n] for n in names if n in schemas}


def call_required(tool_choice: Any) -> bool:
    """Whether `tool_choice` demands a call: "required", a named tool, or allowed tools in required mode."""
    if tool_choice == "required" or _get(tool_choice, "mode") == "required":
        return True
    return not isinstance(tool_choice, str) and _get(tool_choice, "mode") is None and bool(_chosen_names(tool_choice))


def _chosen_names(tool_choice: Any) -> list[str] | None:
    """Names a tool_choice object restricts calls to (chat named, Responses function or allowed_tools)."""
    if tool_choice is None or isinstance(tool_choice, str):
        return None
    if isinstance(allowed := _get(tool_choice, "tools"), list):  # Responses allowed_tools
        return [n for t in allowed if isinstance(n := _get(_get(t, "function"), "name") or _get(t, "name"), str)]
    name = _get(_get(tool_choice, "function"), "name") or _get(tool_choice, "name")
    return [name] if isinstance(name, str) else None


def _get(obj: Any, attr: str) -> Any:
    if obj is None:
        return None
    return obj.get(attr) if isinstance(obj, Mapping) else getattr(obj, attr, None)
