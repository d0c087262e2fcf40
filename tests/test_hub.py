"""pull / push / --model OWNER/NAME through huggingface_hub's real code, against a local fake Hub."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from fake_hub import STORAGE_PREFIX, FakeHub, sha256
from hub_users import TOKEN, aftgen, aftgen_session, hub_env
from packaging.requirements import Requirement
from packaging.version import Version
from typer.testing import CliRunner

from aftgen.checkpoint import CHECKPOINT_FILES
from aftgen.cli import app
from aftgen.errors import AftgenError
from aftgen.hub import parse_hub_id, resolve_model

ROOT = Path(__file__).parent.parent
SAMPLE = ["-p", "KING:", "-n", "30", "--seed", "3"]


def checkpoint_files(run: Path) -> dict[str, bytes]:
    return {name: (run / name).read_bytes() for name in CHECKPOINT_FILES}


def storage_paths(*contents: bytes) -> set[str]:
    """Where the fake Hub's LFS storage keeps these contents."""
    return {STORAGE_PREFIX + sha256(content) for content in contents}


@pytest.fixture(scope="module")
def local_sample(tiny_run) -> str:
    """What `sample` prints for the tiny run read from its folder: a model pulled from the Hub must print the same."""
    local = CliRunner().invoke(app, ["sample", "--model", str(tiny_run), *SAMPLE])
    assert local.exit_code == 0, local.output
    return local.stdout


@pytest.fixture(scope="module")
def hub(tiny_run):
    """A Hub holding alice/tiny (the tiny run) and some repos that are not usable aftgen checkpoints."""
    with FakeHub(token=TOKEN) as server:
        plant = {
            "alice/tiny": checkpoint_files(tiny_run),
            "bob/gpt2": {"config.json": b'{"model_type": "gpt2", "n_layer": 12}', "model.safetensors": b"\0" * 64},
            "bob/broken-config": checkpoint_files(tiny_run) | {"config.json": b'{"model_type": "aftgen",'},
            "bob/broken-weights": checkpoint_files(tiny_run) | {"model.safetensors": b"not safetensors at all"},
        }
        for repo_id, files in plant.items():
            server.create_repo(repo_id)
            server.commit(repo_id, "main", files)
        yield server


def test_push_pull_and_sample_by_hub_id_then_offline(tmp_path, tiny_run, local_sample):
    with FakeHub(token=TOKEN) as server:
        env = hub_env(server, tmp_path / "hf")
        pushed, pulled, by_id = aftgen_session(
            env,
            ["push", str(tiny_run), "carol/tiny"],
            ["pull", "carol/tiny"],
            ["sample", "--model", "carol/tiny", *SAMPLE],
        )
        assert pushed.returncode == 0, pushed.stderr
        assert pushed.stdout.strip().startswith(f"{server.url}/carol/tiny/commit/")
        uploaded = server.files("carol/tiny")
        assert {"config.json", "model.safetensors", "tokenizer.model", "README.md", "metrics.jsonl"} <= set(uploaded)
        assert not {"training_state.safetensors", "training.json"} & set(uploaded)  # optimiser state stays home
        weights, tokenizer = (tiny_run / "model.safetensors").read_bytes(), (tiny_run / "tokenizer.model").read_bytes()
        assert uploaded["model.safetensors"] == weights
        # As on the Hub, whose .gitattributes sends *.safetensors and *.model to Git LFS: those two went to the
        # storage through the LFS batch API and are lfsFile lines in the commit; the rest went inline.
        assert server.lfs_files("carol/tiny") == {"model.safetensors", "tokenizer.model"}
        assert {path for method, path in server.requests if method == "PUT"} == storage_paths(weights, tokenizer)
        card = uploaded["README.md"].decode()
        assert "library_name: aftgen" in card and "A sample:" in card and "held-out" in card

        assert pulled.returncode == 0, pulled.stderr
        folder = Path(pulled.stdout.strip())
        assert folder.is_relative_to(tmp_path / "hf" / "hub") and (folder / "model.safetensors").read_bytes() == weights
        # The cache names an LFS blob by its sha256, which only the X-Linked-Etag of the /resolve redirect carries.
        assert (folder / "model.safetensors").resolve().name == sha256(weights)

        assert by_id.returncode == 0, by_id.stderr
        assert by_id.stdout == local_sample
    # The server is gone: the cache serves the model, with HF_HUB_OFFLINE and without it.
    offline = aftgen({**env, "HF_HUB_OFFLINE": "1"}, "sample", "--model", "carol/tiny", *SAMPLE)
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == local_sample
    unreachable = aftgen(env, "sample", "--model", "carol/tiny", *SAMPLE)
    assert unreachable.returncode == 0, unreachable.stderr
    assert unreachable.stdout == local_sample


