"""Claude Code and Codex CLI, installed from npm, run headlessly against the
server and do a full tool round trip (issue 22). The target is scripted
(tests/scripted.py): it writes the tool call the prompt asks for in the
template's <tool_call> format and then answers from the tool's output, so the
HTTP path, the request parsing, the tool-call parsing and the real CLIs are
what is tested. Runs where `npm` is present (the CLIs are installed into a
cache folder on first use); skipped with the reason otherwise.

`pytest -s tests/test_agents_cli.py` prints each request the CLIs made
(bench/agents.md records a run)."""

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from recorded_server import api_calls, report, serve_app
from scripted import EmbeddedCatalog, Script, ScriptCatalog, tool_tokenizer

from mlx_dflash.settings.schema import ModelSettings

pytestmark = [pytest.mark.timeout(600), pytest.mark.server, pytest.mark.npm]

KEY = "sk-local-agents"
CLIS = {"claude": ("@anthropic-ai/claude-code", "2.1.197"), "codex": ("@openai/codex", "0.171.0")}
PREFIX = Path(tempfile.gettempdir()) / "mlx-dflash-agent-clis"
NOTE = "hello from a file"


class AgentScript(Script):
    """Claude Code and Codex put system reminders, developer messages and their own
    context around the user's words: the script reads the last user or tool turn
    (system turns skipped); "RAW:<text>" anywhere in a user turn is written verbatim,
    a tool turn is answered "Answer: <output>", Claude Code's session-title request
    (JSON) with a title, anything else "OK"."""

    def _answer(self, prompt_ids) -> str:
        key = tuple(prompt_ids)
        if key not in self.answers:
            text = self.tok.decode(list(prompt_ids), skip_special_tokens=False)
            role, content = "", ""
            for turn in reversed(text.split("<|im_start|>")):
                role, _, content = turn.removesuffix("<|im_end|>\n").partition("\n")
                content = content.removesuffix("<|im_end|>")
                if role != "system":
                    break
            if role == "tool":
                a = "Answer: " + content.replace("<tool_response>\n", "").replace("\n</tool_response>", "")
            elif "<session>" in content:  # a constrained decode: off script it would run to max_tokens
                a = '{"title":"Read a file"}'
            elif role == "user" and "RAW:" in content:
                a = content.rsplit("RAW:", 1)[1].split("\n", 1)[0]
            else:
                a = "OK"
            self.answers[key] = a
        return self.answers[key]


class AgentCatalog(ScriptCatalog):
    """The scripted model with a context an agent's prompt fits in (Claude Code's
    is ~49k tokens of this byte-level test tokenizer, Codex's ~24k)."""

    def __init__(self, tok):
        super().__init__(tok, max_tokens=512)
        self.script = AgentScript(tok)

    def load(self, model_id):
        lm = super().load(model_id)
        lm.model.args.max_position_embeddings = 1 << 18
        return lm


