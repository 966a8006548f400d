"""`aotc build ORG/NAME`: a model named as on the Hugging Face Hub.

huggingface_hub resolves the name, as every tool in the ecosystem does: its
cache first (HF_HOME, HF_HUB_CACHE), a download only where the network is
allowed (not HF_HUB_OFFLINE=1). A snapshot folder holds symlinks into the
cache's blobs/; they are the cache's own layout, and are read through.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import ConfigError
from ..format import HubRecord

# What aotc reads from a model repository; never the other weight formats a repo may hold.
FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(name: str | Path, revision: str | None = None) -> tuple[Path, HubRecord | None]:
    """A model folder, or a Hub id (ORG/NAME) resolved to its snapshot folder."""
    path = Path(name)
    if path.exists() or not HUB_ID.fullmatch(str(name)):
        if revision is not None:
            raise ConfigError(f"--revision {revision}: applies to a Hugging Face Hub id (ORG/NAME), and {name} is a folder")
        return path, None
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    repo = str(name)
    try:
        folder = snapshot_download(repo, revision=revision, allow_patterns=FILES, local_files_only=True)
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise ConfigError(
                f"{repo}: no such folder, and not in the Hugging Face cache {constants.HF_HUB_CACHE} "
                f"{'at revision ' + revision + ' ' if revision else ''}(offline: HF_HUB_OFFLINE is set, so not "
                "downloaded). Pass a model folder, or download it where the network is allowed (hf download "
                f"{repo}) and point HF_HOME at that cache"
            ) from None
        try:
            folder = snapshot_download(repo, revision=revision, allow_patterns=FILES)
        except (RepositoryNotFoundError, RevisionNotFoundError, HfHubHTTPError, OSError) as e:
            raise ConfigError(
                f"{repo}: no such folder, not in the Hugging Face cache {constants.HF_HUB_CACHE}, and downloading it "
                f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. Pass a model folder, or "
                "check the name, --revision and your network and token (HF_TOKEN)"
            ) from None
    folder = Path(folder)
    return folder, HubRecord(repo, folder.name)
