"""The README's recipes for opencode, aider, `llm` and LiteLLM, run with the real
clients from npm and PyPI against the server on the embedded model with default
settings (issue 37), as tests/test_agents_cli.py runs Claude Code and Codex.
Each client is installed on first use into a cache folder ($TMPDIR/mlx-dflash-agent-clis
for npm, $TMPDIR/mlx-dflash-py-clients/<package> for PyPI: a venv of its own, so its
pinned dependencies never meet the project's); where that fails, the test is skipped
with the reason."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from recorded_server import api_calls, report, serve_app

jsonschema = pytest.importorskip("jsonschema")

NPM_PREFIX = Path(tempfile.gettempdir()) / "mlx-dflash-agent-clis"
PY_PREFIX = Path(tempfile.gettempdir()) / "mlx-dflash-py-clients"
OPENCODE = ("opencode-ai", "1.18.33")
PYPI = {"llm": "0.36", "litellm": "1.110.2", "aider-chat": "0.86.2"}
KEY = "sk-local-recipes"
MODEL = "embedded/target"
SMALL_PROMPT = "You are a coding agent. To read a file, call the read tool with its filePath."


def opencode_config(url: str, key: str, model: str = MODEL, small_agent: bool = True) -> dict:
    """The README's opencode.json: the server as an OpenAI-compatible provider and,
    for a small model, an agent with one tool and a short prompt (opencode's own
    agent sends an 11k-token prompt and two dozen tools, past what a small model follows)."""
    cfg = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"mlx-dflash": {
            "npm": "@ai-sdk/openai-compatible", "name": "mlx-dflash",
            "options": {"baseURL": f"{url}/v1", "apiKey": key},
            "models": {model: {"name": model, "tool_call": True, "limit": {"context": 32768, "output": 512}}}}},
        "model": f"mlx-dflash/{model}",
        "small_model": f"mlx-dflash/{model}",
    }
    if small_agent:
        cfg["agent"] = {"small": {"mode": "primary", "description": "One tool and a short prompt, for small models",
                                  "prompt": SMALL_PROMPT, "tools": {"*": False, "read": True}}}
    return cfg


def npm_client(pkg: str, version: str, binary: str) -> Path:
    """`binary` of npm package `pkg`@`version`, installed into NPM_PREFIX on first use."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed: {pkg} comes from npm")
    exe = NPM_PREFIX / "node_modules" / ".bin" / binary

    def ok():
        try:
            out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            return False
        return version in out

    if not ok():
        r = subprocess.run([npm, "install", "--prefix", str(NPM_PREFIX), "--no-audit", "--no-fund",
                            f"{pkg}@{version}"], capture_output=True, text=True, timeout=400)
        if r.returncode != 0 or not ok():
            pytest.skip(f"npm could not install {pkg}@{version}: {(r.stderr or r.stdout).strip()[-300:]}")
    return exe


def py_client(pkg: str, *extra: str) -> Path:
    """The venv of PyPI package `pkg` (at PYPI's version, with `extra` packages), made on first use."""
    venv = PY_PREFIX / pkg
    py = venv / "bin" / "python"
    want = f"{pkg}=={PYPI[pkg]}"

    def ok():
        r = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({pkg!r}))"],
                           capture_output=True, text=True)
        return r.returncode == 0 and r.stdout.strip() == PYPI[pkg]

    if not (py.exists() and ok()):
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", want, *extra], capture_output=True, text=True,
                           timeout=900)
        if r.returncode != 0 or not ok():
            pytest.skip(f"pip could not install {want}: {(r.stderr or r.stdout).strip()[-300:]}")
    return venv / "bin"


CTX = 2048  # the served context: a request without max_tokens may use what is left of it


def _defaults_catalog():
    """The embedded pair with default settings (no max_tokens set) and a context of CTX
    tokens: an answer the 11M model never ends runs to the end of the context, in seconds."""
    from scripted import EmbeddedCatalog

    from mlx_dflash.settings.schema import ModelSettings

    class Defaults(EmbeddedCatalog):
        def explicit_max_tokens(self, model_id):
            return None  # as a settings file without max_tokens says

        def load(self, model_id):
            lm = super().load(model_id)
            lm.model.args.max_position_embeddings = CTX
            return lm

    return Defaults(ModelSettings())


