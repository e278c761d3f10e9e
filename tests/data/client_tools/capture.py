"""Capture the tool schemas real clients send, as test data for the tool-call
grammar (tests/test_client_schemas.py). Each client is run once against the
server (the embedded model, 16 tokens an answer) behind a recorder that keeps
every request body; the tools of the first request that carries any are
written to tests/data/client_tools/<client>.json as sent, with the client's
version and API.

    PYTHONPATH=.:tests python tests/data/client_tools/capture.py [--only claude,codex,...]

The CLIs come from the prefixes tests/test_agents_cli.py and
tests/test_client_recipes.py install them into (npm: $TMPDIR/mlx-dflash-agent-clis;
PyPI: $TMPDIR/mlx-dflash-py-clients/<package>); the SDKs (openai, anthropic) are
the dev extra's."""


import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Literal, Optional

ROOT = Path(__file__).resolve().parents[3]

import uvicorn  # noqa: E402
from scripted import EmbeddedCatalog  # noqa: E402

from app.server import create_app  # noqa: E402
from mlx_dflash.settings.schema import ModelSettings  # noqa: E402

OUT = ROOT / "tests" / "data" / "client_tools"
NPM = Path(tempfile.gettempdir()) / "mlx-dflash-agent-clis" / "node_modules" / ".bin"
PYPI = Path(tempfile.gettempdir()) / "mlx-dflash-py-clients"
KEY = "sk-capture"
MODEL = "embedded/target"


class Bodies:
    """ASGI wrapper: keeps (path, JSON body) of every POST; one that offers tools is
answered 400 at once (its tools are what is kept)."""

    def __init__(self, app):
        self.app, self.seen = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks = []

        async def receive_():
            msg = await receive()
            chunks.append(msg.get("body", b""))
            return msg

        msg = await receive_()
        while msg.get("more_body"):
            msg = await receive_()
        try:
            body = json.loads(b"".join(chunks) or b"null")
        except ValueError:
            body = None
        self.seen.append((scope["path"], body))
        if isinstance(body, dict) and body.get("tools"):  # captured: no need to run an agent's long prompt
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": json.dumps(
                {"type": "error", "error": {"type": "invalid_request_error", "message": "captured"}}).encode()})
            return
        done = False

        async def replay():  # the body, read already, for the app
            nonlocal done
            if done:
                return await receive()
            done = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


def serve():
    app = Bodies(create_app(EmbeddedCatalog(ModelSettings(max_tokens=16)), model=MODEL, api_key=KEY))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    return app, f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, **kw)
    return (r.stdout + r.stderr)[-400:]


def version(cmd) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip().splitlines()[0]


def claude(url, tmp):
    env = {**os.environ, "HOME": str(tmp), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": KEY,
           "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    env.pop("ANTHROPIC_API_KEY", None)
    run([str(NPM / "claude"), "-p", "hi", "--max-turns", "1"], cwd=tmp, env=env)
    return "claude-code " + version([str(NPM / "claude"), "--version"])


def codex(url, tmp):
    (tmp / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "m"\n[model_providers.m]\nname = "m"\nbase_url = "{url}/v1"\n'
        'wire_api = "responses"\nenv_key = "K"\n')
    env = {**os.environ, "HOME": str(tmp), "CODEX_HOME": str(tmp), "K": KEY}
    run([str(NPM / "codex"), "exec", "--skip-git-repo-check", "hi"], cwd=tmp, env=env)
    return "codex " + version([str(NPM / "codex"), "--version"])


def opencode(url, tmp):
    from test_client_recipes import opencode_config  # the README's provider block

    (tmp / "opencode.json").write_text(json.dumps(opencode_config(url, KEY, MODEL, small_agent=False)))
    env = {**os.environ, "HOME": str(tmp), "XDG_CONFIG_HOME": str(tmp / ".config"), "XDG_DATA_HOME": str(tmp / ".data"),
           "OPENCODE_CONFIG": str(tmp / "opencode.json")}
    run([str(NPM / "opencode"), "run", "hi", "-m", f"mlx-dflash/{MODEL}"], cwd=tmp, env=env)
    return "opencode " + version([str(NPM / "opencode"), "--version"])


def llm(url, tmp):
    (tmp / "extra-openai-models.yaml").write_text(
        f"- model_id: local\n  model_name: {MODEL}\n  api_base: {url}/v1\n  api_key_name: k\n  supports_tools: true\n")
    (tmp / "keys.json").write_text(json.dumps({"k": KEY}))
    env = {**os.environ, "LLM_USER_PATH": str(tmp)}
    funcs = ("def read_file(path: str) -> str:\n    'Read a file.'\n    return open(path).read()\n\n"
             "def count(word: str, times: int = 1, exact: bool = False) -> int:\n    'Count.'\n    return times\n")
    run([str(PYPI / "llm" / "bin" / "llm"), "-m", "local", "--functions", funcs, "-T", "llm_time", "hi"], env=env)
    return "llm " + version([str(PYPI / "llm" / "bin" / "llm"), "--version"]).split()[-1]


LITELLM = r'''
import sys, litellm
from typing import List, Optional
def search(query: str, limit: int = 5, tags: Optional[List[str]] = None):
    """Search the notes.

    Parameters
    ----------
    query : str
        What to look for.
    limit : int
        At most this many.
    tags : list
        Only notes with these tags.
    """
tools = [{"type": "function", "function": litellm.utils.function_to_dict(search)},
         {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
             "required": ["city"]}}}]
for model in ("openai/" + sys.argv[2], "anthropic/" + sys.argv[2]):
    try:
        litellm.completion(model=model, api_base=sys.argv[1] + ("/v1" if model.startswith("openai") else ""),
                           api_key=sys.argv[3], messages=[{"role": "user", "content": "hi"}], tools=tools, max_tokens=8)
    except Exception as e:
        print(type(e).__name__, e)
print(litellm.__version__ if hasattr(litellm, "__version__") else "")
'''


def litellm(url, tmp):
    py = PYPI / "litellm" / "bin" / "python"
    run([str(py), "-c", LITELLM, url, MODEL, KEY])
    v = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                       capture_output=True, text=True).stdout.strip()
    return "litellm " + v