@pytest.fixture(scope="module")
def clis():
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the Claude Code and Codex CLIs come from npm")
    bins = {name: PREFIX / "node_modules" / ".bin" / name for name in CLIS}

    def installed():
        for name, (_, version) in CLIS.items():
            try:
                out = subprocess.run([str(bins[name]), "--version"], capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                return False
            if version not in out.stdout:
                return False
        return True

    if not installed():
        specs = [f"{pkg}@{version}" for pkg, version in CLIS.values()]
        r = subprocess.run([npm, "install", "--prefix", str(PREFIX), "--no-audit", "--no-fund", *specs],
                           capture_output=True, text=True, timeout=400)
        if r.returncode != 0 or not installed():
            pytest.skip(f"npm could not install {' '.join(specs)}: {(r.stderr or r.stdout).strip()[-300:]}")
    return bins


@pytest.fixture(scope="module")
def server(pairs, tmp_path_factory):
    tok = tool_tokenizer(pairs() / "target", tmp_path_factory.mktemp("agent-tok"))
    app, url, srv, thread = serve_app(AgentCatalog(tok), "script", KEY)
    yield app, url
    srv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def embedded_server():
    """The embedded model with the default settings."""
    app, url, srv, thread = serve_app(EmbeddedCatalog(ModelSettings()), "embedded/target", KEY)
    yield app, url
    srv.should_exit = True
    thread.join(10)


def _claude_env(home, url, model="script"):
    # the README's configuration: the server's URL and key; the model names until the
    # server answers any name with the served model (issue 22, item 2)
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": KEY,
           "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
           "ANTHROPIC_SMALL_FAST_MODEL": model,
           "API_TIMEOUT_MS": "1800000", "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",
           "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    env.pop("ANTHROPIC_API_KEY", None)
    return env


def _work(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "hello.txt").write_text(NOTE + "\n")
    return home, work


@pytest.mark.slow
def test_claude_code_tool_round_trip(clis, server, tmp_path):
    app, url = server
    home, work = _work(tmp_path)
    start = len(app.seen)
    call = json.dumps({"name": "Read", "arguments": {"file_path": str(work / "hello.txt")}})
    env = _claude_env(home, url)
    r = subprocess.run([str(clis["claude"]), "-p", f"RAW:<tool_call>{call}</tool_call>", "--max-turns", "3",
                        "--output-format", "json", "--allowedTools", "Read"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    seen = app.seen[start:]
    report("claude -p", seen)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    out = json.loads(r.stdout)
    assert out["is_error"] is False and out["num_turns"] == 2
    assert out["result"].startswith("Answer: ") and NOTE in out["result"]  # the model read the tool's output
    calls = api_calls(seen, "/v1/messages")
    assert len(calls) >= 2 and calls[-1]["cached"] > 0  # the second turn continued from the cached first
    assert all(r["status"] < 400 or (r["method"], r["path"]) == ("HEAD", "/") for r in seen)


SMALL_SYSTEM = "You are a coding agent. To read a file, call the Read tool with its file_path."


@pytest.mark.slow
def test_claude_code_runs_the_embedded_models_own_tool_call(clis, embedded_server, tmp_path):
    """The README's small-model configuration of Claude Code against the embedded
    model with default settings: the model's own call, held to the offered tool and
    its keys by the tool-call grammar, is one Claude Code accepts and runs, and its
    result goes back to the model (up to Claude Code's --max-turns); every API request
    is answered 200."""
    app, url = embedded_server
    home, work = _work(tmp_path)
    start = len(app.seen)
    env = {**_claude_env(home, url, "embedded/target"), "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "512"}
    r = subprocess.run([str(clis["claude"]), "-p", "What is hello.txt for?", "--max-turns", "3", "--output-format",
                        "json", "--allowedTools", "Read", "--tools", "Read", "--system-prompt", SMALL_SYSTEM],
                       cwd=work, env=env, capture_output=True, text=True, timeout=500, stdin=subprocess.DEVNULL)
    seen = app.seen[start:]
    report("claude -p (embedded model)", seen)
    out = json.loads(r.stdout)
    assert out["subtype"] in ("success", "error_max_turns"), (r.stdout[-2000:], r.stderr[-2000:])
    blocks = [b for f in (home / ".claude" / "projects").glob("*/*.jsonl") for line in f.read_text().splitlines()
              for b in (json.loads(line).get("message") or {}).get("content") or [] if isinstance(b, dict)]
    uses = [b for b in blocks if b.get("type") == "tool_use"]
    results = [b for b in blocks if b.get("type") == "tool_result"]
    assert uses and all(u["name"] == "Read" and "file_path" in u["input"] for u in uses), uses
    assert len(results) == len(uses)  # each call was run and its result sent back
    assert not any("InputValidationError" in json.dumps(x.get("content")) for x in results)  # inputs fit the schema
    calls = api_calls(seen, "/v1/messages")
    # the next request carries the result, from the cached conversation
    assert len(calls) >= 2 and all(c["cached"] > 0 for c in calls[1:])
    assert all(r["status"] < 400 or (r["method"], r["path"]) == ("HEAD", "/") for r in seen)


def test_codex_exec_tool_round_trip(clis, server, tmp_path):
    app, url = server
    home, work = _work(tmp_path)
    codex_home = tmp_path / "codex"
    codex_home.mkdir()
    # the README's configuration, with this server's URL
    (codex_home / "config.toml").write_text(
        'model = "script"\nmodel_provider = "mlx-dflash"\n\n[model_providers.mlx-dflash]\nname = "mlx-dflash"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "MLX_DFLASH_API_KEY"\n'
        'stream_idle_timeout_ms = 1800000\n')
    start = len(app.seen)
    call = json.dumps({"name": "exec_command", "arguments": {"cmd": "cat hello.txt"}})
    env = {**os.environ, "HOME": str(home), "CODEX_HOME": str(codex_home), "MLX_DFLASH_API_KEY": KEY}
    env.pop("OPENAI_API_KEY", None)
    r = subprocess.run([str(clis["codex"]), "exec", "--skip-git-repo-check", f"RAW:<tool_call>{call}</tool_call>"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert "cat hello.txt" in r.stderr and r.stdout.strip().startswith("Answer: ")  # ran it, then answered
    assert NOTE in r.stderr  # the command's output, as Codex shows it
    # a second turn of the same session
    r2 = subprocess.run([str(clis["codex"]), "exec", "--skip-git-repo-check", "resume", "--last",
                         "RAW:Second turn done."],
                        cwd=work, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    seen = app.seen[start:]
    report("codex exec (+ resume)", seen)
    assert r2.returncode == 0 and r2.stdout.strip() == "Second turn done.", (r2.stdout[-2000:], r2.stderr[-2000:])
    calls = api_calls(seen, "/v1/responses")
    assert len(calls) == 3 and calls[1]["cached"] > 0 and calls[2]["prompt"] > calls[1]["prompt"]
    assert all(r["status"] < 400 for r in seen)


@pytest.mark.slow
def test_claude_code_interactive_session_in_tmux(clis, server, tmp_path):
    """Claude Code's interactive UI in a tmux pane: a turn with a tool call, then a second turn."""
    tmux = shutil.which("tmux")
    if tmux is None:
        pytest.skip("tmux is not installed: the interactive session runs in a tmux pane")
    app, url = server
    home, work = _work(tmp_path)
    # first-run screens (onboarding, folder trust) answered as a user would have
    (home / ".claude.json").write_text(json.dumps({"hasCompletedOnboarding": True, "theme": "dark", "projects": {
        str(work): {"hasTrustDialogAccepted": True, "allowedTools": []}}}))
    sock = f"mlx-dflash-{os.getpid()}"
    env = _claude_env(home, url)
    cmd = " ".join(f"{k}={json.dumps(v)}" for k, v in env.items()
                   if k.startswith(("ANTHROPIC_", "DISABLE_", "CLAUDE_", "API_")) or k == "HOME")
    start = len(app.seen)

    def pane():
        return subprocess.run([tmux, "-L", sock, "capture-pane", "-p", "-t", "cc"], capture_output=True,
                              text=True).stdout

    def wait_for(text, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in pane():
                return
            time.sleep(0.5)
        raise AssertionError(f"{text!r} never showed; the pane:\n{pane()}")

    def say(text):
        subprocess.run([tmux, "-L", sock, "send-keys", "-t", "cc", "-l", text], check=True)
        time.sleep(0.5)
        subprocess.run([tmux, "-L", sock, "send-keys", "-t", "cc", "Enter"], check=True)

    subprocess.run([tmux, "-L", sock, "new-session", "-d", "-s", "cc", "-x", "200", "-y", "50", "-c", str(work),
                    f"env {cmd} {clis['claude']} --allowedTools Read"], check=True)
    try:
        wait_for("for shortcuts", 60)
        call = json.dumps({"name": "Read", "arguments": {"file_path": str(work / "hello.txt")}})
        say(f"RAW:<tool_call>{call}</tool_call>")
        wait_for("Answer: ")
        wait_for(NOTE)
        say("RAW:Second turn done.")
        wait_for("● Second turn done.", 60)
    finally:
        subprocess.run([tmux, "-L", sock, "kill-server"], capture_output=True)
    seen = app.seen[start:]
    report("claude (interactive, tmux)", seen)
    calls = api_calls(seen, "/v1/messages")
    assert len(calls) >= 3  # the tool call, the answer from its output, the second turn (+ a title)
    assert all(r["status"] < 400 or (r["method"], r["path"]) == ("HEAD", "/") for r in seen)