def test_push_options(hub, tmp_path, tiny_run):
    """--include-training-state, --revision, --private, and a curated folder keeping its own card."""
    curated = tmp_path / "curated"
    curated.mkdir()
    for name in CHECKPOINT_FILES:
        shutil.copy(tiny_run / name, curated)
    (curated / "README.md").write_text("---\nlibrary_name: aftgen\n---\n# Hand-written card\n")
    env = hub_env(hub, tmp_path / "hf")
    first_request = len(hub.requests)
    done, pulled, kept = aftgen_session(
        env,
        ["push", str(tiny_run), "dave/resumable", "--revision", "dev", "--include-training-state", "--private"],
        ["pull", "dave/resumable@dev"],
        ["push", str(curated), "dave/curated"],
    )
    assert kept.returncode == 0, kept.stderr
    assert hub.files("dave/curated")["README.md"] == (curated / "README.md").read_bytes()
    assert hub.lfs_files("dave/curated") == {"model.safetensors", "tokenizer.model"}
    assert done.returncode == 0, done.stderr
    assert hub.repos["dave/resumable"].private
    on_dev = hub.files("dave/resumable", "dev")
    training_state = (tiny_run / "training_state.safetensors").read_bytes()
    assert on_dev["training_state.safetensors"] == training_state
    stored_as_lfs = {"model.safetensors", "tokenizer.model", "training_state.safetensors"}
    assert hub.lfs_files("dave/resumable", "dev") == stored_as_lfs
    # The weights and tokenizer were in the storage already (alice/tiny holds them): the batch API answered
    # without upload actions, and only the optimiser state travelled.
    assert {path for method, path in hub.requests[first_request:] if method == "PUT"} == storage_paths(training_state)
    assert json.loads(on_dev["training.json"])["step"] == 40
    assert set(hub.files("dave/resumable", "main")) == {".gitattributes"}  # --revision committed to the branch only
    anonymous = aftgen(hub_env(hub, tmp_path / "anonymous", HF_TOKEN=""), "pull", "dave/resumable@dev")
    assert anonymous.returncode == 2 and "no such model repository" in anonymous.stderr  # private: needs HF_TOKEN
    assert pulled.returncode == 0, pulled.stderr
    assert (Path(pulled.stdout.strip()) / "config.json").is_file()


def test_pull_fetches_only_the_checkpoint_and_its_card(hub, tmp_path, tiny_run, local_sample):
    """Whatever else a repo holds (optimiser state, other weights, a big file) stays on the Hub."""
    wanted = {**checkpoint_files(tiny_run), "README.md": b"---\nlibrary_name: aftgen\n---\n# Tiny\n"}
    extras = {
        "training_state.safetensors": (tiny_run / "training_state.safetensors").read_bytes(),
        "training.json": (tiny_run / "training.json").read_bytes(),
        "other.bin": bytes(range(256)) * 64,
        "checkpoints/step-20/model.safetensors": b"\1" * (4 << 20),
        "docs/README.md": b"# not the model card\n",
    }
    hub.create_repo("erin/extras")
    hub.commit("erin/extras", "main", wanted | extras)
    first_request = len(hub.requests)
    pulled, by_id = aftgen_session(
        hub_env(hub, tmp_path / "hf"), ["pull", "erin/extras"], ["sample", "--model", "erin/extras", *SAMPLE]
    )
    assert pulled.returncode == 0, pulled.stderr
    folder = Path(pulled.stdout.strip())
    assert {path.relative_to(folder).as_posix() for path in folder.rglob("*") if not path.is_dir()} == set(wanted)
    assert all((folder / name).read_bytes() == content for name, content in wanted.items())
    assert len(list((folder.parent.parent / "blobs").iterdir())) == len(wanted)  # nothing else was stored
    log = hub.requests[first_request:]
    resolved = {path.split("/", 5)[5] for _, path in log if path.startswith("/erin/extras/resolve/")}
    assert resolved == set(wanted)  # the extras were not even looked up
    fetched_from_storage = {path for method, path in log if path.startswith(STORAGE_PREFIX)}
    assert fetched_from_storage == storage_paths(wanted["model.safetensors"], wanted["tokenizer.model"])
    assert by_id.returncode == 0, by_id.stderr
    assert by_id.stdout == local_sample


# Taken from this environment rather than at its floor: torch's oldest admitted wheel on PyPI is a CUDA build of
# gigabytes (the CPU builds come from PyTorch's own index).
KEPT_FROM_THE_ENVIRONMENT = "torch"


