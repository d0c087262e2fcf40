"""An aftgen model's config.json as Hugging Face transformers reads it (trust_remote_code=True).

Written by aftgen beside the weights; imports only transformers. The fields are aftgen's own (aftgen/model.py's
AFTConfig); transformers' usual names (hidden_size, num_hidden_layers, ...) map onto them.
"""

from transformers import PretrainedConfig


class AftgenConfig(PretrainedConfig):
    """A causal Attention Free Transformer: pre-LayerNorm blocks of an AFT mixer and an MLP, tied embeddings."""

    model_type = "aftgen"
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head"}

    vocab_size: int = 1024
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    window: int = 32
    context_length: int = 256
    mixer: str = "aft_local"
    decay: bool = True
    dropout: float = 0.0
    mlp_ratio: int = 4
    activation: str = "gelu"  # a config.json without one is GELU (aftgen's older models)
    format_version: int = 1
    bos_token_id: int | None = 1
    tie_word_embeddings: bool = True
    use_cache: bool = True
    dtype: str | None = "float32"  # aftgen computes in float32 whatever the file stores (fp16 halves it)
