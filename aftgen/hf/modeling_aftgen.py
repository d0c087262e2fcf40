"""An aftgen model in Hugging Face transformers (trust_remote_code=True): the same weights, the same numbers.

Written by aftgen beside model.safetensors; it imports only torch and transformers, since a transformers user
has no aftgen. The token mixer is causal AFT (Zhai et al. 2021, "An Attention Free Transformer"), per head h and
channel c, token t reading every token t' <= t:

    y_t = sigmoid(q_t) * sum_{t'<=t} exp(k_t' + b[h, t-t']) v_t' / sum_{t'<=t} exp(k_t' + b[h, t-t'])

with b[h, d] = w[h, d] inside the window (d < s) and -lambda_h (d - s + 1) beyond it; keys and w soft-capped
into (-KEY_CAP, KEY_CAP). aftgen's tests check `aft_read` against aftgen's mixer and its O(T^2) oracle.

`aft_read` is the one form: T tokens continuing a fixed-size state, the last s keys and values and
max-stabilised sums over everything older (RWKV's (a, b, p) trick: the true sums are num * exp(top)), as seen
from the next token. A whole text is read CHUNK tokens at a time, so memory is O(T); generation feeds one
token (T = 1) and carries the state from step to step, as transformers' RWKV does: per-token cost and memory
stay constant however long the text grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_aftgen import AftgenConfig

KEY_CAP = 10.0
EMPTY_KEY = -1e4  # the key of an empty window slot: exp(EMPTY_KEY) == 0 in float32
CHUNK = 64  # tokens read at once: each reads a (CHUNK, s + CHUNK) table of weights
WINDOW_FIELDS = {"aft_local": "window", "aft_simple": None, "aft_full": "context_length"}
ACTIVATIONS = {"gelu": F.gelu, "relu2": lambda x: F.relu(x).square()}

LayerState = dict[str, torch.Tensor]


def soft_cap(x: torch.Tensor, cap: float = KEY_CAP) -> torch.Tensor:
    """cap * tanh(x / cap), written as aftgen writes it (2 cap sigmoid(2 x / cap) - cap), for the same bits."""
    return (2 * cap) * torch.sigmoid(x * (2 / cap)) - cap


def bias_weights(w: torch.Tensor, decay: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """exp(b[h, d]) (H, *distance.shape) for distances d >= 0; w (H, s) soft-capped, decay lambda (H,)."""
    s, d = w.shape[1], distance.flatten()
    weight = torch.exp(-decay[:, None] * (d - s + 1).clamp(min=0))
    if s:
        weight = torch.where(d < s, torch.exp(w)[:, d.clamp(max=s - 1)], weight)
    return weight.view(-1, *distance.shape)


def empty_state(batch: int, heads: int, head_dim: int, window: int, device=None) -> LayerState:
    """The state before any token: an empty window (oldest first) and empty sums."""
    zeros = torch.zeros(batch, heads, head_dim, device=device)
    return {
        "keys": torch.full((batch, window, heads, head_dim), EMPTY_KEY, device=device),  # (B, s, H, D)
        "values": torch.zeros(batch, window, heads, head_dim, device=device),  # (B, s, H, D)
        "num": zeros,  # (B, H, D): sum of exp(k + b - top) v over the tokens older than the window
        "den": zeros.clone(),  # (B, H, D): sum of exp(k + b - top)
        "top": torch.full_like(zeros, EMPTY_KEY),  # (B, H, D): the stabiliser
    }


def aft_read(q, k, v, w: torch.Tensor, decay: torch.Tensor, state: LayerState) -> tuple[torch.Tensor, LayerState]:
    """y (B, T, H, D) of T tokens q, k, v (B, T, H, D) continuing `state`, and the state after them.

    k and w soft-capped, everything float32. Query i of the T sees the window and the new tokens through a
    (T, s + T) table of exp(b[distance]), and the older tokens' sums decayed by i more steps.
    """
    B, T, H, D = k.shape
    s = w.shape[1]
    keys, values = torch.cat([state["keys"], k], 1), torch.cat([state["values"], v], 1)  # (B, s + T, H, D)
    steps = torch.arange(T, device=k.device)
    distance = (s + steps)[:, None] - torch.arange(s + T, device=k.device)[None, :]  # (T, s + T)
    table = bias_weights(w, decay, distance.clamp(min=0)) * (distance >= 0)  # (H, T, s + T)
    weights = torch.exp(keys)
    num = torch.einsum("htj,bjhd->bthd", table, weights * values)
    den = torch.einsum("htj,bjhd->bthd", table, weights)
    older = torch.exp(state["top"][:, None] - decay[:, None] * steps[:, None, None])  # (B, T, H, D)
    num = num + older * state["num"][:, None]
    den = den + older * state["den"][:, None]
    return torch.sigmoid(q) * num / den, _advanced(keys, values, decay, state, T)


def _advanced(keys, values, decay: torch.Tensor, state: LayerState, T: int) -> LayerState:
    """The state after T more tokens: keys, values (B, s + T, H, D) keep their last s; the first T join the sums."""
    # Seen from the next token, leaving token j is at distance s + T - j: bias -lambda (T - j + 1).
    leaving = keys[:, :T] - decay[:, None] * torch.arange(T + 1, 1, -1, device=keys.device)[:, None, None]
    old_top = state["top"] - decay[:, None] * T
    top = torch.maximum(old_top, leaving.amax(1))  # (B, H, D)
    old_scale, scale = torch.exp(old_top - top), torch.exp(leaving - top[:, None])
    return {
        "keys": keys[:, T:],
        "values": values[:, T:],
        "num": state["num"] * old_scale + (scale * values[:, :T]).sum(1),
        "den": state["den"] * old_scale + scale.sum(1),
        "top": top,
    }


def aft_chunks(q, k, v, w, decay, state: LayerState, chunk: int = CHUNK) -> tuple[torch.Tensor, LayerState]:
    """aft_read over a whole sequence, `chunk` tokens at a time."""
    outputs = []
    for start in range(0, k.shape[1], chunk):
        part = slice(start, start + chunk)
        y, state = aft_read(q[:, part], k[:, part], v[:, part], w, decay, state)
        outputs.append(y)
    return torch.cat(outputs, 1), state


def window_of(config: AftgenConfig) -> int:
    """The mixer's window s: the window of AFT-local, none for AFT-simple, the training length for AFT-full."""
    if config.mixer not in WINDOW_FIELDS:
        raise ValueError(f"aftgen's '{config.mixer}' mixer has no transformers form; choose an AFT mixer")
    field = WINDOW_FIELDS[config.mixer]
    return getattr(config, field) if field else 0


