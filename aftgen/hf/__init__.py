"""What lets Hugging Face transformers load an aftgen checkpoint: its "custom models" convention.

A checkpoint folder (and a pushed repo) holds, beside aftgen's own files, three Python files copied from this
package (configuration_aftgen.py, modeling_aftgen.py, tokenization_aftgen.py: torch, transformers and
sentencepiece only, no aftgen) and, in config.json and tokenizer_config.json, an `auto_map` naming their
classes. Then

    AutoModelForCausalLM.from_pretrained(folder_or_repo, trust_remote_code=True)
    AutoTokenizer.from_pretrained(folder_or_repo, trust_remote_code=True)

read the same model.safetensors and tokenizer.model that aftgen reads. aftgen itself ignores the keys added
here (TRANSFORMERS_KEYS). Importing this package imports no transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

from aftgen.files import atomic_write, own_source

TOKENIZER_CONFIG = "tokenizer_config.json"
SOURCES = ("configuration_aftgen.py", "modeling_aftgen.py", "tokenization_aftgen.py")
AUTO_MAP = {
    "AutoConfig": "configuration_aftgen.AftgenConfig",
    "AutoModelForCausalLM": "modeling_aftgen.AftgenForCausalLM",
    "AutoTokenizer": ["tokenization_aftgen.AftgenTokenizer", None],
}
ARCHITECTURES = ["AftgenForCausalLM"]
TRANSFORMERS_KEYS = ("auto_map", "architectures", "bos_token_id")  # config.json's keys for transformers alone


def transformers_keys(bos_id: int) -> dict:
    """The keys config.json adds for transformers: where its classes are, and the BOS a generation starts from."""
    return {"auto_map": AUTO_MAP, "architectures": ARCHITECTURES, "bos_token_id": bos_id}


def files() -> dict[str, bytes]:
    """Each file transformers reads beside config.json, by name: the Python files as this package holds them, and
    tokenizer_config.json (AutoTokenizer finds its class there alone)."""
    tokenizer_config = {"tokenizer_class": "AftgenTokenizer", "auto_map": {"AutoTokenizer": AUTO_MAP["AutoTokenizer"]}}
    sources = {name: own_source(Path(__file__).parent / name) for name in SOURCES}
    return {TOKENIZER_CONFIG: (json.dumps(tokenizer_config, indent=2) + "\n").encode(), **sources}


def write_files(directory: Path) -> None:
    """Write them beside a checkpoint's weights, each atomically."""
    for name, content in files().items():
        atomic_write(directory / name, content)
