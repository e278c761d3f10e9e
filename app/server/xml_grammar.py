"""The grammar of a tool call in Qwen3-Coder's XML format (mlx-lm's `qwen3_coder`
parser; Qwen3-Coder, Qwen3.5 / 3.6), what follows the start marker:

    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>

then the end marker. The function is one of the offered tools; its parameters are
the schema's declared keys in the schema's order, the required ones all (other keys,
which the format cannot type, are left out). A value is held to its schema where the
schema says a type the parser converts by (integer, number, boolean, null, an enum
of strings; an object or array as JSON under its own schema, via tool_schema), and
is free text up to the closing tag where it does not (a string; at most maxLength
characters where the schema bounds it)."""

from __future__ import annotations

import json
from typing import List

from .tool_schema import LENIENT, compiles, json_rule, object_schema

CLOSE = "\n</parameter>"
TEXT = r"(.|\n)*"  # free text: a lazy lexeme, so it ends at the first closing tag
NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?"


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _close_regex() -> str:
    return CLOSE.replace("\n", "\\n").replace("/", "\\/")


def _value(rule: str, sub, defs: dict) -> List[str]:
    """Lark rules for one parameter's value and its closing tag, `rule` first."""
    sub = sub if isinstance(sub, dict) else {}
    kind = sub.get("type")
    enum = sub.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum) and kind in (None, "string"):
        return [f"{rule}: ({' | '.join(_lit(v) for v in enum)}) {_lit(CLOSE)}"]
    if kind == "integer":
        return [f'{rule}: /-?(0|[1-9][0-9]{{0,17}})/ {_lit(CLOSE)}']
    if kind == "number":
        return [f"{rule}: /{NUMBER}/ {_lit(CLOSE)}"]
    if kind == "boolean":
        return [f'{rule}: ("true" | "false") {_lit(CLOSE)}']
    if kind == "null":
        return [f'{rule}: "null" {_lit(CLOSE)}']
    if kind in ("object", "array"):
        body = json_rule({**defs, **sub}, LENIENT)
        if compiles(body):
            return [f"{rule}: {body} {_lit(CLOSE)}"]
    n = sub.get("maxLength") if kind == "string" else None
    text = f"(.|\\n){{0,{int(n)}}}" if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= 4096 else TEXT
    return [f"{rule}[lazy]: /{text}{_close_regex()}/"]


def _parameters(fn: dict, rule: str) -> List[str]:
    """Lark rules for a tool's parameters, `rule` first: the declared keys in order,
    each optional one may be left out; required keys the schema does not declare, as text."""
    schema = object_schema(fn.get("parameters", {"type": "object"})) or {}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = [k for k in schema.get("required") or [] if isinstance(k, str)]
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    keys = list(props) + [k for k in required if k not in props]
    rules, seq = [], []
    for j, key in enumerate(keys):
        rules.append(f'{rule}_p{j}: "<parameter=" {_lit(key)} ">\\n" {rule}_v{j} "\\n"')
        rules += _value(f"{rule}_v{j}", props.get(key), defs)
        seq.append(f"{rule}_p{j}" + ("" if key in required else "?"))
    body = " ".join(seq) if seq else '""'
    return [f"{rule}: {body}"] + rules


def call_grammar(tools: List[dict], end: int) -> str:
    """The Lark grammar of one call to one of `tools`, then the end marker (id `end`)."""
    rules, alts = [], []
    for i, t in enumerate(tools):
        fn = t["function"]
        alts.append(f"f{i}")
        rules.append(f'f{i}: "<function=" {_lit(fn["name"])} ">\\n" f{i}_ps "</function>"')
        rules += _parameters(fn, f"f{i}_ps")
    head = [f'start: NL? ({" | ".join(alts)}) NL? <[{end}]>', 'NL: "\\n"']
    return "\n".join(head + rules)
