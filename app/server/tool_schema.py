"""A tool's parameters schema as a grammar rule: llguidance compiles the JSON Schema
itself (`arguments`), exactly where it can, else leniently, else with the properties
it cannot compile relaxed to any value. The call formats (tool_grammar.py for JSON in
tags, xml_grammar.py for Qwen3-Coder's XML) put these rules inside their own."""

from __future__ import annotations

import json
from typing import Optional

try:
    import llguidance
except ImportError:  # (tool_grammar.unsupported says so; nothing here is called then)
    llguidance = None

# between JSON tokens: nothing, a space, or a line break and its indent, as JSON is written
# compact, spaced or pretty-printed; not runs of blank lines (a weak model loops on them)
WS = r"( |\n[ \t]{0,32})"
# llguidance's own options, tried in turn: the schema exactly; then ignoring keywords it does not
# implement (an unknown "format", "not") and reading oneOf as anyOf (the same where the branches are
# disjoint, as the types of clients' unions are)
EXACT = {"whitespace_pattern": WS + "?"}
LENIENT = {**EXACT, "lenient": True, "coerce_one_of": True}


def json_rule(schema, options: dict = EXACT) -> str:
    """A Lark rule body for a JSON value of `schema`, with the call's whitespace."""
    return "%json " + json.dumps({**schema, "x-guidance": options})


def compiles(body: str) -> bool:
    try:
        return not llguidance.LLMatcher.validate_grammar(f"start: {body}")
    except Exception:  # a schema the compiler refuses
        return False


def object_schema(schema) -> Optional[dict]:
    """The tool's parameters as a schema of the object its arguments are (a schema that
    says no type is one of an object, as clients mean it); None if it cannot be one."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        return None
    return {**schema, "type": "object"}


def _relaxed(schema: dict, defs: dict) -> dict:
    """`schema` with each property whose schema llguidance cannot compile (a $ref to
    nowhere, an unknown type) taken as any JSON value, recursively; its required keys,
    other keys' rule and the compilable properties' schemas kept as they are."""
    props = schema.get("properties")
    out = {k: v for k, v in schema.items() if k in ("type", "required", "additionalProperties")}
    if isinstance(props, dict):
        out["properties"] = {}
        for k, sub in props.items():
            ok = isinstance(sub, bool) or isinstance(sub, dict) and compiles(json_rule({**defs, **sub}, LENIENT))
            nested = object_schema(sub) if not ok and isinstance(sub, dict) and "properties" in sub else None
            out["properties"][k] = sub if ok else _relaxed(nested, defs) if nested is not None else {}
    if isinstance(out.get("additionalProperties"), dict) and \
            not compiles(json_rule({**defs, **out["additionalProperties"]}, LENIENT)):
        out["additionalProperties"] = True
    return out


def arguments(fn: dict) -> str:
    """The Lark rule body of a tool's arguments: its parameters schema as JSON Schema
    means it (required keys present, each declared property by its own schema, other
    keys only where additionalProperties allows them; llguidance writes declared keys
    in the schema's order), compiled by llguidance. Exactly where it can; else
    leniently (LENIENT); else with the properties it cannot compile relaxed to any
    value (_relaxed); else any JSON object."""
    schema = object_schema(fn.get("parameters", {"type": "object"}))
    if schema is None:
        return json_rule({"type": "object"})
    for body in (json_rule(schema), json_rule(schema, LENIENT)):
        if compiles(body):
            return body
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    body = json_rule({**defs, **_relaxed(schema, defs)}, LENIENT)
    return body if compiles(body) else json_rule({"type": "object"})
