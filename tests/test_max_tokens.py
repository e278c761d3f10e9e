"""A request that sends no max_tokens may generate up to the room left in the
context, as the APIs do (issue 37: aider and `llm` send none, and were cut at the
setting's default of 512); the server's max_tokens setting caps it only where a user
set one (prompt_ids.max_new_tokens, called from the worker)."""

import httpx
import pytest
from scripted import EmbeddedCatalog, LocalServer

from app.server.catalog import ManagerCatalog
from app.server.prompt_ids import max_new_tokens
from mlx_dflash.settings.schema import ModelSettings
from mlx_dflash.settings.store import SettingsStore

pytestmark = pytest.mark.timeout(600)
CTX = 640  # the test model's context: more than the setting's default of 512 is left after the prompt


def test_max_new_tokens_rule():
    default = ModelSettings().max_tokens
    assert max_new_tokens(None, 100, 4096, None, default) == 3996  # no limit asked, none set: the room left
    assert max_new_tokens(None, 100, 4096, 64, default) == 64  # a user's setting caps it
    assert max_new_tokens(1000, 100, 4096, 64, default) == 1000  # what the client asks wins over the setting
    assert max_new_tokens(9000, 100, 4096, None, default) == 3996  # never past the end of the context
    assert max_new_tokens(None, 4096, 4096, None, default) == 1  # (refused before this: a full context)
    assert max_new_tokens(None, 100, None, None, default) == default  # no context in the config: the default
    assert max_new_tokens(None, 100, None, 64, default) == 64
    assert max_new_tokens(7, 100, None, 64, default) == 7


def test_manager_catalog_tells_a_set_max_tokens_from_the_default(tmp_path):
    store = SettingsStore(tmp_path / "settings.json")
    cat = ManagerCatalog(store)
    assert cat.explicit_max_tokens("embedded/target") is None
    store.set_model("embedded/target", max_tokens=512)  # set, even to the default's value
    assert cat.explicit_max_tokens("embedded/target") == 512
    store.reset_model("embedded/target", "max_tokens")
    assert cat.explicit_max_tokens("embedded/target") is None


class SmallContext(EmbeddedCatalog):
    """The embedded pair with a context of CTX tokens; `cap`: the max_tokens a user set (None: none)."""

    def __init__(self, cap=None):
        super().__init__(ModelSettings())
        self.cap = cap

    def explicit_max_tokens(self, model_id):
        return self.cap

    def load(self, model_id):
        lm = super().load(model_id)
        lm.model.args.max_position_embeddings = CTX
        return lm


def _no_eos():
    """logit_bias that keeps the model from ending its answer: it runs to its limit."""
    from mlx_dflash import load
    from mlx_dflash.models.discovery import models_dir

    _, tok, _ = load(str(models_dir() / "target"))
    return {str(t): -100 for t in tok.eos_token_ids}


@pytest.fixture(scope="module")
def no_eos():
    return _no_eos()


MSGS = [{"role": "user", "content": "What is 3 times 2?"}]


@pytest.mark.slow
def test_no_max_tokens_means_the_room_left(no_eos):
    with LocalServer(SmallContext(), model="embedded/target") as srv:
        c = httpx.Client(base_url=srv.url, timeout=300)
        r = c.post("/v1/chat/completions", json={"model": "embedded/target", "messages": MSGS, "logit_bias": no_eos})
        d = r.json()
        u = d["usage"]
        assert u["completion_tokens"] == CTX - u["prompt_tokens"] > ModelSettings().max_tokens
        assert d["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/completions", json={"model": "embedded/target", "prompt": "Once upon a time",
                                             "logit_bias": no_eos})
        u = r.json()["usage"]
        assert u["completion_tokens"] == CTX - u["prompt_tokens"]


def test_a_set_max_tokens_caps_only_requests_without_one(no_eos):
    with LocalServer(SmallContext(cap=20), model="embedded/target") as srv:
        c = httpx.Client(base_url=srv.url, timeout=300)
        body = {"model": "embedded/target", "messages": MSGS, "logit_bias": no_eos}
        assert c.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens"] == 20
        r = c.post("/v1/chat/completions", json={**body, "max_tokens": 30}).json()
        assert r["usage"]["completion_tokens"] == 30 and r["choices"][0]["finish_reason"] == "length"