@pytest.fixture(scope="module")
def embedded_server():
    """The server on the embedded model with default settings, behind the request recorder."""
    app, url, srv, thread = serve_app(_defaults_catalog(), MODEL, KEY)
    yield app, url
    srv.should_exit = True
    thread.join(10)


def _work(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "hello.txt").write_text("hello from a file\n")
    return home, work


def _all_answered(seen, path):
    return api_calls(seen, path)  # every request to `path` answered 200 (asserted there)


@pytest.mark.npm
@pytest.mark.slow
def test_opencode_small_agent_runs_the_models_tool_call(embedded_server, tmp_path):
    """The README's opencode.json (a provider block, and the small-model agent): the
    embedded model's own call to `read`, held to opencode's schema (filePath required)
    by the grammar, is one opencode accepts and runs."""
    exe = npm_client(*OPENCODE, "opencode")
    app, url = embedded_server
    home, work = _work(tmp_path)
    (home / "opencode.json").write_text(json.dumps(opencode_config(url, KEY)))
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_DATA_HOME": str(home / ".data"), "OPENCODE_CONFIG": str(home / "opencode.json")}
    start = len(app.seen)
    r = subprocess.run([str(exe), "run", "--agent", "small", "--format", "json", "-m", f"mlx-dflash/{MODEL}",
                        "What is in hello.txt?"], cwd=work, env=env, capture_output=True, text=True, timeout=900,
                       stdin=subprocess.DEVNULL)
    seen = app.seen[start:]
    report("opencode run --agent small", seen)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    uses = [e["part"] for e in events if e.get("type") == "tool_use"]
    assert uses and all(u["tool"] == "read" and "filePath" in u["state"]["input"] for u in uses), uses
    assert not any("SchemaError" in json.dumps(u["state"]) or "Invalid" in str(u["state"].get("error", ""))
                   for u in uses)  # opencode took the input: its schema held
    assert len(_all_answered(seen, "/v1/chat/completions")) >= 2  # the result went back to the model


LLM_FUNCTIONS = '''
def read_file(path: str) -> str:
    "Read a text file and return what it holds."
    return open(path).read()
'''


def llm_config(folder: Path, url: str, key: str) -> dict:
    """The README's `llm` setup: the server as an OpenAI-compatible model (extra-openai-models.yaml,
    in llm's folder: `llm logs path` shows where) and its key (`llm keys set mlx-dflash`)."""
    (folder / "extra-openai-models.yaml").write_text(
        f"- model_id: mlx-dflash\n  model_name: {MODEL}\n  api_base: {url}/v1\n  api_key_name: mlx-dflash\n"
        "  supports_tools: true\n")
    (folder / "keys.json").write_text(json.dumps({"mlx-dflash": key}))
    return {**os.environ, "LLM_USER_PATH": str(folder)}


@pytest.mark.slow
def test_llm_runs_the_models_tool_call_and_answers_unbounded(embedded_server, tmp_path):
    """`llm` with a Python function as a tool: the model's call holds to the schema llm
    sends (`path`, a string, required; llm's schemas leave other keys open, and the
    function refuses the ones the 11M model adds, which llm reports back to the model);
    llm runs it and sends the result back. `llm` sends no max_tokens, and no answer is
    cut at the old default of 512."""
    bins = py_client("llm")
    app, url = embedded_server
    home, work = _work(tmp_path)
    env = llm_config(home, url, KEY)
    start = len(app.seen)
    r = subprocess.run([str(bins / "llm"), "-m", "mlx-dflash", "--functions", LLM_FUNCTIONS, "--td",
                        "What is in hello.txt?"], cwd=work, env=env, capture_output=True, text=True, timeout=900,
                       stdin=subprocess.DEVNULL)
    seen = app.seen[start:]
    report("llm --functions", seen)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    sent = [ast.literal_eval(m) for m in re.findall(r"Tool call: read_file\((\{.*\})\)", out)]
    assert sent, out[-3000:]
    schema = {"properties": {"path": {"type": "string"}}, "required": ["path"], "type": "object"}  # as llm sends it
    for args in sent:
        jsonschema.validate(args, schema)
    calls = _all_answered(seen, "/v1/chat/completions")
    assert len(calls) >= 2  # the tool's result went back to the model
    assert all(c["out"] != 512 for c in calls)  # no request was cut at the old default


