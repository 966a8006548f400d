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
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.utils import validate_repo_id

    repo = str(name)
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise ConfigError(
            f"{repo}: not a folder, and not a Hugging Face Hub id ({str(e).splitlines()[0]}). A Hub id is ORG/NAME "
            "of ASCII letters, digits, '-', '_' and '.', at most 96 characters, without '--' or '..'"
        ) from None
    if revision is not None and not revision.strip():
        raise ConfigError(f"--revision {revision!r}: expected a branch, tag or commit of {repo}")
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
    # A snapshot is a commit's folder inside the cache. A refs/ file can name any path
    # ("../../../../outside/x"), which huggingface_hub joins as it is: refused.
    snapshots = Path(constants.HF_HUB_CACHE).resolve() / f"models--{repo.replace('/', '--')}" / "snapshots"
    if folder.resolve().parent != snapshots:
        raise ConfigError(
            f"{repo}: the Hugging Face cache resolves {revision or 'main'} to {folder}, which is not a snapshot folder "
            f"of {snapshots}; its refs/ file is damaged: delete {snapshots.parent} and download the model again"
        )
    return folder, HubRecord(repo, folder.name)
