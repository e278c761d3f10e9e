"""The embedded target's tool-call format and long context (issue 22 item 6):
`prepare-tools` of tools/embedded/target.py.

* Tokenizer: four ids of byte-level BPE tokens that the training text never uses
  (pieces of the special-token strings the BPE trainer saw, e.g. `.<|`, `|>`) are freed
  by dropping their merges and given to `<tool_call>`, `</tool_call>`, `<tool_response>`,
  `</tool_response>` (added tokens, not special: they decode as text). vocab_size stays
  4096, so the drafters keep their shapes. Every byte still round-trips (the byte
  alphabet is untouched; a dropped merge only splits its token into its two parts).
* Chat template: Qwen3's (tools as JSON lines inside `<tools>` in the system prompt,
  calls as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, results as
  `<tool_response>` in a user turn, system messages in place after the first), without
  the thinking parts; `tool_parser_type: json_tools` (mlx-lm's parser for it).
* Data, real text only: GSM8K train solutions whose `<<a=b>>` calculator annotations
  become calculator calls and tool responses; Python standard library files as
  `read_file` results (answered with their real docstrings / definitions) and package
  listings as `list_files` results; agent-like system prompts with tool lists.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import numpy as np

from .target_data import DATA, ROOT, chat_text, gsm8k_split, stdlib_files, token_stream

TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
MAX_CONTEXT = 32768
ORIGINAL_CONTEXT = 2048
# YaRN as published models configure it (e.g. Qwen3's long-context note): factor = new / original
ROPE_SCALING = {"rope_type": "yarn", "factor": MAX_CONTEXT / ORIGINAL_CONTEXT,
                "original_max_position_embeddings": ORIGINAL_CONTEXT}
SRC_TOKENIZER = ROOT / "models" / "target"  # the 2,048-context tokenizer it starts from

CHAT_TEMPLATE = """\
{%- macro text(c) -%}
{%- if c is string -%}{{ c }}{%- elif c -%}{{ c | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') }}{%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- text(messages[0].content) + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = text(message.content) %}
    {%- if message.role == "user" or (message.role in ["system", "developer"] and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""


# ----------------------------------------------------------------------------- tokenizer

def freed_tokens(tok_json: dict, counts: dict, n: int) -> list:
    """The n least-used BPE tokens that no other merge builds on (picked one at a time,
    so a token whose only users were dropped becomes a candidate)."""
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in tok_json["model"]["merges"]]
    vocab = tok_json["model"]["vocab"]
    dropped = []
    for _ in range(n):
        live = [m for m in merges if "".join(m) not in dropped]
        parts = {p for m in live for p in m}
        cands = [("".join(m), counts.get(vocab["".join(m)], 0)) for m in live if "".join(m) not in parts]
        dropped.append(min(cands, key=lambda c: (c[1], vocab[c[0]]))[0])
    return dropped


def tool_tokenizer_json(src: Path, counts: dict) -> tuple:
    """tokenizer.json with four unused BPE tokens' ids reused for the tool markers;
    -> (json, {new token: dropped token})."""
    j = json.loads((src / "tokenizer.json").read_text())
    drop = freed_tokens(j, counts, len(TOOL_TOKENS))
    vocab = j["model"]["vocab"]
    j["model"]["merges"] = [m for m in j["model"]["merges"]
                            if "".join(m if isinstance(m, list) else m.split(" ")) not in drop]
    ids = [vocab.pop(t) for t in drop]
    for t, i in zip(TOOL_TOKENS, ids):
        j["added_tokens"].append({"id": i, "content": t, "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": False})
    return j, dict(zip(TOOL_TOKENS, drop))


def token_counts(tok, texts) -> dict:
    counts: dict = {}
    for e in tok.encode_batch(texts):
        for i in e.ids:
            counts[i] = counts.get(i, 0) + 1
    return counts


def tokenizer_config() -> dict:
    cfg = json.loads((SRC_TOKENIZER / "tokenizer_config.json").read_text())
    cfg.update(model_max_length=MAX_CONTEXT, chat_template=CHAT_TEMPLATE, tool_parser_type="json_tools")
    return cfg


# ----------------------------------------------------------------------------- conversations

TOOLS = {
    "calculator": ("Evaluate an arithmetic expression and return the result.",
                   {"expression": ("string", "The expression, e.g. 48/2 or 3*(4+5)")}),
    "read_file": ("Read a text file and return its contents.",
                  {"path": ("string", "Path of the file, relative to the repository root")}),
    "list_files": ("List the files in a directory.",
                   {"path": ("string", "Path of the directory")}),
    "write_file": ("Write text to a file, replacing its contents.",
                   {"path": ("string", "Path of the file"), "content": ("string", "The new contents")}),
    "run_python": ("Run a Python snippet and return what it prints.",
                   {"code": ("string", "The Python source to run")}),
    "search": ("Search the repository for a regular expression.",
                {"pattern": ("string", "The regular expression"), "path": ("string", "Where to search")}),
    "bash": ("Run a shell command and return its output.",
             {"command": ("string", "The command line")}),
}

SYSTEMS = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Use the tools when they help.",
    "You are a coding agent working in a checkout of the CPython repository. Use the tools to "
    "read and list files before you answer. Keep answers short.",
    "You are a math tutor. Use the calculator for every arithmetic step, then explain the step.",
    "You are an assistant that answers questions about the Python standard library. Read the "
    "source with the tools; quote what it says.",
    "",
]


def tool_schema(name: str) -> dict:
    desc, params = TOOLS[name]
    return {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object",
                       "properties": {k: {"type": t, "description": d} for k, (t, d) in params.items()},
                       "required": list(params)}}}


