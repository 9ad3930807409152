"""float64 all the way through, and torch.autograd.gradcheck of the paths that have a backward
structure of their own (streams folded into the batch, the KV-mirror final-stream skip, TaH's
gathered depths, MoE dispatch): each analytical gradient equals the finite-difference one."""

import pytest
import torch
from torch.autograd.gradcheck import GradcheckError
from torch.func import functional_call

from generate import generate, generate_tah
from hd import HDConfig, HiddenDecoding, expand_streams
from moe import ModelConfig, Transformer, apply_rope
from tah import TaHConfig, ThinkAtHard, oracle_depths

TINY = dict(vocab_size=11, block_size=16, n_layer=3, n_embd=16, n_head=4, n_kv_head=2, head_dim=8,
            n_experts=4, top_k=2, expert_hidden=8, ffn_hidden=24)


def batch(seed, B=2, T=5, V=11):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(V, (B, T), generator=g), torch.randint(V, (B, T), generator=g)


def gradcheck_wrt(model, name, loss_of_model):
    """gradcheck of loss_of_model(model) as a function of the parameter called `name`. Fast mode
    compares u^T J v for random u, v (a central difference along v against the backward's
    vector-Jacobian product): a wrong gradient fails it almost surely, at the cost of two
    evaluations instead of two per weight."""
    w = dict(model.named_parameters())[name].detach().clone().requires_grad_(True)

    def f(w):
        return loss_of_model(lambda *a, **k: functional_call(model, {name: w}, a, k))
    assert torch.autograd.gradcheck(f, (w,), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)


# -----------------------------------------------------------------------------
# float64 is float64


def test_rope_of_a_float64_input_is_computed_in_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 8, dtype=torch.float64, generator=g)
    pos = torch.arange(7) * 1000 + 12345  # large positions: float32 angles would be off by ~1e-4
    out = apply_rope(x, pos, 4, 10000.0)
    assert out.dtype == torch.float64
    inv = 10000.0 ** (-torch.arange(2, dtype=torch.float64) / 2)
    ang = pos.double()[:, None] * inv
    x1, x2 = x[..., :2], x[..., 2:4]
    ref = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin(), x[..., 4:]], -1)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("n_experts", [0, 4])
def test_a_float64_backbone_runs_in_float64_with_the_default_dispatch(n_experts):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, "n_experts": n_experts})).double()
    idx, tgt = batch(0)
    logits, loss = model(idx, tgt)
    assert logits.dtype == loss.dtype == torch.float64
    out = generate(model, idx[:, :2], 3, temperature=0)
    assert out.shape == (2, 5)


@pytest.mark.parametrize("training", [True, False])
def test_expand_streams_keeps_dtype_and_mode(training):
    torch.manual_seed(0)
    model = HiddenDecoding(HDConfig(**TINY, n_streams=1, layout="IFI")).double().train(training)
    grown = expand_streams(model, 2)
    assert all(p.dtype == torch.float64 for p in grown.parameters())
    assert grown.training == training
    idx, tgt = batch(1)
    assert grown(idx, tgt)[1].dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_tah_decider_stage2_and_generate_run_in_the_weights_dtype_without_autocast(dtype):
    torch.manual_seed(0)
    model = ThinkAtHard(TaHConfig(**{**TINY, "n_experts": 0}, logit_topk=5)).to(dtype)
    idx, tgt = batch(2)
    out = model(idx, tgt, mode="decider")
    assert out.logits.dtype == dtype
    depths = oracle_depths(model(idx, mode="standard").logits, tgt, 2)
    loss, scores, labels = model.stage2_loss(idx, depths)
    assert torch.isfinite(loss) and scores.dtype == dtype
    tokens, d = generate_tah(model, idx[:, :2], 3, temperature=0)
    assert tokens.shape == (2, 5) and d.shape == (2, 4)


# -----------------------------------------------------------------------------
# gradcheck (float64): analytical gradients equal finite differences


def test_gradcheck_hd_intra_folded_into_the_batch():
    torch.manual_seed(0)
    model = HiddenDecoding(HDConfig(**{**TINY, "n_experts": 0}, n_streams=3, layout="III", mirror_skip=False)).double()
    idx, tgt = batch(3)
    for name in ("tables.1.weight", "backbone.blocks.1.attn.q_proj.weight"):
        gradcheck_wrt(model, name, lambda m: m(idx, tgt)[1])


def test_gradcheck_hd_kv_mirror_mirror_skip_on():
    torch.manual_seed(0)
    model = HiddenDecoding(HDConfig(**{**TINY, "n_experts": 0}, n_streams=2, layout="IFL", window=3,
                                    mirror_skip=True)).double()
    assert model.cfg.mirror_skip_on
    idx, tgt = batch(4)
    for name in ("tables.0.weight", "backbone.blocks.0.attn.k_proj.weight", "backbone.blocks.2.attn.k_proj.weight"):
        gradcheck_wrt(model, name, lambda m: m(idx, tgt)[1])


def test_gradcheck_tah_gathered_depths():
    torch.manual_seed(0)
    model = ThinkAtHard(TaHConfig(**{**TINY, "n_experts": 0}, logit_topk=5, max_depth=3)).double()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".B"):
                p.normal_(std=0.2)  # LoRA on, so depth >= 1 really differs
    idx, tgt = batch(5)
    depths = torch.tensor([[1, 3, 2, 1, 2], [2, 1, 1, 3, 1]])
    for name in ("backbone.wte.weight", "backbone.blocks.1.attn.q_proj.A"):
        gradcheck_wrt(model, name, lambda m: m(idx, tgt, mode="oracle", depths=depths).loss)


def test_gradcheck_moe_dispatch():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**TINY, moe_dispatch="loop")).double()
    idx, tgt = batch(6)
    for name in ("blocks.1.ffn.w_gate_up", "blocks.1.ffn.w_down", "blocks.1.ffn.router.weight"):
        gradcheck_wrt(model, name, lambda m: m(idx, tgt)[1])


def test_the_fast_gradcheck_fails_a_gradient_one_percent_off():
    """The check above can fail: the MoE's router gradient scaled by 1.01 on its way back."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**TINY, moe_dispatch="loop")).double()
    idx, tgt = batch(6)
    name = "blocks.1.ffn.router.weight"
    w = dict(model.named_parameters())[name].detach().clone().requires_grad_(True)

    def f(w):
        w = w + 0.0
        w.register_hook(lambda g: None if g is None else 1.01 * g)
        return functional_call(model, {name: w}, (idx, tgt))[1]
    with pytest.raises(GradcheckError):
        torch.autograd.gradcheck(f, (w,), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)
