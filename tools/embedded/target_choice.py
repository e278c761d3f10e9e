"""Tool choice for the embedded target (issue 22): `prepare-choice` of tools/embedded/target.py.

Phase 5 taught the format of a call but not which tool to call: its conversations always
named the same seven tools, and most of them (the GSM8K ones) called `calculator`, so the
model called `calculator` whatever a request offered. Here every conversation renames
its tools and their arguments, half of them from a pool of the names real agents and APIs
use (`Read` / `file_path`, `shell`, `read_file` / `path`, ...) and half made up (verb and
noun in a random style, or random letters), rewrites the descriptions, sometimes adds optional parameters,
and in half of them offers only the tool it calls: the name and argument keys of a call
can only come from the request's own tool list, so the model learns to copy them from it.
Tool results are cut at 2,000 characters, so every training window holds several calls.
New conversation kinds give the other tools real uses: `bash` runs `ls` on a stdlib
package, `search` finds where a function is defined (its real line). Call examples
(runs/data/calls_train.npz, for `train --sft-weight`): each conversation's first call,
renamed three times, with a mask that puts the loss on the call's tokens alone.
Measured and not shipped: bench/tool_choice.md.

It starts from the shipped target (tokenizer as is: no token is freed again) and
re-encodes every stream with that tokenizer into runs/data/; no tools_stats.json is
written, so `train --init-from` loads the weights unchanged.
"""

from __future__ import annotations

import ast
import json
import shutil

import numpy as np

from .target_data import DATA, ROOT, chat_text, gsm8k_split, stdlib_files, token_stream
from .target_tools import ASK_DIR, call, conversations, system_msgs, tool_list

SHIPPED = ROOT / "models" / "target"

PATH_KEYS = ["path", "file_path", "filename", "filepath", "file", "target_file"]
DIR_KEYS = ["path", "directory", "dir", "folder", "dir_path"]
# capability -> (names, {phase-5 argument key: its variants}, descriptions)
VARIANTS = {
    "calculator": (["calculator", "calc", "Calculator", "evaluate", "compute", "math_eval", "arithmetic",
                    "eval_expression"],
                   {"expression": ["expression", "expr", "input", "formula"]},
                   ["Evaluate an arithmetic expression and return the result.", "A calculator for arithmetic.",
                    "Computes the value of a math expression."]),
    "read_file": (["Read", "read_file", "ReadFile", "read", "view_file", "open_file", "cat", "file_read",
                   "readFile", "get_file_contents", "view"],
                  {"path": PATH_KEYS},
                  ["Read a text file and return its contents.", "Reads a file from the local filesystem.",
                   "Return the contents of the file at the given path.", "View the text of a file."]),
    "list_files": (["LS", "list_files", "list_dir", "ls", "list_directory", "listFiles", "dir"],
                   {"path": DIR_KEYS},
                   ["List the files in a directory.", "Lists files and directories in a given path.",
                    "Show what a folder contains."]),
    "write_file": (["Write", "write_file", "WriteFile", "create_file", "save_file", "Edit", "edit_file"],
                   {"path": PATH_KEYS, "content": ["content", "text", "contents", "new_content"]},
                   ["Write text to a file, replacing its contents.", "Writes a file to the local filesystem.",
                    "Create or overwrite a file."]),
    "run_python": (["run_python", "python", "PythonREPL", "execute_code", "exec_python", "run_code"],
                   {"code": ["code", "source", "script"]},
                   ["Run a Python snippet and return what it prints.", "Execute Python code.",
                    "Runs code in a Python interpreter."]),
    "search": (["search", "Grep", "grep", "search_files", "find_in_files", "search_code", "rg"],
               {"pattern": ["pattern", "query", "regex"], "path": DIR_KEYS},
               ["Search the repository for a regular expression.", "A powerful search tool built on ripgrep.",
                "Find the lines of files that match a pattern."]),
    "bash": (["bash", "Bash", "shell", "run_command", "exec_command", "terminal", "run_shell"],
             {"command": ["command", "cmd"]},
             ["Run a shell command and return its output.", "Executes a given bash command.",
              "Runs a command in a terminal."]),
}
VERBS = ["get", "fetch", "load", "open", "do", "run", "query", "lookup", "use", "call", "make", "show", "find",
         "take", "send", "check", "pull", "scan", "peek", "grab", "probe", "invoke", "apply", "handle"]
