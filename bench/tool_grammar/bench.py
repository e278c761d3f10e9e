"""What the tool-call grammar costs an agent's request: building the grammar of a
client's whole tool list (the schemas llguidance compiles, tool_schema.py) and
compiling it for the embedded tokenizer, once per tool list (cached after), and the
copy each request takes of the compiled matcher. The tool lists are the ones the
clients sent (tests/data/client_tools/).

    PYTHONPATH=. python bench/tool_grammar/bench.py"""

import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import llguidance  # noqa: E402

from app.server import tool_grammar  # noqa: E402
from app.server.structured import ll_tokenizer  # noqa: E402
from mlx_dflash import load  # noqa: E402
from mlx_dflash.models.discovery import models_dir  # noqa: E402


def function_tools(raw: list) -> list:
    out = []
    for t in raw:
        if "input_schema" in t:  # Messages
            out.append({"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}})
        elif t.get("type") == "function":  # chat completions, or Responses (flat)
            out.append(t if "function" in t else {"type": "function", "function": {
                "name": t["name"], "parameters": t.get("parameters")}})
    return out


def main():
    _, tok, _ = load(str(models_dir() / "target"))
    llt = ll_tokenizer(tok, 4096)
    print("| client | tools | grammar chars | build ms | compile ms | per-request copy ms |\n|---|---|---|---|---|---|")
    for f in sorted((ROOT / "tests" / "data" / "client_tools").glob("*.json")):
        d = json.loads(f.read_text())
        for api, raw in d["tools"].items():
            tools = function_tools(raw)
            tool_grammar._grammar.cache_clear()
            t0 = time.perf_counter()
            text = tool_grammar.grammar(tok, tools)
            t1 = time.perf_counter()
            m = llguidance.LLMatcher(llt, text)
            t2 = time.perf_counter()
            m.deep_copy()
            t3 = time.perf_counter()
            assert not m.is_error(), m.get_error()
            print(f"| {d['client']} ({api}) | {len(tools)} | {len(text)} | {1e3 * (t1 - t0):.0f} | "
                  f"{1e3 * (t2 - t1):.0f} | {1e3 * (t3 - t2):.2f} |")


if __name__ == "__main__":
    main()
