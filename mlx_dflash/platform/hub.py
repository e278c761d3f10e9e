"""Where model folders come from: a local path or a Hugging Face repo id."""

from __future__ import annotations

from pathlib import Path


class HubError(ValueError):
    """A model reference that cannot be resolved (one-line message)."""


def resolve_path(path_or_repo: str, what: str = "model") -> Path:
    """A local folder, or a Hugging Face repo id fetched through huggingface_hub
    (served from its cache when offline)."""
    p = Path(path_or_repo).expanduser()
    if p.exists():
        if not p.is_dir():
            raise HubError(f"{what} path {p} is a file; pass the folder that holds config.json")
        return p
    if path_or_repo.count("/") != 1 or path_or_repo.startswith((".", "/", "~")):
        raise HubError(f"{what} '{path_or_repo}' is not a folder here nor a Hugging Face repo id (org/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(
            path_or_repo,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"],
        ))
    except Exception as e:  # offline, unknown repo, gated, ...: all one line for the user
        raise HubError(
            f"could not fetch {what} '{path_or_repo}' from Hugging Face ({type(e).__name__}); "
            "check the id and your network, or pass a local folder"
        ) from None