def sdks(url, tmp):
    """The SDKs' own schema helpers: openai.pydantic_function_tool (strict, $defs, anyOf
    for Optional) and the Anthropic SDK's beta_tool (a function's signature)."""
    from enum import Enum


    import anthropic
    import openai
    from pydantic import BaseModel, Field

    class Unit(str, Enum):
        c = "c"
        f = "f"

    class Place(BaseModel):
        city: str
        country: Optional[str] = None

    class Forecast(BaseModel):
        """Get the forecast for places."""
        places: List[Place] = Field(min_length=1)
        days: int = Field(ge=1, le=14)
        unit: Unit
        detail: Literal["short", "long"]

    class Note(BaseModel):
        title: str
        body: Optional[str] = None

    oa = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    try:  # (answered 400 once captured)
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                   tools=[openai.pydantic_function_tool(Forecast), openai.pydantic_function_tool(Note)])
    except openai.BadRequestError:
        pass

    @anthropic.beta_tool
    def lookup(term: str, max_results: int = 3, sources: Optional[List[str]] = None) -> str:
        """Look a term up.

        Args:
            term: The term.
            max_results: How many results.
            sources: Where to look.
        """
        return term

    ac = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    try:
        ac.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                           tools=[lookup.to_dict()])
    except anthropic.BadRequestError:
        pass
    return f"openai {openai.__version__} / anthropic {anthropic.__version__}"


CLIENTS = {"claude": claude, "codex": codex, "opencode": opencode, "llm": llm, "litellm": litellm, "sdks": sdks}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CLIENTS))
    args = ap.parse_args()
    app, url = serve()
    OUT.mkdir(parents=True, exist_ok=True)
    for name in args.only.split(","):
        start = len(app.seen)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                ver = CLIENTS[name](url, Path(tmp))
            except Exception as e:  # noqa: BLE001 - a client that fails after its first request still sent its tools
                ver = f"{name} ({type(e).__name__})"
        sent = [(path, b) for path, b in app.seen[start:] if isinstance(b, dict) and b.get("tools")]
        if not sent:
            print(f"{name}: sent no tools", file=sys.stderr)
            continue
        by_api = {}
        for path, b in sent:
            api = {"/v1/messages": "messages", "/v1/responses": "responses"}.get(path, "chat")
            have = by_api.setdefault(api, [])
            have += [t for t in b["tools"] if t not in have]  # the same tool in several requests: once
        (OUT / f"{name}.json").write_text(json.dumps({"client": ver, "tools": by_api}, indent=1) + "\n")
        print(f"{name}: {ver}, " + ", ".join(f"{len(v)} tools on {k}" for k, v in by_api.items()))


if __name__ == "__main__":
    main()
