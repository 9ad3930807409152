"""Property tests of the backbone (moe.py): each compares with an independent reference.

References used: a per-token loop over the MoE definition, a per-pair loop over the RoPE
rotation, a hand-written masked softmax, and full forwards over each prefix.
"""

import math
from contextlib import contextmanager
from dataclasses import fields, replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from torch._dynamo.testing import CompileCounter
from torch.autograd.gradcheck import GradcheckError
from torch.func import functional_call
from torch.nn.attention.flex_attention import create_block_mask

import moe
from checks import HD, MODEL, TAH, parameters
from conftest import F64, FAST, cuda, examples, f64_batch, gradcheck_wrt, tiny
from generate import generate, make_caches, sample
from hd import HDConfig, HiddenDecoding, expand_streams, local
from moe import MoE, ModelConfig, Transformer, apply_rope, attend, attend_folded, causal, dense_mask
from tah import TaHConfig, ThinkAtHard



def small_cfg(**kw):
    return tiny("moe", **{**dict(block_size=64, head_dim=8, ffn_hidden=48), **kw})  # conftest's tiny backbone


# -----------------------------------------------------------------------------
# independent references


def rope_reference(x, pos, rope_dim, base):
    """RoPE by its definition: pair (i, i + rope_dim/2) rotated by angle pos * base^(-i/(rope_dim/2))."""
    out = x.clone().double()
    half = rope_dim // 2
    for t in range(x.size(-2)):
        for i in range(half):
            a = float(pos[t]) * base ** (-i / half)
            x1, x2 = x[..., t, i].double(), x[..., t, i + half].double()
            out[..., t, i] = x1 * math.cos(a) - x2 * math.sin(a)
            out[..., t, i + half] = x2 * math.cos(a) + x1 * math.sin(a)
    return out