LITELLM_SCRIPT = r'''
import json, sys
import litellm
url, key, model = sys.argv[1:4]
weather = {"type": "object", "properties": {"city": {"type": "string"},
           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": weather}}]
msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
out = []
for provider, base in (("openai", url + "/v1"), ("anthropic", url)):
    r = litellm.completion(model=f"{provider}/{model}", api_base=base, api_key=key, messages=msgs, tools=tools,
                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                           **({"max_tokens": 256} if provider == "anthropic" else {}))
    m = r.choices[0].message
    out.append({"provider": provider, "finish": r.choices[0].finish_reason,
                "calls": [{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                          for c in m.tool_calls or []]})
    r = litellm.completion(model=f"{provider}/{model}", api_base=base, api_key=key,
                           messages=[{"role": "user", "content": "What is 3 times 2?"}],
                           **({"max_tokens": 256} if provider == "anthropic" else {}))
    out[-1]["text"] = r.choices[0].message.content
print(json.dumps({"weather": weather, "runs": out}))
'''


@pytest.mark.slow
def test_litellm_calls_hold_to_the_schema_on_both_routes(embedded_server):
    """LiteLLM (the SDK) with the server as an OpenAI provider and as an Anthropic one:
    a forced call validates against the tool's schema (its required keys and enum), and
    a plain answer comes back."""
    bins = py_client("litellm")
    app, url = embedded_server
    start = len(app.seen)
    r = subprocess.run([str(bins / "python"), "-c", LITELLM_SCRIPT, url, KEY, MODEL],
                       capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    report("litellm", app.seen[start:])
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert [x["provider"] for x in res["runs"]] == ["openai", "anthropic"]
    for run in res["runs"]:
        assert [c["name"] for c in run["calls"]] == ["get_weather"], run
        jsonschema.validate(run["calls"][0]["arguments"], res["weather"])
        assert run["text"]
    _all_answered(app.seen[start:], "/v1/chat/completions")
    _all_answered(app.seen[start:], "/v1/messages")


@pytest.mark.slow
def test_aider_answers_without_hitting_a_token_limit(embedded_server, tmp_path):
    """aider (the README's flags) against the server: it sends no max_tokens, and its
    answer is no longer cut at the setting's default of 512 (aider said "hit a token
    limit"): it ends where the model ends it, or at the end of the context."""
    bins = py_client("aider-chat")
    app, url = embedded_server
    home, work = _work(tmp_path)
    env = {**os.environ, "HOME": str(home), "OPENAI_API_BASE": f"{url}/v1", "OPENAI_API_KEY": KEY}
    start = len(app.seen)
    r = subprocess.run([str(bins / "aider"), "--model", f"openai/{MODEL}", "--message", "What is 3 times 2?",
                        "--yes-always", "--no-git", "--no-check-update", "--no-show-model-warnings",
                        "--no-analytics", "--no-pretty", "--no-stream", "--map-tokens", "0", "--edit-format",
                        "whole"], cwd=work, env=env, capture_output=True, text=True, timeout=900,
                       stdin=subprocess.DEVNULL)
    seen = app.seen[start:]
    report("aider --message", seen)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Traceback" not in out, out[-3000:]
    calls = _all_answered(seen, "/v1/chat/completions")
    assert calls and all(c["out"] != 512 and (c["out"] < 512 or c["prompt"] + c["out"] == CTX) for c in calls)