NOUNS = ["document", "source", "text", "data", "page", "item", "record", "thing", "resource", "tool", "entry",
         "blob", "node", "asset", "unit", "content", "object", "target", "value", "artifact", "input", "payload"]
STYLES = [lambda v, n: f"{v}_{n}", lambda v, n: v + n.capitalize(), lambda v, n: v.capitalize() + n.capitalize(),
          lambda v, n: f"{v}-{n}", lambda v, n: f"{v}_{n}_v2", lambda v, n: n]
EXTRA = {"offset": ("integer", "The line number to start reading from"),
         "limit": ("integer", "The number of lines to read"),
         "timeout": ("number", "Optional timeout in seconds"),
         "description": ("string", "A short description of what this does")}


LETTERS = "abcdefghijklmnopqrstuvwxyz"


def made_up(rng) -> str:
    """A name no prior can guess: half verb and noun in a random style, half random letters."""
    if rng.random() < 0.5:
        v, n = VERBS[int(rng.integers(len(VERBS)))], NOUNS[int(rng.integers(len(NOUNS)))]
        return STYLES[int(rng.integers(len(STYLES)))](v, n)
    word = "".join(LETTERS[int(i)] for i in rng.integers(0, 26, size=int(rng.integers(3, 9))))
    return word if rng.random() < 0.5 else word.capitalize() + "_" + str(int(rng.integers(0, 100)))


def renamer(tools: list, rng):
    """A consistent renaming of one conversation's tools: {old name: (new name, {old key: new key},
    description)}; names are distinct, half of them made up (so a name can only be copied from the
    list, never guessed from the kind of request), and a third of the argument keys."""
    out, used = {}, set()
    for t in tools:
        old = t["function"]["name"]
        names, keys, descs = VARIANTS[old]
        while True:
            new = made_up(rng) if rng.random() < 0.5 else names[int(rng.integers(len(names)))]
            if new not in used:
                break
        used.add(new)
        kmap = {}
        for k, v in keys.items():
            while True:
                nk = NOUNS[int(rng.integers(len(NOUNS)))] if rng.random() < 1 / 3 else v[int(rng.integers(len(v)))]
                if nk not in kmap.values():
                    break
            kmap[k] = nk
        out[old] = (new, kmap, descs[int(rng.integers(len(descs)))])
    return out


def renamed_schema(schema: dict, ren, rng) -> dict:
    fn = schema["function"]
    new, kmap, desc = ren[fn["name"]]
    props = {kmap[k]: v for k, v in fn["parameters"]["properties"].items()}
    required = [kmap[k] for k in fn["parameters"]["required"]]
    for k, (t, d) in EXTRA.items():  # optional parameters, never called with
        if k not in props and rng.random() < 0.15:
            props[k] = {"type": t, "description": d}
    return {"type": "function", "function": {
        "name": new, "description": desc,
        "parameters": {"type": "object", "properties": props, "required": required}}}


def rename(conv, rng, p_alone: float = 0.5):
    """The conversation with its tools and calls renamed; w.p. p_alone the list offers only the
    tools the conversation calls."""
    msgs, tools = conv
    called = {c["function"]["name"] for m in msgs for c in m.get("tool_calls") or []}
    if rng.random() < p_alone:
        tools = [t for t in tools if t["function"]["name"] in called]
    ren = renamer(tools, rng)
    out = []
    for m in msgs:
        if m.get("tool_calls"):
            m = dict(m, tool_calls=[call(ren[c["function"]["name"]][0],
                                         {ren[c["function"]["name"]][1][k]: v
                                          for k, v in c["function"]["arguments"].items()})
                                    for c in m["tool_calls"]])
        out.append(m)
    return out, [renamed_schema(t, ren, rng) for t in tools]


