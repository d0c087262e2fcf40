"""Model cards: the README.md of a checkpoint, in the Hugging Face Hub's format (YAML header, then Markdown)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from aftgen.curves import CURVES
from aftgen.model import AFTConfig
from aftgen.record import BaseModelRecord, RunInfo, read_run_files

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
    """A Hub-style README.md for a run (`info`: what training.json holds, checked as read_run_files checks it);
    `curves`: the folder holds curves.png, shown under the table."""
    last = metrics[-1] if metrics else {}
    run = msgspec.convert(info, RunInfo)
    base, final, best, options = run.base_model, run.final_eval, run.best, run.options
    lines = [
        *_metadata(base),
        f"# {run.name}",
        "",
        "A causal AFT-local language model (Attention Free Transformer, Zhai et al. 2021) trained with",
        "aftgen. It generates through a recurrent decoder whose memory and per-token cost stay constant",
        "however long the context grows.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {run.parameters:,} |" if run.parameters is not None else "| parameters | ? |",
        f"| layers / width / heads | {config.n_layer} / {config.n_embd} / {config.n_head} |",
        f"| mixer / window / training length | {config.mixer} / {config.window} / {config.context_length} tokens |",
        f"| vocabulary | {config.vocab_size} ({run.tokenizer_type or '?'}) |",
        f"| steps / wall time | {'?' if run.step is None else run.step} / {run.elapsed:.0f} s |",
    ]
    if base:
        lines.append(f"| fine-tuned from | {base.model} (weights sha256 {base.weights_sha256[:12]}) |")
    if options.ema:
        lines.append(f"| weights | an exponential moving average of the training weights, decay {options.ema} |")
    if best and options.keep_best:
        lines.append(f"| weights kept | step {best.step}: the best held-out check during training |")
    if final:
        lines.append(
            f"| held-out ({run.held_out.summary}) | "
            f"{final.nats_per_char:.4f} nats/char, {final.bits_per_char:.4f} bits/char |"
        )
    elif last:
        lines.append(f"| held-out (quick eval) | {last['held_out_nats_per_char']:.4f} nats/char |")
    if curves:
        lines += ["", f"![Training curves: loss, held-out nats/char and learning rate]({CURVES})"]
    lines += ["", "Trained with:", "", "```", run.command, "```", ""]
    lines += ["Use it:", "", "```", 'aftgen sample --model PATH_OR_HUB_ID --prompt "..."', "```", ""]
    lines += ["or in Hugging Face transformers (its files are beside the weights; no aftgen needed):", ""]
    lines += TRANSFORMERS_USE
    if sample:
        lines += ["A sample:", "", "```", sample, "```", ""]
    return "\n".join(lines)


def _metadata(base_model: BaseModelRecord | None) -> list[str]:
    """The card's YAML header: what the Hub filters and links by (base_model names a Hub repo)."""
    header = ["---", "library_name: aftgen", "license: mit", "pipeline_tag: text-generation"]
    header.append("tags: [aftgen, attention-free-transformer, text-generation]")
    if base_model and base_model.hub_id:
        header.append(f"base_model: {base_model.hub_id}")
    return [*header, "---"]


def run_card(folder: Path, config: AFTConfig, sample: str = "") -> str:
    """The model card of the run in `folder`, from its training.json and metrics.jsonl (either may be absent)."""
    info, metrics = read_run_files(folder)
    return model_card(config, info, metrics, sample, curves=(folder / CURVES).is_file())