def rmsnorm_reference(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def moe_reference(m: MoE, x):
    """The MoE definition, one token at a time: select by score + bias, weight by score."""
    out = torch.zeros_like(x)
    for t in range(x.size(0)):
        s = torch.sigmoid(m.router.weight @ x[t])
        chosen = torch.topk(s + m.bias, m.cfg.top_k).indices.tolist()
        y = m.shared(x[t])
        for e in chosen:
            g, u = (x[t] @ m.w_gate_up[e]).chunk(2)
            y = y + s[e] * ((F.silu(g) * u) @ m.w_down[e])
        out[t] = y
    return out


def softmax_attention_reference(q, k, v, allowed):
    """Masked softmax by hand, GQA by repeating K/V heads; rows that see nothing give 0."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    att = (q @ k.transpose(-1, -2)) / math.sqrt(q.size(-1))
    att = att.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return att @ v


# -----------------------------------------------------------------------------
# attention pieces


@FAST
@given(T=st.integers(1, 12), rope_fraction=st.sampled_from([0.25, 0.5, 1.0]), seed=st.integers(0, 999),
       base=st.sampled_from([10000.0, 500.0, 1e6]))
def test_rope_rotates_pairs_by_position(T, rope_fraction, seed, base):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, T, 8, generator=g)
    pos = torch.randint(0, 100, (T,), generator=g)
    rd = int(8 * rope_fraction)
    got = apply_rope(x, pos, rd, base)
    torch.testing.assert_close(got.double(), rope_reference(x, pos, rd, base), atol=1e-5, rtol=1e-5)
    assert torch.equal(got[..., rd:], x[..., rd:])  # the rest of the head carries no position


def test_the_model_rotates_with_its_config_rope_base():
    """The attention layers pass cfg.rope_base on: keys of a model built with base 500 equal the
    reference rotation at base 500 (and differ from 10000's)."""
    torch.manual_seed(0)
    attn = moe.Attention(small_cfg(rope_base=500.0, rope_fraction=1.0))
    u, pos = torch.randn(1, 5, 32), torch.arange(5)
    with torch.no_grad():
        k, _ = attn.project_kv(u, pos)
        plain = attn.k_norm(attn.k_proj(u).view(1, 5, 2, 8).transpose(1, 2))
    torch.testing.assert_close(k.double(), rope_reference(plain, pos, 8, 500.0), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(k.double(), rope_reference(plain, pos, 8, 10000.0), atol=1e-3)


def test_the_head_wise_gate_reads_the_layers_own_attention_input_not_the_mirror_source():
    """WeLM's gate: sigmoid(W_g u) per head, from the layer's own normalized input u, also in a
    mirrored layer whose K/V come from the source's state kv_u. By hand: q from u, K/V from
    kv_u, masked softmax, gate from u, output projection."""
    torch.manual_seed(0)
    attn = moe.Attention(small_cfg()).double()
    u, kv_u = torch.randn(2, 6, 32, dtype=torch.float64), torch.randn(2, 6, 32, dtype=torch.float64)
    pos = torch.arange(6)
    with torch.no_grad():
        got = attn(u, pos, "causal", kv_u=kv_u)
        q = apply_rope(attn.q_proj(u).view(2, 6, 6, 8).transpose(1, 2), pos, attn.cfg.rope_dim, attn.cfg.rope_base)
        k, v = attn.project_kv(kv_u, pos)
        y = softmax_attention_reference(q, k, v, dense_mask(causal, pos, pos))
        y = y * torch.sigmoid(u @ attn.gate_proj.weight.T).transpose(1, 2)[..., None]
        ref = y.transpose(1, 2).reshape(2, 6, -1) @ attn.o_proj.weight.T
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)


@FAST
@given(T=st.integers(1, 20), heads=st.sampled_from([(4, 4), (6, 2), (4, 1)]), seed=st.integers(0, 999))
def test_attend_paths_equal_masked_softmax(T, heads, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads[0], T, 8, generator=g)
    k, v = (torch.randn(2, heads[1], T, 8, generator=g) for _ in range(2))
    i = torch.arange(T)
    allowed = dense_mask(causal, i, i)
    ref = softmax_attention_reference(q, k, v, allowed)
    block_mask = create_block_mask(causal, None, None, T, T, device="cpu")
    for mask in ("causal", allowed, block_mask):
        torch.testing.assert_close(attend(q, k, v, mask), ref, atol=1e-5, rtol=1e-5)


@FAST
@given(Tq=st.integers(1, 6), extra=st.integers(0, 40), heads=st.sampled_from([(6, 2), (12, 2), (4, 1), (4, 4)]),
       shape=st.sampled_from(["none", "2-d", "per batch row", "one row for all queries"]), seed=st.integers(0, 999))
def test_attend_with_few_queries_folds_the_query_heads_of_each_kv_head_exactly(Tq, extra, heads, shape, seed):
    """A decode step's queries (Tq * group <= 32 rows take the folded path, more take SDPA's
    enable_gqa) against masked softmax by hand, for no mask, a (Tq, Tk) mask, a (B, 1, Tq, Tk)
    one and a (1, Tk) one broadcast over the queries, random, with rows that see no key (0)."""
    g = torch.Generator().manual_seed(seed)
    Tk = Tq + extra
    q = torch.randn(3, heads[0], Tq, 8, generator=g)
    k, v = (torch.randn(3, heads[1], Tk, 8, generator=g) for _ in range(2))
    mask = {"none": None, "2-d": torch.rand(Tq, Tk, generator=g) < 0.7,
            "per batch row": torch.rand(3, 1, Tq, Tk, generator=g) < 0.7,
            "one row for all queries": torch.rand(1, Tk, generator=g) < 0.7}[shape]  # broadcast: not folded
    allowed = torch.ones(Tq, Tk, dtype=torch.bool) if mask is None else mask.expand(*mask.shape[:-2], Tq, Tk)
    ref = softmax_attention_reference(q, k, v, allowed)
    torch.testing.assert_close(attend(q, k, v, mask), ref, atol=1e-5, rtol=1e-5)
    if shape != "one row for all queries":  # the fold itself, at any row count (bench.py 4e times it past 32)
        torch.testing.assert_close(attend_folded(q, k, v, mask), ref, atol=1e-5, rtol=1e-5)


def test_attend_rejects_causal_with_unequal_lengths():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="causal"):
        attend(q, k, k, "causal")
    with pytest.raises(ValueError, match="mask as a string must be 'causal', got 'full'"):
        attend(q, k, k, "full")
    with pytest.raises(ValueError, match=r"at least 2 dimensions \(Tq, Tk\)"):
        attend(q, k, k, torch.ones(k.size(2), dtype=torch.bool))


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


def test_attend_folded_is_right_for_any_layout_of_sdpas_output(monkeypatch):
    """SDPA on CUDA returns (B, H, T, hd) laid out as (B, T, H, hd): no view of it is legal. The
    CPU's SDPA made to return that layout, the folded step still equals plain GQA attention."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 3, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    mask = torch.rand(3, 9) > 0.3
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    real = F.scaled_dot_product_attention

    def cuda_layout(*args, **kw):
        y = real(*args, **kw)
        return y.transpose(1, 2).contiguous().transpose(1, 2)  # same values, heads innermost but one
    monkeypatch.setattr(F, "scaled_dot_product_attention", cuda_layout)
    assert not cuda_layout(q, k, v, enable_gqa=True).is_contiguous()
    for m in (mask, None):
        torch.testing.assert_close(attend_folded(q, k, v, m), real(q, k, v, attn_mask=m, enable_gqa=True))
    torch.testing.assert_close(attend(q, k, v, mask), ref)  # attend folds these 3 x 3 rows


@cuda
def test_cuda_a_gqa_decode_step_equals_plain_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(s, device="cuda") for s in ((2, 6, 1, 16), (2, 2, 40, 16), (2, 2, 40, 16)))
    torch.testing.assert_close(attend(q, k, v, None), F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def default_run_flex_shapes():
    """The shapes the default run's L layer gives the eager flex: n = 1, 2, 4 rows per token of 64
    tokens, training batch 8, evaluation batches down to a last one of 7, and 1 (sampling)."""
    return [(B, 64 * n) for n in (1, 2, 4) for B in (8, 7, 1)]


def test_the_eager_flex_serves_a_runs_shapes_from_a_few_graphs():
    """moe.FLEX's settings over every (batch, rows) of a default run, twice over, with the
    recompile limit an error: at most 4 graphs (torch specializes sizes of 1), eager flex's values."""
    window = local(16)
    counter = CompileCounter()
    flex = moe.compiled_flex(backend=counter)  # moe.FLEX, counted
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), torch.no_grad():
        for B, T in default_run_flex_shapes() * 2:
            q, kv = torch.randn(B, 6, T, 16), torch.randn(B, 2, T, 16)
            bm = create_block_mask(window, None, None, T, T, device="cpu")
            torch.testing.assert_close(flex(q, kv, kv, block_mask=bm, enable_gqa=True),
                                       attend(q, kv, kv, dense_mask(window, torch.arange(T), torch.arange(T))),
                                       atol=1e-5, rtol=1e-5)
    assert counter.frame_count <= 4, counter.frame_count


@pytest.mark.parametrize("mask", ["causal", "none", "tensor"])
def test_attention_with_kv_expanded_for_cudas_fused_kernels_equals_gqa(mask, monkeypatch):
    """On CUDA, with a mask or in float32, moe.sdpa expands K/V to every query head (the fused kernels
    that take a mask take no GQA). The expanded call, made on the CPU, equals SDPA's own GQA."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 40, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    m = {"causal": "causal", "none": None, "tensor": torch.rand(40, 40) > 0.4}[mask]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask != "tensor" else m,
                                         is_causal=mask == "causal", enable_gqa=True)
    calls = []
    monkeypatch.setattr(moe, "expands_kv", lambda q, m: calls.append(1) or True)
    torch.testing.assert_close(attend(q, k, v, m), ref, atol=1e-6, rtol=1e-6)
    assert calls


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_masked_and_float32_attention_equals_the_cpus(dtype):
    """With K/V expanded on CUDA: a dense mask (a row that sees no key gives 0) and the causal
    kernel, in float32 and bf16, against the CPU's float64."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 40, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    mask = torch.rand(40, 40) > 0.4
    mask[3] = False
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for m in (mask, "causal"):
        want = attend(q.double(), k.double(), v.double(), m)
        got = attend(*(t.to("cuda", dtype) for t in (q, k, v)), m if isinstance(m, str) else m.cuda())
        torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)