def floor_versions() -> list[str]:
    """pyproject.toml's dependencies pinned to their lowest admitted versions ('name==floor')."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11 reads TOML")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    pins = []
    for line in project["dependencies"]:
        requirement = Requirement(line)
        if requirement.name != KEPT_FROM_THE_ENVIRONMENT:
            (floor,) = [spec.version for spec in requirement.specifier if spec.operator == ">="]
            pins.append(f"{requirement.name}=={floor}")
    return pins


def floor_environment(folder: Path, pins: list[str]) -> Path:
    """A fresh virtual environment holding `pins` as pip resolves them, and this environment's torch (with what
    it needs); returns its python. aftgen runs from this source tree (PYTHONPATH)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / "bin" / "python"
    torch_needs = [need for need in importlib.metadata.requires(KEPT_FROM_THE_ENVIRONMENT) if "extra ==" not in need]
    command = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", *pins, *torch_needs]
    installed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    links = folder / "kept"  # torch's own folders alone, seen through a .pth file
    links.mkdir()
    for top in {file.parts[0] for file in importlib.metadata.distribution(KEPT_FROM_THE_ENVIRONMENT).files}:
        if top != "..":
            (links / top).symlink_to(Path(importlib.metadata.distribution("torch").locate_file(top)))
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (Path(site) / "kept.pth").write_text(f"{links}\n")
    return python


def test_the_dependency_floors_in_pyproject_work(tmp_path, tiny_run, local_sample):
    """A fresh environment with the lowest versions pyproject.toml admits: every command's --help, and push, pull,
    sample by Hub id and a Hub error against the fake Hub, as with the newest versions."""
    pins = floor_versions()
    python = floor_environment(tmp_path / "floors", pins)
    floor = dict(pin.split("==") for pin in pins)
    probe = "import importlib.metadata as m, json, sys; print(json.dumps([m.version(n) for n in sys.argv[1:]]))"
    ran = subprocess.run([python, "-c", probe, *floor], capture_output=True, text=True, check=True)
    assert [Version(found) for found in json.loads(ran.stdout)] == [Version(v) for v in floor.values()]
    with FakeHub(token=TOKEN) as server:
        env = hub_env(server, tmp_path / "hf", PYTHONPATH=str(ROOT))
        commands = [[name, "--help"] for name in typer.main.get_command(app).commands]
        commands += [["push", str(tiny_run), "carol/tiny"], ["pull", "carol/tiny"], ["pull", "carol/nope"]]
        commands.append(["sample", "--model", "carol/tiny", *SAMPLE])
        *helps, pushed, pulled, missing, by_id = aftgen_session(env, *commands, python=python)
    assert all(done.returncode == 0 and "Usage" in done.stdout for done in helps), [d.stderr for d in helps]
    assert pushed.returncode == 0, pushed.stderr
    assert pulled.returncode == 0 and (Path(pulled.stdout.strip()) / "config.json").is_file(), pulled.stderr
    assert_one_line_error(missing, "carol/nope: no such model repository")
    assert by_id.returncode == 0 and by_id.stdout == local_sample, by_id.stderr


ERRORS = {
    "repo": (["pull", "alice/nope"], "alice/nope: no such model repository"),
    "revision": (["sample", "-m", "alice/tiny@nope"], "has no revision 'nope'"),
    "not-aftgen": (["pull", "bob/gpt2"], "bob/gpt2/config.json: model_type is 'gpt2', not 'aftgen'"),
    "bad-config": (["sample", "-m", "bob/broken-config"], "bob/broken-config/config.json: not valid JSON"),
    "bad-weights": (["sample", "-m", "bob/broken-weights"], "cannot read weights"),
    "push-no-run": (["push", "nowhere", "alice/x"], "nowhere: no such checkpoint folder"),
}


@pytest.fixture(scope="module")
def error_outcomes(hub, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    env = hub_env(hub, tmp_path_factory.mktemp("hf"))
    return dict(zip(ERRORS, aftgen_session(env, *(args for args, _ in ERRORS.values())), strict=True))


def assert_one_line_error(done: subprocess.CompletedProcess, message: str) -> None:
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert done.stderr.startswith("error: ") and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


@pytest.mark.parametrize("case", ERRORS)
def test_errors_are_one_line_and_exit_2(error_outcomes, case):
    assert_one_line_error(error_outcomes[case], ERRORS[case][1])


def test_offline_and_not_cached_is_one_line_from_the_real_entry_point(hub, tmp_path):
    done = aftgen(hub_env(hub, tmp_path / "hf", HF_HUB_OFFLINE="1"), "sample", "-m", "alice/tiny")
    assert_one_line_error(done, "alice/tiny: not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE is set" in done.stderr


def test_model_spec_local_folder_wins_and_hub_ids_are_recognised(tmp_path, monkeypatch):
    assert parse_hub_id("alice/tiny") == ("alice/tiny", None)
    assert parse_hub_id("alice/tiny@v1.0") == ("alice/tiny", "v1.0")
    assert parse_hub_id("runs") is None and parse_hub_id("/abs/path") is None and parse_hub_id("a/b/c") is None
    (tmp_path / "alice" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("alice/tiny") == Path("alice/tiny")  # an existing folder is never looked up online
    with pytest.raises(AftgenError, match="no such checkpoint folder"):
        resolve_model("not-here")
