"""Model cards: the README.md of a checkpoint, in the Hugging Face Hub's format (YAML header, then Markdown)."""

from __future__ import annotations

from pathlib import Path

from aftgen.curves import CURVES
from aftgen.model import AFTConfig
from aftgen.record import read_run_files

# What a transformers user writes (aftgen.hf: the files that make it work).
TRANSFORMERS_USE = [
    "```python",
    "from transformers import AutoModelForCausalLM, AutoTokenizer",
    'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_HUB_ID", trust_remote_code=True)',
    'model = AutoModelForCausalLM.from_pretrained("PATH_OR_HUB_ID", trust_remote_code=True)',
    "```",
    "",
]


def model_card(config: AFTConfig, info: dict, metrics: list[dict], sample: str = "", curves: bool = False) -> str:
    """A Hub-style README.md for a run; `curves`: the folder holds curves.png, shown under the table."""
    last = metrics[-1] if metrics else {}
    final = info.get("final_eval") or {}
    lines = [
        *_metadata(info.get("base_model") or {}),
        f"# {info.get('name', 'aftgen model')}",
        "",
        "A causal AFT-local language model (Attention Free Transformer, Zhai et al. 2021) trained with",
        "aftgen. It generates through a recurrent decoder whose memory and per-token cost stay constant",
        "however long the context grows.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {info.get('parameters', '?'):,} |"
        if isinstance(info.get("parameters"), int)
        else "| parameters | ? |",
        f"| layers / width / heads | {config.n_layer} / {config.n_embd} / {config.n_head} |",
        f"| mixer / window / training length | {config.mixer} / {config.window} / {config.context_length} tokens |",
        f"| vocabulary | {config.vocab_size} ({info.get('tokenizer_type', '?')}) |",
        f"| steps / wall time | {info.get('step', '?')} / {info.get('elapsed', 0):.0f} s |",
    ]
    base = info.get("base_model")
    if base:
        lines.append(f"| fine-tuned from | {base['model']} (weights sha256 {base['weights_sha256'][:12]}) |")
    best, options = info.get("best"), info.get("options", {})
    if options.get("ema"):
        lines.append(f"| weights | an exponential moving average of the training weights, decay {options['ema']} |")
    if best and options.get("keep_best"):
        lines.append(f"| weights kept | step {best['step']}: the best held-out check during training |")
    if final:
        lines.append(
            f"| held-out ({info.get('held_out', {}).get('summary', 'last 10%')}) | "
            f"{final['nats_per_char']:.4f} nats/char, {final['bits_per_char']:.4f} bits/char |"
        )
    elif last:
        lines.append(f"| held-out (quick eval) | {last['held_out_nats_per_char']:.4f} nats/char |")
    if curves:
        lines += ["", f"![Training curves: loss, held-out nats/char and learning rate]({CURVES})"]
    lines += ["", "Trained with:", "", "```", info.get("command", "aftgen train ..."), "```", ""]
    lines += ["Use it:", "", "```", 'aftgen sample --model PATH_OR_HUB_ID --prompt "..."', "```", ""]
    lines += ["or in Hugging Face transformers (its files are beside the weights; no aftgen needed):", ""]
    lines += TRANSFORMERS_USE
    if sample:
        lines += ["A sample:", "", "```", sample, "```", ""]
    return "\n".join(lines)


def _metadata(base_model: dict) -> list[str]:
    """The card's YAML header: what the Hub filters and links by (base_model names a Hub repo)."""
    header = ["---", "library_name: aftgen", "license: mit", "pipeline_tag: text-generation"]
    header.append("tags: [aftgen, attention-free-transformer, text-generation]")
    if base_model.get("hub_id"):
        header.append(f"base_model: {base_model['hub_id']}")
    return [*header, "---"]


def run_card(folder: Path, config: AFTConfig, sample: str = "") -> str:
    """The model card of the run in `folder`, from its training.json and metrics.jsonl (either may be absent)."""
    info, metrics = read_run_files(folder)
    return model_card(config, info, metrics, sample, curves=(folder / CURVES).is_file())