Q, K = torch.randn(1, 6, 2, 8), torch.randn(1, 2, 5, 8)  # attend's query and key shapes, for the refusals below


@pytest.mark.parametrize("args, says", [
    ((Q[0], K, K, None), "4-D tensors"),
    ((torch.randn(1, 5, 2, 8), K, K, None), "Hkv dividing H=5"),
    ((Q, torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), None), "head_dim=8"),
    ((Q, K, torch.randn(1, 2, 4, 8), None), "k and v of one shape"),
    ((Q, K, K, torch.ones(2, 5)), "must be boolean"),
    ((Q, K, K, torch.ones(3, 5, dtype=torch.bool)), r"does not broadcast to \(B, H, Tq, Tk\) = \(1, 6, 2, 5\)"),
    ((Q, K, K, torch.ones(2, 2, 5, dtype=torch.bool)), "does not broadcast"),
    ((Q, K, K, 5), "'causal', None, a boolean tensor or a BlockMask"),
])
def test_attend_names_shapes_it_cannot_fold_or_broadcast(args, says):
    with pytest.raises(ValueError, match=says):
        attend(*args)


def test_attend_still_takes_every_mask_form_it_documents():
    for mask in (None, torch.ones(2, 5, dtype=torch.bool), torch.ones(1, 1, 2, 5, dtype=torch.bool),
                 torch.ones(1, 6, 2, 5, dtype=torch.bool)):
        assert attend(Q, K, K, mask).shape == (1, 6, 2, 8)
    assert attend(Q, K[:, :, :2], K[:, :, :2], "causal").shape == (1, 6, 2, 8)


# -----------------------------------------------------------------------------
# MoE


@FAST
@given(E=st.integers(1, 6), k=st.integers(1, 6), N=st.integers(1, 24),
       dispatch=st.sampled_from(["loop", "grouped_mm", "gather", "masked", "auto"]), seed=st.integers(0, 999))
def test_moe_equals_per_token_loop(E, k, N, dispatch, seed):
    torch.manual_seed(seed)
    cfg = small_cfg(n_experts=E, top_k=min(k, E), moe_dispatch=dispatch)
    m = MoE(cfg)
    for p in (m.w_gate_up, m.w_down):
        torch.nn.init.normal_(p, std=0.3)
    m.bias.normal_(std=0.3)  # the bias must steer selection, so give it weight
    x = torch.randn(N, cfg.n_embd)
    torch.testing.assert_close(m(x), moe_reference(m, x), atol=1e-5, rtol=1e-5)


@FAST
@given(E=st.integers(1, 6), k=st.integers(1, 4), B=st.integers(1, 3), T=st.integers(1, 12), seed=st.integers(0, 999),
       dispatch=st.sampled_from(["gather", "masked"]))
def test_static_dispatches_equal_the_loop_in_float64_outputs_gradients_and_loads(E, k, B, T, seed, dispatch):
    """The static-shape dispatches compute what the loop over experts computes: every logit and
    every gradient to float64 rounding, and the balancing counts (last_load, step_load) exactly."""
    runs = []
    for dispatch in ("loop", dispatch):
        torch.manual_seed(seed)
        model = Transformer(small_cfg(n_experts=E, top_k=min(k, E), moe_dispatch=dispatch)).double().train()
        for m in model.moe_layers():
            m.bias.normal_(std=0.02)  # a bias that steers some choices
        idx = torch.randint(61, (B, T), generator=torch.Generator().manual_seed(seed))
        logits, loss = model(idx, idx)
        loss.backward()
        runs.append((logits, {n: p.grad for n, p in model.named_parameters()},
                     model.expert_load(), [m.step_load.clone() for m in model.moe_layers()]))
    (logits, grads, last, step), (g_logits, g_grads, g_last, g_step) = runs
    torch.testing.assert_close(g_logits, logits, atol=1e-12, rtol=1e-12)
    for name in grads:
        torch.testing.assert_close(g_grads[name], grads[name], atol=1e-12, rtol=1e-12, msg=name)
    assert torch.equal(g_last, last) and all(torch.equal(a, b) for a, b in zip(g_step, step))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dispatch", ["loop", "grouped_mm", "gather", "masked"])
def test_an_unchosen_expert_contributes_nothing_even_when_it_overflows(dispatch, dtype):
    """Expert 3 is never chosen (the bias) and its weights overflow any row (1e20: its hidden is
    inf in float32 and bf16): every dispatch gives the loop's finite output, float32 and bf16 autocast."""
    outs = []
    for mode in ("loop", dispatch):
        torch.manual_seed(0)
        m = MoE(small_cfg(n_experts=4, top_k=2, moe_dispatch=mode))
        for p in (m.w_gate_up, m.w_down):
            torch.nn.init.normal_(p, std=0.3)
        with torch.no_grad():
            m.w_gate_up[3].fill_(1e20)
            m.bias.copy_(torch.tensor([0.0, 0.0, 0.0, -100.0]))
        x = torch.randn(40, m.cfg.n_embd, generator=torch.Generator().manual_seed(2))
        with torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
            outs.append(m(x).float())
        assert not (m.last_load[3] > 0)
    assert torch.isfinite(outs[1]).all(), f"{(~torch.isfinite(outs[1]).all(-1)).sum()} rows not finite"
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5 if dtype == torch.float32 else 5e-2, rtol=1e-2)


