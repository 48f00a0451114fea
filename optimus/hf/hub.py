"""A model given by its Hugging Face Hub id ("allenai/OLMoE-1B-7B-0924"), as transformers users name models: the
directory of its snapshot in huggingface_hub's cache (HF_HOME, HF_HUB_CACHE), downloaded there unless cached.
With HF_HUB_OFFLINE=1 only the cache is read. Only what an import reads is fetched: config.json, the
safetensors weights and their index, and the tokenizer files.
"""

from __future__ import annotations

from pathlib import Path

from optimus.config import ConfigError
from optimus.hf.io import CONFIG, INDEX_FILE, TOKENIZER_FILES

IMPORTED_FILES = [CONFIG, "*.safetensors", INDEX_FILE, *TOKENIZER_FILES]


def is_hub_id(source: str | Path) -> bool:
    """True when `source` is no local path but can name a Hub model ("name" or "org/name")."""
    from optimus.data.sources import looks_like_path  # the rule `data.path` and `data.tokenizer` follow too

    spec = str(source)
    if Path(spec).expanduser().exists() or looks_like_path(spec):
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def hub_snapshot(repo_id: str) -> Path:
    """The cached snapshot directory of Hub model `repo_id`, downloaded first unless cached (or offline)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    cache = constants.HF_HUB_CACHE
    local = "give the directory of a local copy instead"
    try:
        return Path(snapshot_download(repo_id, allow_patterns=IMPORTED_FILES))
    except GatedRepoError:
        raise ConfigError(
            f"{repo_id} is gated on the Hugging Face Hub: accept its terms on its page and log in (`hf auth login`), "
            f"or {local}."
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{repo_id} is neither a local directory nor a model on the Hugging Face Hub (a private one needs "
            f"`hf auth login`): check the name (e.g. allenai/OLMoE-1B-7B-0924) or the path."
        ) from None
    except IncompleteSnapshotError:
        raise ConfigError(
            f"the copy of {repo_id} in the Hugging Face cache {cache} is incomplete and the Hub cannot be reached: "
            f"rerun online (without HF_HUB_OFFLINE=1) to complete it, or {local}."
        ) from None
    except LocalEntryNotFoundError as err:
        if constants.HF_HUB_OFFLINE:
            raise ConfigError(
                f"{repo_id} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1 forbids downloading it: "
                f"unset HF_HUB_OFFLINE to download it, point HF_HOME at a cache that holds it, or {local}."
            ) from None
        raise ConfigError(
            f"{repo_id} is not in the Hugging Face cache {cache} and the Hub cannot be reached "
            f"({_first_line(err).removeprefix('Got: ')}): "
            f"rerun with network access, or {local}."
        ) from None
    except HfHubHTTPError as err:
        raise ConfigError(f"downloading {repo_id} failed ({_first_line(err)}): rerun, or {local}.") from None
    except OSError as err:  # a full disk, a cache that cannot be written
        raise ConfigError(
            f"downloading {repo_id} into {cache} failed ({err.strerror or err}): free space, or set HF_HOME to "
            "another disk."
        ) from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__
