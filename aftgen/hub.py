"""The Hugging Face Hub, read side: a --model value resolved to a checkpoint folder, pulled into the standard HF
cache. Publishing a run (`aftgen push`) is aftgen.publish, a layer above: this module imports no training code.

Everything goes through huggingface_hub, so its settings apply unchanged: HF_HOME / HF_HUB_CACHE
(where the cache is), HF_ENDPOINT (which Hub), HF_TOKEN (who you are) and HF_HUB_OFFLINE (no network:
serve from the cache). Only the checkpoint files and the card are fetched, whatever else a repo holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from aftgen.checkpoint import CARD, CHECKPOINT_FILES, check_checkpoint
from aftgen.errors import AftgenError

MODEL_HELP = "Checkpoint folder or Hub id (default: the shipped model)."  # what --model takes, in every command
PULLED_FILES = [*CHECKPOINT_FILES, CARD]
# OWNER/NAME with an optional @REVISION (branch, tag or commit), as the Hub spells repo ids.
HUB_ID = re.compile(r"(?P<repo_id>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^@\s]+))?")


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """'OWNER/NAME[@REV]' -> (repo_id, revision or None); None when `spec` is not shaped like a Hub id."""
    match = HUB_ID.fullmatch(spec)
    return (match["repo_id"], match["revision"]) if match else None


def resolve_model(spec: str | Path) -> Path:
    """A --model value as a local checkpoint folder.

    An existing local path wins; otherwise OWNER/NAME[@REV] is fetched through the Hugging Face cache
    (offline, a model pulled once is served from there).
    """
    local = Path(spec)
    if local.exists():
        return local
    hub_id = parse_hub_id(str(spec))
    if hub_id is None:
        raise AftgenError(f"{spec}: no such checkpoint folder (nor a Hub id of the form OWNER/NAME[@REVISION])")
    return pull(*hub_id)


def pull(repo_id: str, revision: str | None = None) -> Path:
    """Download an aftgen checkpoint into the Hugging Face cache (or find it there); returns its folder."""
    from huggingface_hub import snapshot_download

    name = f"{repo_id}@{revision}" if revision else repo_id
    with hub_errors(name, revision):
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=PULLED_FILES))
    try:
        check_checkpoint(folder)
    except AftgenError as exc:  # name the repo, not the cache folder it landed in
        raise AftgenError(str(exc).replace(str(folder), name)) from None
    return folder


@contextmanager
def hub_errors(name: str, revision: str | None = None, writing: bool = False) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into one AftgenError line that says what to do."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    hub, cache = constants.ENDPOINT, constants.HF_HUB_CACHE
    token_hint = "set HF_TOKEN to a token with write access" if writing else "a private one needs HF_TOKEN"
    try:
        yield
    except HFValidationError:
        raise AftgenError(f"'{name}' is not a valid Hub id; use OWNER/NAME, optionally @REVISION") from None
    except GatedRepoError:
        raise AftgenError(f"{name}: gated repository; accept its terms on {hub} and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise AftgenError(f"{name}: no such model repository on {hub} ({token_hint})") from None
    except RevisionNotFoundError:
        raise AftgenError(f"{name}: the repository has no revision '{revision}' (a branch, tag or commit)") from None
    except RemoteEntryNotFoundError as exc:
        raise AftgenError(f"{name}: a file is missing on the Hub ({_first_line(exc)})") from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise AftgenError(
                f"{name}: not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; "
                f"run `aftgen pull {name}` with network access first"
            ) from None
        raise AftgenError(
            f"{name}: cannot reach {hub} and the model is not in the Hugging Face cache ({cache}); "
            "check the network (or HF_ENDPOINT) and retry"
        ) from None
    except OfflineModeIsEnabled:
        raise AftgenError(f"{name}: HF_HUB_OFFLINE is set, and this needs the network; unset it") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        hint = token_hint if status in (401, 403) else "retry later"
        raise AftgenError(f"{name}: {hub} answered HTTP {status}: {_first_line(exc)} ({hint})") from None
    except (httpx2.TransportError, ConnectionError) as exc:  # ConnectionError: hf_xet's storage transfers
        raise AftgenError(
            f"{name}: cannot reach {hub} ({type(exc).__name__}); check the network or HF_ENDPOINT"
        ) from None


def _first_line(exc: Exception) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