class AftgenMixer(nn.Module):
    def __init__(self, config: AftgenConfig):
        super().__init__()
        self.n_head, self.head_dim, self.learn_decay = config.n_head, config.n_embd // config.n_head, config.decay
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.w = nn.Parameter(torch.zeros(config.n_head, window_of(config)))  # (H, s)
        self.decay_logit = nn.Parameter(torch.zeros(config.n_head))  # lambda = softplus(decay_logit)

    def decay(self) -> torch.Tensor:
        if not self.learn_decay:
            return torch.zeros_like(self.decay_logit, dtype=torch.float32)
        return F.softplus(self.decay_logit.float())

    def initial_state(self, batch: int, device) -> LayerState:
        return empty_state(batch, self.n_head, self.head_dim, self.w.shape[1], device)

    def forward(self, x: torch.Tensor, state: LayerState) -> tuple[torch.Tensor, LayerState]:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.n_head, self.head_dim)).unbind(-3)  # (B, T, H, D)
        y, state = aft_chunks(q.float(), soft_cap(k.float()), v.float(), soft_cap(self.w.float()), self.decay(), state)
        return self.proj(y.to(x.dtype).flatten(-2)), state


class AftgenMLP(nn.Module):
    def __init__(self, config: AftgenConfig):
        super().__init__()
        self.up = nn.Linear(config.n_embd, config.mlp_ratio * config.n_embd)
        self.proj = nn.Linear(config.mlp_ratio * config.n_embd, config.n_embd)
        self.activation = ACTIVATIONS[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.activation(self.up(x)))


class AftgenBlock(nn.Module):
    def __init__(self, config: AftgenConfig):
        super().__init__()
        self.ln_mix = nn.LayerNorm(config.n_embd)
        self.mixer = AftgenMixer(config)
        self.ln_mlp = nn.LayerNorm(config.n_embd)
        self.mlp = AftgenMLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, state: LayerState) -> tuple[torch.Tensor, LayerState]:
        mixed, state = self.mixer(self.ln_mix(x), state)
        x = x + self.dropout(mixed)
        return x + self.dropout(self.mlp(self.ln_mlp(x))), state


@dataclass
class AftgenCausalLMOutput(ModelOutput):
    """logits (B, T, vocab); `state`: each layer's recurrent state after the tokens read, to continue from."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    state: list[LayerState] | None = None


class AftgenPreTrainedModel(PreTrainedModel):
    config_class = AftgenConfig
    base_model_prefix = "aftgen"
    _no_split_modules = ["AftgenBlock"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, AftgenMixer):  # aftgen's training starts them otherwise; a model loads them
            module.w.zero_()
            module.decay_logit.fill_(-3.0)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the state below is the cache: a KV cache would grow with the text


class AftgenForCausalLM(AftgenPreTrainedModel, GenerationMixin):
    """The aftgen language model. With a `state` (returned by the previous call) only the new tokens are read."""

    _tied_weights_keys = {"lm_head.weight": "embed.weight"}

    def __init__(self, config: AftgenConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(AftgenBlock(config) for _ in range(config.n_layer))
        self.ln_out = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # tied to embed
        self.dropout = nn.Dropout(config.dropout)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def initial_state(self, batch: int) -> list[LayerState]:
        device = self.embed.weight.device
        return [block.mixer.initial_state(batch, device) for block in self.blocks]

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        state: list[LayerState] | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs,
    ) -> AftgenCausalLMOutput | tuple:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if state is None:
            _refuse_left_padding(attention_mask)
            state = self.initial_state(x.shape[0])
        x = self.dropout(x)
        new_state = []
        for block, layer_state in zip(self.blocks, state, strict=True):
            x, layer_state = block(x, layer_state)
            new_state.append(layer_state)
        x = x[:, -logits_to_keep:] if logits_to_keep else x
        logits = self.lm_head(self.ln_out(x))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        keep_state = use_cache if use_cache is not None else self.config.use_cache
        output = AftgenCausalLMOutput(loss=loss, logits=logits, state=new_state if keep_state else None)
        return output if return_dict is not False else output.to_tuple()

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=1):
        if outputs.get("state") is not None:  # generate() then feeds only the new token (next_sequence_length 1)
            model_kwargs["state"] = outputs.state
        return super()._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder, num_new_tokens)


def _refuse_left_padding(attention_mask: torch.Tensor | None) -> None:
    """A padded token would be read into the state: padding on the right (after every real token) changes no real
    token's numbers, padding on the left would."""
    if attention_mask is not None and attention_mask.shape[-1] > 1 and (attention_mask.diff(dim=-1) > 0).any():
        raise ValueError("aftgen models cannot read left-padded input: pad on the right or give one row at a time")