def test_auto_dispatch_gathers_a_few_rows_and_sorts_many():
    m = MoE(small_cfg())
    assert moe.dispatch(m, moe.GATHER_ROWS // m.cfg.top_k, torch.float32, "cpu") == "gather"
    assert moe.dispatch(m, moe.GATHER_ROWS // m.cfg.top_k + 1, torch.float32, "cpu") == "grouped_mm"
    assert moe.dispatch(m, 4096, torch.float64, "cpu") == "loop"  # grouped_mm has no float64


@examples(60)
@given(N=st.integers(1, 300), k=st.integers(1, 4), E=st.integers(4, 256))
def test_a_static_step_takes_gather_while_it_moves_fewer_bytes_on_cuda_and_up_to_128_pairs_on_the_cpu(N, k, E):
    """P1, the dispatch a compiled or graphed step takes (checks.recorded_step stands for both, on
    either device): on CUDA gather copies each (token, k) pair's expert, written then read (2 N k
    experts' bytes), masked reads every expert once (E): gather iff 2 N k < E. On the CPU the
    weights stay in cache: gather up to moe.COMPILED_GATHER_ROWS pairs."""
    from checks import recorded_step
    m = MoE(small_cfg(n_experts=E, top_k=min(k, E)))
    with recorded_step():
        on_cuda, on_cpu = moe.dispatch(m, N, torch.float32, "cuda"), moe.dispatch(m, N, torch.float32, "cpu")
    pairs = N * m.cfg.top_k
    assert on_cuda == ("gather" if 2 * pairs < E else "masked")
    assert on_cpu == ("gather" if pairs <= moe.COMPILED_GATHER_ROWS else "masked")


def test_knorm_runs_with_its_weight_in_the_keys_dtype_under_autocast(monkeypatch):
    """P4: under bf16 autocast the keys come out of k_proj in bf16; rms_norm is handed KNorm's weight
    in bf16 too (a float32 weight beside bf16 keys unfuses rms_norm on CUDA), every layer."""
    seen, real = [], F.rms_norm
    model = Transformer(small_cfg(head_dim=8, n_embd=32))

    def rms_norm(x, shape, w=None, eps=None):
        if tuple(shape) == (8,):  # KNorm: over head_dim
            seen.append((x.dtype, w.dtype))
        return real(x, shape, w, eps)
    monkeypatch.setattr(moe.F, "rms_norm", rms_norm)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        model(torch.randint(61, (2, 8)))
    assert len(seen) == model.cfg.n_layer and all(x == w == torch.bfloat16 for x, w in seen), seen


def test_bias_changes_selection_never_weights():
    torch.manual_seed(0)
    m = MoE(small_cfg(n_experts=4, top_k=1))
    x = torch.randn(50, 32)
    scores = torch.sigmoid(x @ m.router.weight.T)
    idx0, w0 = m.route(x)
    m.bias[3] = 10.0  # pushes expert 3 to the top for every token
    idx1, w1 = m.route(x)
    assert (idx0[:, 0] != 3).any() and (idx1[:, 0] == 3).all()
    torch.testing.assert_close(w1[:, 0], scores[:, 3])  # weight is the plain score, no bias
    torch.testing.assert_close(w0, scores.gather(1, idx0))


@FAST
@given(seed=st.integers(0, 999), gamma=st.sampled_from([1e-3, 0.05]), steps=st.integers(1, 3))
def test_bias_update_moves_overloaded_down_underloaded_up(seed, gamma, steps):
    torch.manual_seed(seed)
    m = MoE(small_cfg(n_experts=5, top_k=2)).train()
    m.bias.normal_(std=0.1)
    before = m.bias.clone()
    load = torch.zeros(5)
    for _ in range(steps):  # micro-steps of one optimizer step
        x = torch.randn(16, 32)
        load += torch.bincount(torch.topk(torch.sigmoid(x @ m.router.weight.T) + m.bias, 2).indices.flatten(), minlength=5)
        m(x)
    returned = m.update_bias(gamma)
    assert torch.equal(returned, load)
    step = m.bias - before
    for e in range(5):
        expected = -gamma if load[e] > load.mean() else gamma if load[e] < load.mean() else 0.0
        assert step[e].item() == pytest.approx(expected, abs=1e-7)
    assert m.step_load.sum() == 0  # the next step counts afresh


def test_no_grad_forwards_do_not_count_toward_the_step_load():
    m = MoE(small_cfg()).train()
    with torch.no_grad():
        m(torch.randn(10, 32))
    assert m.step_load.sum() == 0 and m.last_load.sum() == 10 * 2


@pytest.mark.parametrize("update", [True, False])
def test_loss_free_balancing_reduces_skew(update):
    torch.manual_seed(0)
    m = MoE(small_cfg(n_experts=8, top_k=2)).train()
    common = torch.randn(32)
    with torch.no_grad():  # skew: two experts' router rows align with a direction all inputs share
        m.router.weight[:2] = common / common.norm() * 3
    x = torch.randn(256, 32) * 0.3 + common

    def imbalance():
        with torch.no_grad():
            load = torch.bincount(m.route(x)[0].flatten(), minlength=8).float()
        return (load.max() / load.mean()).item()

    start = imbalance()
    late = []
    for step in range(250):
        m(x)
        if update:
            m.update_bias(0.005)
        if step >= 200:  # a sign update oscillates around balance; average its late steps
            late.append(imbalance())
    end = sum(late) / len(late)
    assert start > 3.0  # the two favoured experts take (almost) every token
    if update:
        assert end < 1.4, (start, end)
    else:
        assert end == start


def test_gradcheck_moe_dispatch():
    torch.manual_seed(0)
    model = Transformer(tiny("moe", **F64, moe_dispatch="loop")).double()
    idx, tgt = f64_batch(6)
    for name in ("blocks.1.ffn.w_gate_up", "blocks.1.ffn.w_down", "blocks.1.ffn.router.weight"):
        gradcheck_wrt(model, name, lambda m: m(idx, tgt)[1])


def test_the_fast_gradcheck_fails_a_gradient_one_percent_off():
    """The check above can fail: the MoE's router gradient scaled by 1.01 on its way back."""
    torch.manual_seed(0)
    model = Transformer(tiny("moe", **F64, moe_dispatch="loop")).double()
    idx, tgt = f64_batch(6)
    name = "blocks.1.ffn.router.weight"
    w = dict(model.named_parameters())[name].detach().clone().requires_grad_(True)

    def f(w):
        w = w + 0.0
        w.register_hook(lambda g: None if g is None else 1.01 * g)
        return functional_call(model, {name: w}, (idx, tgt))[1]
    with pytest.raises(GradcheckError):
        torch.autograd.gradcheck(f, (w,), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)


@pytest.mark.parametrize("dispatch", ["masked", "gather"])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_static_dispatches_keep_their_gradients_finite_in_float16_wherever_the_loops_are(dispatch, autocast):
    """float16 (the model itself, or float16 autocast), inputs and output gradients at 50 to 550
    (seeds 17 and 36 at 50 made gather's expert gradients inf while the loop's were finite): where
    the reference loop's output and gradients (the input's, every weight's) are finite, the
    static-shape dispatch's are too, and they agree with the loop's."""
    checked = 0
    for seed, scale in ((17, 50.0), (36, 50.0), (0, 20.0), (1, 20.0), (2, 550.0)):
        torch.manual_seed(seed)
        cfg = dict(n_embd=64, expert_hidden=64, n_experts=8, top_k=2)
        models = {d: MoE(tiny("moe", **cfg, moe_dispatch=d)) for d in ("loop", dispatch)}
        for w in (models["loop"].w_gate_up, models["loop"].w_down):  # as Transformer initializes them
            torch.nn.init.normal_(w, std=0.02)
        models[dispatch].load_state_dict(models["loop"].state_dict())
        x, g_out = torch.randn(16, 64) * scale, torch.randn(16, 64) * scale
        out = {}
        for d, m in models.items():
            m = m if autocast else m.half()
            xi = (x if autocast else x.half()).requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                y = m(xi)
            (y.float() * g_out).sum().backward()
            out[d] = [y.float(), xi.grad.float()] + [p.grad.float() for p in (m.w_gate_up, m.w_down, m.router.weight)]
        if all(torch.isfinite(t).all() for t in out["loop"]):
            checked += 1
            assert all(torch.isfinite(t).all() for t in out[dispatch]), (seed, scale)
            for ref, got in zip(out["loop"], out[dispatch]):
                torch.testing.assert_close(got, ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
    assert checked >= 3


# -----------------------------------------------------------------------------
# KV-Mirror


@contextmanager
def recording(model, noise_at=None, noise=None):
    """Record each block's residual input (xs[i]) and each attend call's (k, v) (calls[i]);
    optionally add noise to the residual input of block noise_at."""
    xs, calls = {}, []

    def pre_hook(mod, args, i):
        if i == noise_at:
            args = (args[0] + noise,) + args[1:]
        xs[i] = args[0]
        return args
    handles = [b.register_forward_pre_hook(lambda mod, args, i=i: pre_hook(mod, args, i))
               for i, b in enumerate(model.blocks)]
    real = moe.attend
    moe.attend = lambda q, k, v, mask: calls.append((k, v)) or real(q, k, v, mask)
    try:
        yield xs, calls
    finally:
        moe.attend = real
        for h in handles:
            h.remove()


def expected_kv(block, attn_block, x_in, pos, cfg):
    """K/V of attn_block's projections applied to block's normalized input, by hand."""
    u = rmsnorm_reference(x_in, block.attn_norm.weight, cfg.norm_eps)
    B, T, _ = u.shape
    k = (u @ attn_block.attn.k_proj.weight.T).view(B, T, cfg.n_kv_head, -1).transpose(1, 2)
    v = (u @ attn_block.attn.v_proj.weight.T).view(B, T, cfg.n_kv_head, -1).transpose(1, 2)
    k = rmsnorm_reference(k, attn_block.attn.k_norm.weight, cfg.norm_eps)
    return rope_reference(k, pos, cfg.rope_dim, cfg.rope_base), v


@FAST
@given(n_layer=st.integers(3, 7), mirror=st.booleans(), T=st.integers(1, 10), seed=st.integers(0, 999))
def test_consumer_kv_are_its_own_projections_of_the_source_input(n_layer, mirror, T, seed):
    torch.manual_seed(seed)
    cfg = small_cfg(n_layer=n_layer, kv_mirror=mirror)
    model = Transformer(cfg)
    with torch.no_grad():
        for b in model.blocks:  # non-trivial norm weights so that a wrong norm shows
            b.attn_norm.weight.uniform_(0.5, 1.5)
            b.attn.k_norm.weight.uniform_(0.5, 1.5)
    with recording(model) as (xs, calls):
        model(torch.randint(cfg.vocab_size, (2, T)))
    pairs = 0
    for i, block in enumerate(model.blocks):
        src = cfg.mirror_source(i)
        assert (src is not None) == (mirror and n_layer - 1 - i < n_layer // 3)
        feed = i if src is None else src  # whose normalized input the K/V come from
        k_ref, v_ref = expected_kv(model.blocks[feed], block, xs[feed], torch.arange(T), cfg)
        torch.testing.assert_close(calls[i][0].double(), k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(calls[i][1], v_ref, atol=1e-5, rtol=1e-5)
        pairs += src is not None
    assert pairs == (n_layer // 3 if mirror else 0)


@pytest.mark.parametrize("mirror", [True, False])
def test_consumer_kv_follow_the_source_input_not_their_own(mirror):
    torch.manual_seed(0)
    model = Transformer(small_cfg(n_layer=6, kv_mirror=mirror)).eval()
    consumer, source = 5, 0  # U-shape pairing for 6 layers: 0 -> 5, 1 -> 4
    assert model.blocks[consumer].mirror_source == (source if mirror else None)
    idx = torch.randint(61, (2, 6))
    noise = torch.randn(2, 6, 32)

    def consumer_kv(noise_at):
        with torch.no_grad(), recording(model, noise_at, noise) as (_, calls):
            model(idx)
        return calls[consumer]
    clean = consumer_kv(None)
    own = consumer_kv(consumer)  # perturb the consumer's own residual input
    src = consumer_kv(source)  # perturb the source's input (so its u)
    for a, b in zip(own, clean):
        assert torch.equal(a, b) == mirror  # mirrored K/V ignore the consumer's own input
    for a, b in zip(src, clean):
        assert not torch.allclose(a, b)


def test_gradients_reach_the_source_through_the_consumer():
    torch.manual_seed(0)
    cfg = small_cfg(n_layer=3, kv_mirror=True)
    model = Transformer(cfg)
    with recording(model) as (xs, calls):
        model(torch.randint(cfg.vocab_size, (2, 7)))
    k_consumer = calls[2][0]
    R = torch.randn_like(k_consumer)
    w = model.blocks[0].attn_norm.weight  # lives only in the source layer
    g_model = torch.autograd.grad((k_consumer * R).sum(), w)[0]
    k_ref, _ = expected_kv(model.blocks[0], model.blocks[2], xs[0], torch.arange(7), cfg)
    g_ref = torch.autograd.grad((k_ref.float() * R).sum(), w)[0]
    assert g_model.abs().sum() > 0
    torch.testing.assert_close(g_model, g_ref, atol=1e-5, rtol=1e-4)


# -----------------------------------------------------------------------------
# whole model


model_configs = st.fixed_dictionaries(dict(
    n_layer=st.integers(3, 5), kv_mirror=st.booleans(), heads=st.sampled_from([(6, 2), (4, 4), (6, 1)]),
    rope_fraction=st.sampled_from([0.25, 0.5, 1.0]), n_experts=st.sampled_from([0, 4])))


def build(c, seed):
    torch.manual_seed(seed)
    n_head, n_kv = c["heads"]
    return Transformer(small_cfg(n_layer=c["n_layer"], kv_mirror=c["kv_mirror"], n_head=n_head,
                                 n_kv_head=n_kv, rope_fraction=c["rope_fraction"],
                                 n_experts=c["n_experts"])).eval()


@FAST
@given(c=model_configs, seed=st.integers(0, 999), block=st.integers(2, 9), data=st.data())
def test_cache_filled_to_block_size_in_place_then_one_more_token_is_a_clear_error(c, seed, block, data):
    """The preallocated cache: every step writes into the buffers allocated at the first one
    (same storage, never reallocated), filling it to block_size exactly still equals the full
    forward, and one token more raises."""
    torch.manual_seed(seed)
    n_head, n_kv = c["heads"]
    model = Transformer(small_cfg(block_size=block, n_layer=c["n_layer"], kv_mirror=c["kv_mirror"], n_head=n_head,
                                  n_kv_head=n_kv, n_experts=c["n_experts"])).eval()
    T = data.draw(st.integers(1, block))
    idx = torch.randint(model.cfg.vocab_size, (3, block))
    caches = make_caches(model)
    with torch.no_grad():
        model(idx[:, :T], caches=caches)
        storage = [c.k.data_ptr() for c in caches]
        for t in range(T, block):
            got, _ = model(idx[:, t:t + 1], caches=caches)
            torch.testing.assert_close(got[:, 0], model(idx[:, :t + 1])[0][:, t], atol=1e-5, rtol=1e-5)
        assert [c.k.data_ptr() for c in caches] == storage and len(caches[0]) == block
        with pytest.raises(ValueError, match="block_size"):
            model(idx[:, :1], caches=caches)
    cache = caches[0]
    with pytest.raises(ValueError, match="KV cache full"):
        cache.update(cache.k[:, :, :1], cache.v[:, :, :1])


@FAST
@given(c=model_configs, seed=st.integers(0, 999))
def test_greedy_generate_equals_argmax_of_full_forwards(c, seed):
    model = build(c, seed)
    idx = torch.randint(model.cfg.vocab_size, (2, 5))
    out = generate(model, idx, 6, temperature=0)
    ref = idx
    with torch.no_grad():
        for _ in range(6):
            ref = torch.cat([ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)


def test_sampling_is_reproducible_and_respects_top_k():
    model = build(dict(n_layer=3, kv_mirror=True, heads=(6, 2), rope_fraction=0.25, n_experts=4), 0)
    idx = torch.zeros(1, 3, dtype=torch.long)
    a = generate(model, idx, 10, sample_top_k=1, generator=torch.Generator().manual_seed(5))
    b = generate(model, idx, 10, temperature=0)
    assert torch.equal(a, b)  # sample_top_k=1 is greedy whatever the temperature
    c1 = generate(model, idx, 10, temperature=2.0, generator=torch.Generator().manual_seed(5))
    c2 = generate(model, idx, 10, temperature=2.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(c1, c2)


@FAST
@given(c=model_configs, T=st.integers(2, 16), data=st.data(), seed=st.integers(0, 999))
def test_changing_token_j_changes_no_earlier_logit(c, T, data, seed):
    model = build(c, seed)
    j = data.draw(st.integers(0, T - 1))
    idx = torch.randint(model.cfg.vocab_size, (2, T))
    idx2 = idx.clone()
    idx2[:, j] = (idx[:, j] + 1) % model.cfg.vocab_size
    with torch.no_grad():
        a, b = model(idx)[0], model(idx2)[0]
    torch.testing.assert_close(a[:, :j], b[:, :j], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, j], b[:, j])


def test_forward_loss_is_cross_entropy_and_backward_reaches_every_parameter():
    torch.manual_seed(0)
    model = Transformer(small_cfg(n_layer=4))
    idx = torch.randint(61, (2, 9))
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    ref = -logits.log_softmax(-1).gather(-1, idx[:, 1:, None]).mean()
    torch.testing.assert_close(loss, ref)
    loss.backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert dead == []


def test_too_long_input_raises():
    model = Transformer(small_cfg(block_size=8))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="block_size"):
        generate(model, torch.zeros(1, 4, dtype=torch.long), 5)


@pytest.mark.parametrize("n_experts", [0, 4])
def test_a_float64_backbone_runs_in_float64_with_the_default_dispatch(n_experts):
    torch.manual_seed(0)
    model = Transformer(tiny("moe", **{**F64, "n_experts": n_experts})).double()
    idx, tgt = f64_batch(0)
    logits, loss = model(idx, tgt)
    assert logits.dtype == loss.dtype == torch.float64
    out = generate(model, idx[:, :2], 3, temperature=0)
    assert out.shape == (2, 5)


# -----------------------------------------------------------------------------
# config validation, input checks and the size rule


@pytest.mark.parametrize("kw, field", [
    (dict(n_head=6, n_kv_head=4), "n_head"),
    (dict(n_experts=4, top_k=5), "top_k"),
    (dict(n_experts=4, top_k=0), "top_k"),
    (dict(n_experts=-1), "n_experts"),
    (dict(rope_fraction=0.0), "rope_fraction"),
    (dict(rope_fraction=1.5), "rope_fraction"),
    (dict(head_dim=8, rope_fraction=0.1), "rope_fraction"),
    (dict(rope_base=1.0), "rope_base"),
    (dict(n_layer=2, kv_mirror=True), "kv_mirror"),
    (dict(moe_dispatch="fast"), "moe_dispatch"),
    (dict(balance_gamma=-1.0), "balance_gamma"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(block_size=0), "block_size"),
    (dict(n_embd=0), "n_embd"),
    (dict(head_dim=0), "head_dim"),
    (dict(expert_hidden=0), "expert_hidden"),
    (dict(rope_base=float("nan")), "rope_base"),
    (dict(rope_base=float("inf")), "rope_base"),
    (dict(norm_eps=float("nan")), "norm_eps"),
    (dict(balance_gamma=float("nan")), "balance_gamma"),
    (dict(rope_fraction=float("nan")), "rope_fraction"),
    (dict(n_experts=4, top_k=1.5), "top_k"),
    (dict(vocab_size=True), "vocab_size"),  # a bool is not a count
    (dict(n_experts=4, top_k=True), "top_k"),
    (dict(rope_fraction="0.25"), "rope_fraction"),  # a string, not a number
    (dict(kv_mirror="yes"), "kv_mirror"),
])
def test_invalid_config_raises_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        small_cfg(**kw)


def test_config_copies_and_replaces_like_any_dataclass():
    cfg = small_cfg()
    assert replace(cfg) == cfg
    assert replace(replace(cfg, kv_mirror=False), kv_mirror=True) == cfg
    with pytest.raises(ValueError, match="top_k"):
        replace(cfg, top_k=9)


def test_sample_rejects_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        sample(torch.zeros(1, 5), temperature=-1)
    with pytest.raises(ValueError, match="sample_top_k"):
        sample(torch.zeros(1, 5), sample_top_k=6)


@pytest.mark.parametrize("idx, targets, words", [
    (torch.tensor([[1, 2, 64]]), None, "idx must hold ids in"),
    (torch.tensor([[1, -2, 3]]), None, "idx must hold ids in"),
    (torch.tensor([[1.0, 2.0]]), None, "integer tensor"),
    (torch.tensor([True, False])[None], None, "integer tensor"),
    (torch.tensor([1, 2, 3]), None, r"shape \(B, T\)"),
    (torch.zeros(1, 0, dtype=torch.long), None, r"shape \(B, T\)"),
    (torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long), "targets must have idx's shape"),
    (torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3), -1), "every target is -1"),
    (torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3), 64), "targets must be ids"),
    (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), "targets must be an integer tensor"),
    (torch.zeros(2, 3, dtype=torch.int8), None, "idx must be an integer tensor"),  # nn.Embedding takes int32/64 only
    (torch.zeros(2, 3, dtype=torch.uint8), None, "idx must be an integer tensor"),
    (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.int32), "targets must be an integer tensor"),
])
def test_bad_model_inputs_raise_one_clear_error(idx, targets, words):
    model = Transformer(small_cfg(vocab_size=64))
    with pytest.raises(ValueError, match=words):
        model(idx, targets)


