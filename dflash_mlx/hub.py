"""Local folders and Hugging Face repo ids, resolved through the hub cache."""

import re
from pathlib import Path
from typing import List

from .errors import CheckpointError

DEFAULT_MODEL = "Qwen/Qwen3-4B"
DEFAULT_DRAFT_MODEL = "z-lab/Qwen3-4B-DFlash-b16"

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(path_or_repo: str, allow_patterns: List[str], what: str = "model") -> Path:
    """A local folder for a path or a repo id (fetched into the Hugging Face cache; a cached copy offline).

    Raises:
        CheckpointError: the folder does not exist, or the repo can be neither downloaded nor found in the
            cache (names it and says how to pass a local folder instead).
    """
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path}: expected a {what} folder, found a file")
    if not _REPO_ID.match(path_or_repo) or path_or_repo.startswith((".", "/", "~")) or path.parent.is_dir():
        raise CheckpointError(f"{path}: {what} folder not found")  # not owner/name, or its owner is a folder
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path_or_repo, allow_patterns=allow_patterns))
    except Exception as e:
        raise CheckpointError(f"{what} '{path_or_repo}' is neither a local folder nor downloadable from the Hugging "
                              f"Face hub ({type(e).__name__}). Offline, pass a local folder instead, e.g. `hf download "
                              f"{path_or_repo} --local-dir DIR` on a connected machine, then point the flag at "
                              "DIR.") from None
