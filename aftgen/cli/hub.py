"""`aftgen pull` and `aftgen push`: checkpoints to and from the Hugging Face Hub (aftgen.hub, aftgen.publish)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from aftgen.cli.common import command
from aftgen.errors import AftgenError


@command
def pull(
    repo_id: Annotated[str, typer.Argument(metavar="OWNER/NAME[@REV]", help="Hub model repository.")],
    revision: Annotated[str | None, typer.Option(help="Branch, tag or commit (default: main).")] = None,
) -> None:
    """Download a checkpoint into the Hugging Face cache; prints its folder on stdout."""
    from aftgen.hub import parse_hub_id
    from aftgen.hub import pull as pull_checkpoint

    parsed = parse_hub_id(repo_id)
    if parsed and parsed[1]:  # OWNER/NAME@REV, the spelling --model takes
        if revision:
            raise AftgenError("give the revision once: OWNER/NAME@REV or --revision REV")
        repo_id, revision = parsed
    print(pull_checkpoint(repo_id, revision))


@command
def push(
    run_dir: Annotated[Path, typer.Argument(help="Run or checkpoint folder to upload.")],
    repo_id: Annotated[str, typer.Argument(metavar="OWNER/NAME", help="Hub model repository (created if needed).")],
    private: Annotated[bool, typer.Option(help="Create the repository as private.")] = False,
    revision: Annotated[
        str | None, typer.Option(help="Branch to commit to (created if needed; default: main).")
    ] = None,
    include_training_state: Annotated[
        bool, typer.Option(help="Also upload the optimiser state and training.json, so others can --resume.")
    ] = False,
) -> None:
    """Upload a checkpoint and a generated model card to the Hub; prints the commit URL on stdout."""
    from aftgen.publish import push as push_checkpoint

    print(push_checkpoint(run_dir, repo_id, private, revision, include_training_state))