@pytest.mark.parametrize("kw, words", [
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(sample_top_k=1.5), "sample_top_k"),
    (dict(idx=torch.zeros(1, 0, dtype=torch.long)), "idx must have shape"),
])
def test_bad_generation_arguments_raise_one_clear_error(kw, words):
    model = Transformer(small_cfg(vocab_size=64))
    args = dict(idx=torch.zeros(1, 2, dtype=torch.long), max_new_tokens=3)
    args.update(kw)
    with pytest.raises(ValueError, match=words):
        generate(model, **args)


@examples(20)
@given(seed=st.integers(0, 999), T=st.integers(1, 9), scale=st.floats(0.1, 10.0))
def test_knorm_normalizes_keys_only_so_the_key_scale_cancels_and_the_query_scale_does_not(seed, T, scale):
    """KNorm (RMSNorm over head_dim) sits on keys only: scaling W_k leaves attention unchanged,
    scaling W_q changes its softmax temperature (a norm on queries too would hide that)."""
    torch.manual_seed(seed)
    attn = moe.Attention(small_cfg(norm_eps=1e-30)).double()
    u = torch.randn(2, T, attn.cfg.n_embd, dtype=torch.float64)
    pos = torch.arange(T)
    with torch.no_grad():
        base = attn(u, pos, "causal")
        attn.k_proj.weight *= scale
        torch.testing.assert_close(attn(u, pos, "causal"), base, atol=1e-10, rtol=1e-10)
        attn.k_proj.weight /= scale
        attn.q_proj.weight *= 3.0
        moved = (attn(u, pos, "causal") - base).abs().max().item()
    assert T == 1 or moved > 1e-4  # one key: softmax is 1 whatever the temperature