def bash_ls_conv(d: str, names: list, rng):
    p = "Lib/" + d
    msgs = system_msgs(rng, False) + [
        {"role": "user", "content": ASK_DIR[int(rng.integers(0, len(ASK_DIR)))].format(d=p)},
        {"role": "assistant", "content": "", "tool_calls": [call("bash", {"command": f"ls {p}"})]},
        {"role": "tool", "content": "\n".join(names)},
        {"role": "assistant", "content": f"{p} has {len(names)} files:\n" + "\n".join(f"- {n}" for n in names)}]
    return msgs, tool_list(rng, "bash")


ASK_WHERE = ["Where is `{f}` defined?", "Find the definition of `{f}`.", "Which file defines `{f}`?"]


def search_conv(path: str, text: str, rng):
    """`search` for a top-level def / class: the tool answers with its real file and line."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")]
    if not defs:
        return None
    n = defs[int(rng.integers(len(defs)))]
    kw = "class" if isinstance(n, ast.ClassDef) else "def"
    line = text.splitlines()[n.lineno - 1].strip()
    p = "Lib/" + path
    msgs = system_msgs(rng, False) + [
        {"role": "user", "content": ASK_WHERE[int(rng.integers(len(ASK_WHERE)))].format(f=n.name)},
        {"role": "assistant", "content": "", "tool_calls": [call("search", {"pattern": f"{kw} {n.name}\\b",
                                                                            "path": "Lib"})]},
        {"role": "tool", "content": f"{p}:{n.lineno}:{line}"},
        {"role": "assistant", "content": f"`{n.name}` is defined in {p}, line {n.lineno}:\n\n{line}"}]
    return msgs, tool_list(rng, "search")


def shortened(conv, max_chars: int):
    """Tool results cut at `max_chars` (at a line end): short conversations put more calls, the
    tokens that teach the choice, in every training window."""
    msgs, tools = conv
    out = []
    for m in msgs:
        c = m.get("content")
        if m["role"] == "tool" and isinstance(c, str) and len(c) > max_chars:
            m = dict(m, content=c[:c.rfind("\n", 0, max_chars) + 1 or max_chars])
        out.append(m)
    return out, tools


def choice_base(gsm_rows, files, rng, n_gsm: int, copies: int = 2, max_chars: int = 2000) -> list:
    """(messages, tools) with phase 5's names: n_gsm of the phase-5 GSM8K conversations (they were
    7 in 8 of all), every read_file / list_files one, a bash `ls` per package and a search per file;
    all but the GSM8K ones `copies` times; tool results cut at max_chars."""
    base = conversations(gsm_rows, files, rng)
    gsm = [c for c in base if c[1] and any(t["function"]["name"] == "calculator" for t in c[1])
           and any(tc["function"]["name"] == "calculator" for m in c[0] for tc in m.get("tool_calls") or [])]
    gsm_ids = {id(c) for c in gsm}
    rest = [c for c in base if id(c) not in gsm_ids]
    convs = gsm[:n_gsm] + rest * copies
    dirs: dict = {}
    for path, _ in files:
        d, _, name = path.rpartition("/")
        if d:
            dirs.setdefault(d, []).append(name)
    convs += [bash_ls_conv(d, sorted(n), rng) for d, n in sorted(dirs.items()) if len(n) > 1] * copies
    convs += [c for path, text in files if (c := search_conv(path, text, rng))] * copies
    return [shortened(c, max_chars) for c in convs]


def choice_conversations(gsm_rows, files, rng, n_gsm: int, copies: int = 2) -> list:
    """choice_base's conversations, each copy renamed on its own, in a random order."""
    out = [rename(c, rng) for c in choice_base(gsm_rows, files, rng, n_gsm, copies)]
    return [out[i] for i in rng.permutation(len(out))]


