"""The test pair (tiny random target + DFlash drafter) in chat prompts and
behind a server: what the prompt-store, disk-tier, memory-budget and
batching-server tests share."""

from types import SimpleNamespace

from scripted import OneModelCatalog

from app.server.catalog import Catalog
from mlx_dflash import load
from mlx_dflash.settings.schema import GlobalSettings, ModelSettings

N = 10  # tokens an answer
W = 4  # a fixed width: every cycle drafts, so the drafter context follows the target (see README)
SYSTEM = "You are a helpful assistant for a small software project. Answer briefly. " * 3


def fixed() -> ModelSettings:
    """The server's settings for the pair: width W with the guard off. With it on, W is only the
    widest the guard may choose, and whether a request drafts hangs on cost curves measured while
    idle or cached by earlier tests; an entry's drafter context (rows or pending features), and so
    its bytes, would hang on them too."""
    return ModelSettings(max_tokens=N, block_size=W, guard=False)


def prompt(tok, *turns, system=SYSTEM):
    msgs = [{"role": "system", "content": system}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


class PairCatalog(OneModelCatalog):
    """The test pair behind a server, with a prompt-cache budget in bytes."""

    def __init__(self, folder, budget):
        super().__init__("pair", fixed(), budget)
        self.folder = folder

    def load(self, model_id):  # on the worker's thread (MLX streams are per thread)
        model, tok, drafter = load(str(self.folder / "target"), str(self.folder / "drafter"))
        return SimpleNamespace(id="pair", model=model, tokenizer=tok, drafter=drafter, settings=self.settings_)


class DiskCatalog(Catalog):
    """The test pair behind a server, its prompt store over a disk tier."""

    def __init__(self, folder, mem=1 << 30, disk_gb=1.0):
        self.folder, self.mem = folder, mem
        self.settings_ = fixed()
        self.g = GlobalSettings(prompt_cache_disk_gb=disk_gb)

    def targets(self):
        return [{"id": "pair", "owned_by": "tests", "drafters": []}]

    def default(self):
        return "pair"

    def settings(self, model_id):
        return self.settings_

    def prompt_cache_bytes(self):
        return self.mem

    def globals(self):
        return self.g

    def load(self, model_id):  # on the worker's thread
        model, tok, drafter = load(str(self.folder / "target"), str(self.folder / "drafter"))
        return SimpleNamespace(id="pair", model=model, tokenizer=tok, drafter=drafter, settings=self.settings_)