@pytest.mark.parametrize("rope_fraction", [0.25, 0.5, 1.0])
def test_partial_rope_leaves_the_other_head_dims_unrotated_in_the_model(rope_fraction):
    """One token repeated: the first layer's queries and keys see the same input at every
    position, so they differ between positions only where RoPE rotates: the first rope_dim dims
    of each head (rope_fraction of head_dim) differ, the others are equal. Full RoPE in place of
    partial would make every dim differ."""
    cfg = small_cfg(rope_fraction=rope_fraction)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    calls = []
    real = moe.attend
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "attend", lambda q, k, v, mask: calls.append((q, k)) or real(q, k, v, mask))
        model(torch.full((1, 6), 3))
    q, k = calls[0]  # layer 0: (1, heads, 6, head_dim)
    rd = int(round(cfg.head_dim * rope_fraction))
    for x in (q, k):
        moved = (x - x[:, :, :1]).abs().amax((0, 1, 2))  # per head dim: the largest change over positions
        assert (moved[:rd] > 1e-4).all()
        assert (moved[rd:] < 1e-6).all()  # equal up to rounding (positions batch differently)


@pytest.mark.parametrize("config, table", [(ModelConfig, MODEL), (HDConfig, HD), (TaHConfig, TAH)])
def test_each_config_check_table_covers_every_field(config, table):
    names = {f.name for f in fields(config)}
    assert sorted(names - set(table)) == []  # a field without a rule
    assert sorted(set(table) - names) == []  # a rule for no field