def cmd_prepare_choice(args):
    """runs/data/: the shipped tokenizer, the four text streams and the renamed tool conversations."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    DATA.mkdir(parents=True, exist_ok=True)
    tok_dir = DATA / "tokenizer"
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    tok_dir.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(SHIPPED / f, tok_dir / f)
    (DATA / "tools_stats.json").unlink(missing_ok=True)  # no embedding rows to re-initialize
    train_rows, dev_rows = gsm8k_split()
    files = stdlib_files()
    rng = np.random.default_rng(0)  # the same held-out files as `prepare`
    val_idx = set(rng.choice(len(files), size=max(1, len(files) // 100), replace=False).tolist())
    tr = [(p, t) for i, (p, t) in enumerate(files) if i not in val_idx]
    va = [(p, t) for i, (p, t) in enumerate(files) if i in val_idx]
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    hf.chat_template = json.loads((tok_dir / "tokenizer_config.json").read_text())["chat_template"]
    crng = np.random.default_rng(23)
    render = lambda convs: [hf.apply_chat_template(m, tools=tl, tokenize=False) for m, tl in convs]  # noqa: E731
    tools_train = render(choice_conversations(train_rows, tr, crng, n_gsm=args.n_choice_gsm))
    tools_dev = render(choice_conversations(dev_rows, va, crng, n_gsm=len(dev_rows)))
    stream = lambda texts: token_stream(tok, texts)  # noqa: E731

    base = choice_base(train_rows, tr, crng, n_gsm=args.n_choice_gsm, copies=1)
    x, m = call_examples(hf, base, crng, renames=3)
    np.savez(DATA / "calls_train.npz", x=x, mask=m)
    print(f"call examples: {len(x)} (mean {m.sum(1).mean():.1f} target tokens)", flush=True)
    streams = {"code_train": stream([t for _, t in tr]), "code_val": stream([t for _, t in va]),
               "gsm_train": stream([chat_text(r["question"], r["answer"]) for r in train_rows]),
               "gsm_dev": stream([chat_text(r["question"], r["answer"]) for r in dev_rows]),
               "tools_train": stream(tools_train), "tools_dev": stream(tools_dev)}
    for k, v in streams.items():
        np.save(DATA / f"{k}.npy", v)
    stats = {k: int(v.size) for k, v in streams.items()}
    stats.update(n_tools_train=len(tools_train), n_tools_dev=len(tools_dev))
    (DATA / "choice_stats.json").write_text(json.dumps(stats, indent=2))
    (DATA / "choice_example.txt").write_text("\n=====\n".join(tools_train[:4]))
    print(json.dumps(stats, indent=2))


# ----------------------------------------------------------------------------- call examples

SFT_LEN = 768  # tokens of a call example (request + call); longer ones are dropped


def first_call(conv):
    """(messages before the first assistant turn that calls a tool, that turn) or None."""
    msgs, tools = conv
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and m.get("tool_calls"):
            return msgs[:i], m, tools
    return None


def call_examples(hf, convs, rng, renames: int) -> tuple:
    """Every conversation's first call, `renames` times renamed on its own: token rows [N, SFT_LEN + 1]
    (padded with <|endoftext|>) and a mask over next-token targets that marks only the call (the
    assistant turn after the generation prompt), so the loss teaches the choice and nothing else."""
    rows, masks = [], []
    for c in convs:
        for _ in range(renames):
            got = first_call(rename(c, rng))
            if got is None:
                continue
            before, turn, tools = got
            prompt = hf.apply_chat_template(before, tools=tools, add_generation_prompt=True, tokenize=False)
            full = hf.apply_chat_template(before + [turn], tools=tools, tokenize=False)
            assert full.startswith(prompt), "the template's generation prompt is not a prefix of the turn"
            p_ids = hf(prompt, add_special_tokens=False)["input_ids"]
            ids = hf(full, add_special_tokens=False)["input_ids"]
            if ids[:len(p_ids)] != p_ids or len(ids) > SFT_LEN + 1:
                continue
            mask = np.zeros(SFT_LEN, np.float32)
            mask[len(p_ids) - 1:len(ids) - 1] = 1.0  # targets ids[len(p_ids):]
            rows.append(np.pad(np.array(ids, np.uint16), (0, SFT_LEN + 1 - len(ids))))
            masks.append(mask)
    return np.stack(rows), np.stack(masks)