def tool_list(rng, need: str) -> list:
    others = [t for t in TOOLS if t != need]
    pick = [need] + list(rng.choice(others, size=int(rng.integers(0, len(others) + 1)), replace=False))
    rng.shuffle(pick)
    return [tool_schema(t) for t in pick]


def system_msgs(rng, math: bool) -> list:
    s = SYSTEMS[int(rng.integers(0, len(SYSTEMS)))]
    if not math and "math" in s:
        s = SYSTEMS[2]
    return [{"role": "system", "content": s}] if s else []


ANN = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


def call(name: str, args: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


def gsm_tool_conv(q: str, a: str, rng):
    """A GSM8K solution with each line's `<<expr=result>>` annotations as calculator calls:
    the assistant calls for a line's results, the tool answers, the assistant writes the
    line and calls for the next. None if the solution has no annotation."""
    lines = a.split("\n")
    if not ANN.search(a):
        return None
    msgs = system_msgs(rng, True) + [{"role": "user", "content": q}]
    said = ""
    for line in lines:
        anns = ANN.findall(line)
        if anns:
            msgs.append({"role": "assistant", "content": said.rstrip("\n"),
                         "tool_calls": [call("calculator", {"expression": e.strip()}) for e, _ in anns]})
            msgs += [{"role": "tool", "content": r.strip()} for _, r in anns]
            said = ""
        said += ANN.sub("", line) + "\n"
    msgs.append({"role": "assistant", "content": said.rstrip("\n")})
    return msgs, tool_list(rng, "calculator")


ASK_FILE = ["What is {p} for?", "Read {p} and tell me what it does.", "Summarize the module {p}.",
            "Open {p}. What does it say at the top?", "What is in {p}?"]
ASK_FUNC = ["What does `{f}` in {p} do?", "Look at {p}: what is `{f}` for?",
            "Find the docstring of `{f}` in {p}."]
ASK_DIR = ["Which files are in {d}?", "List the modules of the {d} package.", "What is in the directory {d}?"]


def first_paragraph(doc: str) -> str:
    return doc.strip().split("\n\n")[0].strip()


def read_file_conv(path: str, text: str, rng, max_chars: int):
    """A read_file round trip on a stdlib file: the answer is the file's own module or
    function docstring, or its top-level definitions."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    body = text if len(text) <= max_chars else text[:text.rfind("\n", 0, max_chars) + 1]
    funcs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
             and ast.get_docstring(n) and n.end_lineno <= body.count("\n")]
    p = "Lib/" + path
    mod_doc = ast.get_docstring(tree)
    if funcs and (not mod_doc or rng.random() < 0.5):
        n = funcs[int(rng.integers(0, len(funcs)))]
        ask = ASK_FUNC[int(rng.integers(0, len(ASK_FUNC)))].format(f=n.name, p=p)
        kind = "class" if isinstance(n, ast.ClassDef) else "function"
        answer = f"The {kind} `{n.name}` in {p}:\n\n{first_paragraph(ast.get_docstring(n))}"
    elif mod_doc:
        ask = ASK_FILE[int(rng.integers(0, len(ASK_FILE)))].format(p=p)
        answer = f"The module docstring of {p} says:\n\n{first_paragraph(mod_doc)}"
    else:
        names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        if not names:
            return None
        ask = ASK_FILE[int(rng.integers(0, len(ASK_FILE)))].format(p=p)
        answer = f"{p} defines " + ", ".join(f"`{x}`" for x in names[:20]) + "."
    msgs = system_msgs(rng, False) + [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": "", "tool_calls": [call("read_file", {"path": p})]},
        {"role": "tool", "content": body},
        {"role": "assistant", "content": answer}]
    return msgs, tool_list(rng, "read_file")


def list_files_conv(d: str, names: list, rng):
    p = "Lib/" + d
    listing = "\n".join(names)
    msgs = system_msgs(rng, False) + [
        {"role": "user", "content": ASK_DIR[int(rng.integers(0, len(ASK_DIR)))].format(d=p)},
        {"role": "assistant", "content": "", "tool_calls": [call("list_files", {"path": p})]},
        {"role": "tool", "content": listing},
        {"role": "assistant", "content": f"{p} has {len(names)} files:\n" + "\n".join(f"- {n}" for n in names)}]
    return msgs, tool_list(rng, "list_files")


def conversations(gsm_rows, files, rng) -> list:
    """(messages, tools) pairs: every GSM8K row with an annotation, every file twice
    (two lengths of the read), and every package listing; in a fixed random order."""
    out = [c for r in gsm_rows if (c := gsm_tool_conv(r["question"], r["answer"], rng))]
    for path, text in files:
        for max_chars in (int(rng.integers(1500, 8000)), int(rng.integers(8000, 60000))):
            if (c := read_file_conv(path, text, rng, max_chars)):
                out.append(c)
    dirs: dict = {}
    for path, _ in files:
        d, _, name = path.rpartition("/")
        if d:
            dirs.setdefault(d, []).append(name)
    out += [list_files_conv(d, sorted(n), rng) for d, n in sorted(dirs.items()) if len(n) > 1]
    order = rng.permutation(len(out))
    return [out[i] for i in order]


# ----------------------------------------------------------------------------- prepare

def cmd_prepare_tools(args):
    """The tool tokenizer and all token streams re-encoded with it (runs/data/), plus the
    tool-conversation streams tools_train / tools_dev and the embedding init map."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    DATA.mkdir(parents=True, exist_ok=True)
    train_rows, dev_rows = gsm8k_split()
    files = stdlib_files()
    rng = np.random.default_rng(0)  # the same held-out files as `prepare`
    val_idx = set(rng.choice(len(files), size=max(1, len(files) // 100), replace=False).tolist())
    code_train = [t for i, (_, t) in enumerate(files) if i not in val_idx]
    code_val = [t for i, (_, t) in enumerate(files) if i in val_idx]
    chats = [chat_text(r["question"], r["answer"]) for r in train_rows]

    old = Tokenizer.from_file(str(SRC_TOKENIZER / "tokenizer.json"))
    j, dropped = tool_tokenizer_json(SRC_TOKENIZER, token_counts(old, code_train + chats))
    tok_dir = DATA / "tokenizer"
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    tok_dir.mkdir(parents=True)
    (tok_dir / "tokenizer.json").write_text(json.dumps(j, ensure_ascii=False, indent=2))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2))
    shutil.copy(SRC_TOKENIZER / "special_tokens_map.json", tok_dir / "special_tokens_map.json")
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == old.get_vocab_size(), tok.get_vocab_size()
    init = {}
    for t, d in dropped.items():
        ids = tok.encode(t).ids
        assert len(ids) == 1 and tok.decode(ids) == t, (t, ids)
        init[ids[0]] = old.encode(t).ids  # the new row starts as the mean of its old spelling's rows
    every_byte = bytes(range(256)).decode("latin-1") + "\t\n  x .<| |> ww"
    assert tok.decode(tok.encode(every_byte).ids) == every_byte
    print(f"freed {dropped}; init {init}", flush=True)

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    hf.chat_template = CHAT_TEMPLATE
    crng = np.random.default_rng(22)
    tr = [(p, t) for i, (p, t) in enumerate(files) if i not in val_idx]
    va = [(p, t) for i, (p, t) in enumerate(files) if i in val_idx]
    render = lambda convs: [hf.apply_chat_template(m, tools=tl, tokenize=False) for m, tl in convs]  # noqa: E731
    tools_train = render(conversations(train_rows, tr, crng))
    tools_dev = render(conversations(dev_rows, va, crng))
    stream = lambda texts: token_stream(tok, texts)  # noqa: E731

    streams = {"code_train": stream(code_train), "code_val": stream(code_val), "gsm_train": stream(chats),
               "gsm_dev": stream([chat_text(r["question"], r["answer"]) for r in dev_rows]),
               "tools_train": stream(tools_train), "tools_dev": stream(tools_dev)}
    for k, v in streams.items():
        np.save(DATA / f"{k}.npy", v)
    stats = {k: int(v.size) for k, v in streams.items()}
    stats.update(n_tools_train=len(tools_train), n_tools_dev=len(tools_dev), freed=dropped,
                 embed_init={str(k): v for k, v in init.items()})
    (DATA / "tools_stats.json").write_text(json.dumps(stats, indent=2))
    (DATA / "tools_example.txt").write_text(tools_train[0] + "\n=====\n" + tools_train[1])
    print(json.dumps(stats, indent=2))