@pytest.mark.parametrize("config", [ModelConfig, HDConfig, TaHConfig])
def test_the_defaults_pass_their_table(config):
    config()


@examples(25)
@given(kind=st.sampled_from(["moe", "hd", "tah"]), n_layer=st.integers(1, 4), C=st.sampled_from([8, 16, 24]),
       heads=st.sampled_from([(2, 1), (4, 2), (6, 3)]), hd=st.sampled_from([8, 16]), E=st.integers(0, 4),
       n=st.integers(1, 3), depths=st.integers(2, 3))
def test_the_parameter_estimate_is_the_models_own_count(kind, n_layer, C, heads, hd, E, n, depths):
    """checks.parameters, from the shapes alone, against the parameters the model builds."""
    base = dict(vocab_size=37, block_size=8, n_layer=n_layer, n_embd=C, n_head=heads[0], n_kv_head=heads[1],
                head_dim=hd, n_experts=E, top_k=min(2, E) or 2, expert_hidden=8, ffn_hidden=12, kv_mirror=n_layer >= 3)
    if kind == "moe":
        cfg, cls = ModelConfig(**base), Transformer
    elif kind == "hd":
        cfg, cls = HDConfig(**base, n_streams=n, layout="IFL"[:n_layer] + "I" * (n_layer - 3)), HiddenDecoding
    else:
        cfg, cls = TaHConfig(**base, max_depth=depths, logit_topk=5, decider_hidden=6, lora_rank=2), ThinkAtHard
    assert parameters(cfg) == sum(p.numel() for p in cls(cfg).parameters())


