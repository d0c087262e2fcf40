"""The AFT formula's three forms agree: chunked parallel form == step form == the naive O(T^2) formula."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, on_device

from aftgen.errors import AftgenError
from aftgen.mixers.aft import AFTMixer, aft_naive, aft_parallel, aft_step, empty_state, soft_cap, step_tables
from aftgen.model import ACTIVATIONS, AFTLM, AFTConfig


def random_inputs(B=2, T=40, H=3, D=4, s=5, seed=0, key_scale=3.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = on_device(torch.randn(3, B, T, H, D, generator=g)).unbind(0)
    w = soft_cap(on_device(torch.randn(H, s, generator=g)) * 2)
    decay = on_device(torch.rand(H, generator=g)) * 0.3
    return q, soft_cap(k * key_scale), v, w, decay


@pytest.mark.parametrize("s,T,chunk", [(5, 40, 8), (0, 21, 4), (8, 50, 8), (3, 9, 16), (6, 64, 6), (4, 33, 64)])
def test_parallel_matches_naive(s, T, chunk):
    q, k, v, w, decay = random_inputs(T=T, s=s)
    y, _ = aft_parallel(q, k, v, w, decay, chunk=chunk)
    assert (y.double() - aft_naive(q, k, v, w, decay)).abs().max() < 1e-5


@pytest.mark.parametrize("s", [0, 1, 5])
def test_step_matches_naive(s):
    q, k, v, w, decay = random_inputs(T=30, s=s)
    state = empty_state(2, 3, 4, s, device=DEVICE)
    tables = step_tables(w, decay)
    ys = torch.stack([aft_step(q[:, t], k[:, t], v[:, t], tables, state) for t in range(30)], dim=1)
    assert (ys.double() - aft_naive(q, k, v, w, decay)).abs().max() < 1e-5
    assert state["position"].tolist() == [30, 30]  # each row's own count


def test_zero_decay_is_the_papers_aft_local():
    q, k, v, w, _ = random_inputs(T=30, s=4)
    decay = on_device(torch.zeros(3))
    y, _ = aft_parallel(q, k, v, w, decay, chunk=8)
    # Beyond the window every token weighs exp(k): check position 29 by hand.
    t, weights = 29, on_device(torch.ones(30, 3))
    weights[t - 3 : t + 1] = torch.exp(w.flip(1)).T
    e = torch.exp(k[0, : t + 1]) * weights[:, :, None]
    expected = torch.sigmoid(q[0, t]) * (e * v[0, : t + 1]).sum(0) / e.sum(0)
    assert torch.allclose(y[0, t], expected, atol=1e-5)


def test_state_carries_across_chunks():
    q, k, v, w, decay = random_inputs(T=45, s=6)
    whole, _ = aft_parallel(q, k, v, w, decay, chunk=8)
    state, parts = None, []
    for lo, hi in [(0, 7), (7, 8), (8, 30), (30, 45)]:
        y, state = aft_parallel(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], w, decay, 8, state, return_state=True)
        parts.append(y)
    assert (torch.cat(parts, 1) - whole).abs().max() < 1e-5
    # ...and the step form picks up from a state the parallel form wrote.
    stepped = empty_state(2, 3, 4, 6, device=DEVICE)
    for t in range(45):
        aft_step(q[:, t], k[:, t], v[:, t], step_tables(w, decay), stepped)
    for name in ("window_exp_k", "window_v", "position"):
        assert torch.allclose(state[name].float(), stepped[name].float(), atol=1e-6)
    true_prefix = stepped["prefix_num"] * torch.exp(stepped["prefix_max"])
    assert torch.allclose(state["prefix_num"] * torch.exp(state["prefix_max"]), true_prefix, rtol=1e-4, atol=1e-6)


READ = [0, 1, 3, 4]  # tokens each row has read before stepping beside the others: four phases of a 5-slot ring


def rows_at_their_phases(q, k, v, tables, s: int) -> list[dict]:
    """Batch-1 states of rows that have read READ[row] tokens each, stepped alone."""
    H, D = q.shape[-2:]
    alone = []
    for row, count in enumerate(READ):
        state = empty_state(1, H, D, s, device=DEVICE)
        for t in range(count):
            aft_step(q[row : row + 1, t], k[row : row + 1, t], v[row : row + 1, t], tables, state)
        alone.append(state)
    return alone


def stacked(states: list[dict]) -> dict:
    """The rows in one batch, as they are: each keeps its own position."""
    return {name: torch.cat([state[name] for state in states]) for name in states[0]}


def test_a_row_steps_to_the_same_bits_alone_and_beside_rows_at_other_phases_of_the_ring():
    """Each row keeps its own position: its window sits in the same slots, and is summed in the same order,
    alone as in a batch with rows that have read other numbers of tokens (issue 47)."""
    s, steps = 5, 12  # more steps than slots: every row passes every slot of its ring
    q, k, v, w, decay = random_inputs(B=len(READ), T=max(READ) + steps, H=4, D=8, s=s)
    tables = step_tables(w, decay)
    alone = rows_at_their_phases(q, k, v, tables, s)
    together = stacked(alone)
    for t in range(max(READ), max(READ) + steps):
        y = aft_step(q[:, t], k[:, t], v[:, t], tables, together)
        for row, state in enumerate(alone):
            own = aft_step(q[row : row + 1, t], k[row : row + 1, t], v[row : row + 1, t], tables, state)
            assert torch.equal(own[0], y[row]), (row, t)
    assert together["position"].tolist() == [count + steps for count in READ]


def test_the_parallel_form_continues_rows_at_other_phases_each_as_alone():
    s, T = 5, 7  # more tokens than slots: the window is read and rewritten at each row's phase
    q, k, v, w, decay = random_inputs(B=len(READ), T=max(READ) + T, s=s)
    alone = rows_at_their_phases(q, k, v, step_tables(w, decay), s)
    new = slice(max(READ), max(READ) + T)
    y, together = aft_parallel(q[:, new], k[:, new], v[:, new], w, decay, 4, stacked(alone), return_state=True)
    for row, state in enumerate(alone):
        rows = slice(row, row + 1)
        own, state = aft_parallel(q[rows, new], k[rows, new], v[rows, new], w, decay, 4, state, return_state=True)
        assert (own - y[rows]).abs().max() < 1e-6, row
        for name, tensor in state.items():
            assert torch.allclose(tensor.float(), together[name][rows].float(), atol=1e-6), (row, name)
    assert together["position"].tolist() == [count + T for count in READ]


def tiny_model(seed=0, **overrides) -> AFTLM:
    torch.manual_seed(seed)
    settings = dict(vocab_size=50, n_layer=2, n_embd=32, n_head=4, window=8, context_length=64) | overrides
    model = on_device(AFTLM(AFTConfig(**settings)).eval())
    with torch.no_grad():  # non-trivial biases and decays, so the test exercises them
        for block in model.blocks:
            block.mixer.w.normal_(0, 1.0)
            block.mixer.decay_logit.normal_(-3, 1.0)
    return model


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_model_parallel_equals_recurrent_over_1000_tokens(activation):
    model = tiny_model(activation=activation)
    ids = on_device(torch.randint(0, 50, (1, 1100), generator=torch.Generator().manual_seed(1)))
    with torch.inference_mode():
        parallel = model(ids)
        state = model.initial_state(1)
        stepped = torch.stack([model.step(ids[:, t], state)[0] for t in range(ids.shape[1])], dim=1)
    assert (parallel - stepped).abs().max() <= 1e-4


def test_gradients_reach_every_parameter():
    model = tiny_model().train()
    ids = on_device(torch.randint(0, 50, (2, 80)))
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(block.mixer.w.grad.abs().sum() > 0 for block in model.blocks)


def test_a_config_without_an_activation_is_a_gelu_model_as_before():
    saved = AFTConfig(vocab_size=50).to_dict()
    del saved["activation"]  # config.json of a model trained before the field
    assert AFTConfig.from_dict(saved).activation == "gelu"
    with pytest.raises(AftgenError, match="unknown activation 'swish'; choose one of: gelu, relu2"):
        AFTConfig.from_dict(saved | {"activation": "swish"})


def test_huge_keys_and_long_sequences_stay_finite():
    B, T, H, D, s = 1, 16_384, 2, 4, 32
    g = torch.Generator().manual_seed(4)
    q = on_device(torch.randn(B, T, H, D, generator=g)).requires_grad_()
    raw_k = on_device(torch.randn(B, T, H, D, generator=g) * 1e4).requires_grad_()
    v = on_device(torch.randn(B, T, H, D, generator=g)).requires_grad_()
    w = torch.full((H, s), -50.0, device=DEVICE, requires_grad=True)  # far below the cap, both ways
    decay = torch.tensor([0.0, 5.0], device=DEVICE, requires_grad=True)
    y, _ = aft_parallel(q, soft_cap(raw_k), v, soft_cap(w), decay, chunk=64)
    y.square().sum().backward()
    assert torch.isfinite(y).all()
    for tensor in (q, raw_k, v, w, decay):
        assert torch.isfinite(tensor.grad).all()
    state = empty_state(B, H, D, s, device=DEVICE)
    for t in range(200):
        out = aft_step(
            q[:, t].detach(),
            soft_cap(raw_k[:, t].detach()),
            v[:, t].detach(),
            step_tables(soft_cap(w.detach()), decay.detach()),
            state,
        )
        assert torch.isfinite(out).all()


def test_fresh_heads_range_from_the_last_token_to_the_whole_window():
    mixer = AFTMixer(n_embd=48, n_head=6, window=32, context_length=128, decay=True)
    share = torch.softmax(soft_cap(mixer.w.detach()), dim=-1)  # each head's weight over its window
    assert (mixer.w.diff(dim=-1) <= 0).all()  # no head favours older tokens over newer ones
    assert share[-1, 0] > 0.5  # the sharpest head mostly reads the newest token
    assert share[0, 0] < 0.2  # the broadest spreads over the window
    assert (mixer.w >= 0).all()  # never below the weight of what lies beyond the window


def test_weights_stored_in_bf16_generate_as_float32_ones_do_and_keep_the_trained_hash():
    """Generation on a CPU may store the matrices in bf16 (AFTLM.lower_weights): the logits stay close to the
    float32 model's, the step still agrees with the parallel form, and a state file still names the model
    it was trained as."""
    model = tiny_model().eval()
    ids = on_device(torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(2)))
    with torch.inference_mode():
        trained_hash, exact = model.weights_sha256(), model(ids)
        model.lower_weights(torch.bfloat16)
        lowered = model(ids)
        state = model.initial_state(2)
        stepped = torch.stack([model.step(ids[:, t], state)[0] for t in range(ids.shape[1])], dim=1)
    assert model.embed.weight.dtype == model.blocks[0].mlp.up.weight.dtype == torch.bfloat16
    assert model.blocks[0].mlp.up.bias.dtype == torch.float32
    assert model.weights_sha256() == trained_hash
    assert lowered.dtype == torch.float32
    torch.testing.assert_close(lowered, exact, rtol=0, atol=0.05)  # bf16 keeps 8 bits of each weight
    assert not torch.equal(lowered, exact)
    torch.testing.assert_close(stepped, lowered, rtol=1e-4, atol=1e-4)