@pytest.mark.parametrize("make, words", [
    (lambda: ModelConfig(n_layer=10**30), "n_layer must be an int in"),
    (lambda: ModelConfig(n_layer=10**6), "needs ~"),
    (lambda: ModelConfig(vocab_size=2**40), "needs ~"),
    (lambda: ModelConfig(n_embd=2**20, n_head=2**10, head_dim=2**10), "needs ~"),
    (lambda: HDConfig(n_streams=10**30), "n_streams must be an int in"),
    (lambda: HDConfig(n_streams=10**9), "needs ~"),
    (lambda: HDConfig(window=10**30), "window must be an int in"),
    (lambda: TaHConfig(max_depth=10**30), "max_depth must be an int in"),
    (lambda: TaHConfig(max_depth=10**9), "needs ~"),
    (lambda: TaHConfig(lora_alpha=-1.0), "lora_alpha must be a finite number > 0"),
    (lambda: TaHConfig(lora_alpha=0), "lora_alpha must be a finite number > 0"),
    (lambda: expand_streams(Transformer(tiny("moe", n_embd=16, n_head=2, n_kv_head=1, head_dim=8)), 10**30), "n_streams must be an int in"),
    (lambda: expand_streams(Transformer(tiny("moe", n_embd=16, n_head=2, n_kv_head=1, head_dim=8)), 10**8), "needs ~"),
])
def test_sizes_that_cannot_fit_are_refused_in_one_line_before_anything_is_allocated(make, words):
    """Each refused at once (no allocation: the memory it names does not exist), in one line
    that names the field, or the estimate and the machine's memory."""
    with pytest.raises(ValueError, match=words) as e:
        make()
    assert "\n" not in str(e.value)
    if "needs" in words:
        assert "GiB" in str(e.value) and "has" in str(e.value)


def test_a_model_that_fits_alone_is_refused_when_jobs_processes_share_the_device(monkeypatch):
    """check_fits with `sharing` processes each holding the model: the device's memory is theirs
    together (train_tiny.py's --jobs on one GPU)."""
    import checks
    cfg = tiny("moe", n_embd=16, n_head=2, n_kv_head=1, head_dim=8, vocab_size=50, block_size=16)
    need = 4 * (parameters(cfg) * 4 + checks.activations(cfg, 8, scores=True))
    monkeypatch.setattr(checks, "memory_limit", lambda device="cpu": 3 * need)
    checks.check_fits(cfg, 8, training=True, sharing=3)
    with pytest.raises(ValueError, match=r"needs ~.*\(4 processes share its"):
        checks.check_fits(cfg, 8, training=True, sharing=4)


def test_token_ids_on_the_meta_device_are_refused_before_the_forward():
    model = Transformer(tiny("moe", vocab_size=16, block_size=8, n_embd=16, n_head=2, n_kv_head=1, head_dim=8,
                             n_experts=2, top_k=1, expert_hidden=8))
    with pytest.raises(ValueError, match="idx is on the meta device"):
        model(torch.zeros(1, 4, dtype=torch.long, device="meta"))


if __name__ == "__main__":
    from checks import not_a_script
    not_a_script("test_moe.py", "python -m pytest test_moe.py")
