"""Tests of the probes (inside.py), each on a model or pattern whose answer is known, or against
a loop over the definition."""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/test_inside.py is no script: run python -m pytest lab/test_inside.py", file=sys.stderr)
    sys.exit(2)

import math

import numpy as np

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import examples
import moe
from hd import HDConfig, HiddenDecoding
from lab import figures
from lab.inside import (OUTCOMES, attention_weights, entropy, head_probes, iteration_outcomes, recording_attention,
                    reference_copy, stream_cosine, stream_mass, stream_states, tah_trace)
from tah import TaHConfig, ThinkAtHard



def hd_model(n=2, layout="IFLI", **kw):
    cfg = HDConfig(vocab_size=37, block_size=16, n_layer=len(layout), layout=layout, n_embd=32, n_head=4,
                   n_kv_head=2, head_dim=8, n_experts=4, top_k=2, expert_hidden=16, ffn_hidden=32, n_streams=n,
                   window=3, **kw)
    return HiddenDecoding(cfg).eval()


def identity_backbone(model):
    """Every block adds nothing to the residual: attention and FFN outputs zeroed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down.weight", "w_down")):
                p.zero_()
    return model


@pytest.mark.parametrize("n", [2, 4])
def test_identical_tables_and_identity_backbone_give_same_token_cosine_one(n):
    torch.manual_seed(n)
    model = identity_backbone(hd_model(n))
    with torch.no_grad():
        for t in model.tables[1:]:
            t.weight.copy_(model.tables[0].weight)
    idx = torch.randint(37, (2, 9))
    states, _ = stream_states(model, idx)
    assert states.shape == (model.cfg.n_layer + 1, 2, 9, n, 32)
    same, diff = stream_cosine(states)
    torch.testing.assert_close(same, torch.ones_like(same))
    assert (diff < 1 - 1e-3).all()  # different tokens' embeddings differ


@examples(20)
@given(st.integers(2, 4), st.integers(2, 7), st.integers(0, 2**31 - 1))
def test_stream_cosine_matches_a_loop(n, L, seed):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(3, 2, L, n, 5, generator=g)
    same, diff = stream_cosine(states)
    cos = lambda a, b: (a @ b / (a.norm() * b.norm())).item()
    for layer in range(3):
        s_vals, d_vals = [], []
        for b in range(2):
            for i in range(L):
                for a in range(n):
                    for c in range(a + 1, n):
                        s_vals.append(cos(states[layer, b, i, a], states[layer, b, i, c]))
                        d_vals.append(cos(states[layer, b, i, a], states[layer, b, (i - L // 2) % L, c]))
        assert same[layer].item() == pytest.approx(sum(s_vals) / len(s_vals), abs=1e-5)
        assert diff[layer].item() == pytest.approx(sum(d_vals) / len(d_vals), abs=1e-5)


@examples(20)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_stream_mass_gives_back_the_mass_that_was_set(n, L, seed):
    """Each final-stream query spreads a chosen mass m_k over stream k's keys (any split over
    tokens); stream_mass returns m."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(n, generator=g) + 0.01
    m = m / m.sum()
    w = torch.rand(2, 3, L * n, L * n, generator=g)  # other queries' rows: anything
    for q in range(n - 1, L * n, n):
        split = torch.rand(L, n, generator=g)
        split = split / split.sum(0)  # per stream, a split over the L tokens
        w[:, :, q] = (split * m).flatten()  # key t = i*n + k gets m_k * split[i, k]
    torch.testing.assert_close(stream_mass(w, n), m)


def test_recorded_attention_reproduces_each_layer_output():
    """The recorded weights times V give what attention returned, for every mask form attend
    takes (causal, boolean, GQA): the probe reads the attention the model ran."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    vv = v.repeat_interleave(2, dim=1)
    band = torch.ones(6, 6, dtype=torch.bool).tril() & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)
    for mask in ("causal", band, None):
        y, w = moe.attend(q, k, v, mask), attention_weights(q, k, mask)
        torch.testing.assert_close(w @ vv, y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6))


def test_recording_attention_reads_every_layers_call_and_stops_after_the_block():
    """recording_attention(model) gets one entry per layer's call, each a row-stochastic
    (B, H, T*n, T*n) weight map; after the block the layers record nothing."""
    torch.manual_seed(0)
    n, model = 2, hd_model(2, layout="IFL")
    idx = torch.randint(37, (2, 5))
    ref = reference_copy(model)
    with recording_attention(ref) as calls:
        ref(idx)
    assert len(calls) == ref.cfg.n_layer
    for w in calls:
        assert w.shape == (2, ref.cfg.n_head, 5 * n, 5 * n)
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
    layers = [m for m in ref.modules() if isinstance(m, moe.Attention)]
    assert all(a.record is None for a in layers)
    ref(idx)
    assert len(calls) == ref.cfg.n_layer  # nothing recorded outside the block


def test_hd_final_stream_mass_sums_to_one_and_intra_layers_read_their_own_stream():
    torch.manual_seed(1)
    n, model = 3, hd_model(3, layout="IFLI")
    _, weights = stream_states(model, torch.randint(37, (2, 7)))
    assert len(weights) == model.cfg.n_layer
    for w in weights:
        torch.testing.assert_close(stream_mass(w, n).sum(), torch.tensor(1.0))
    torch.testing.assert_close(stream_mass(weights[0], n), torch.tensor([0.0, 0.0, 1.0]))  # I: own stream only


def test_one_hot_head_gives_entropy_zero_and_every_stream_agrees():
    """Identity backbone, every embedding row the same vector e, LM head row 5 = 50 e: every
    stream's logits are one-hot at token 5 (entropy 0), so every stream's top-1 agrees."""
    torch.manual_seed(2)
    n, model = 4, identity_backbone(hd_model(4))
    e = torch.randn(32)
    with torch.no_grad():
        for t in model.tables:
            t.weight.copy_(e.expand_as(t.weight))
        model.backbone.lm_head.weight.zero_()
        model.backbone.lm_head.weight[5] = 50 * e / e.norm()
    states, _ = stream_states(model, torch.randint(37, (2, 6)))
    differs, ent, probs = head_probes(model, states[-1])
    torch.testing.assert_close(ent, torch.zeros(n), atol=1e-6, rtol=0)
    torch.testing.assert_close(differs, torch.zeros(n))
    assert (probs.argmax(-1) == 5).all()


@examples(20)
@given(st.integers(2, 50), st.integers(0, 2**31 - 1))
def test_entropy_matches_the_definition(V, seed):
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(seed)) * 3
    for row, h in zip(logits, entropy(logits)):
        p = [math.exp(x) for x in row.tolist()]
        p = [x / sum(p) for x in p]
        assert h.item() == pytest.approx(-sum(x * math.log(x) for x in p if x > 0), abs=1e-4)
    assert entropy(torch.tensor([0.0, 0.0, 0.0, 0.0])).item() == pytest.approx(math.log(4))


@examples(20)
@given(st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_iteration_outcomes_match_a_loop(T, seed):
    g = torch.Generator().manual_seed(seed)
    target, before, after = (torch.randint(3, (T,), generator=g) for _ in range(3))
    went, kind = torch.rand(T, generator=g) < 0.6, torch.randint(3, (T,), generator=g)
    got = iteration_outcomes(before, after, target, went, kind)
    want = {}
    for t in range(T):
        if went[t]:
            b, a = before[t] == target[t], after[t] == target[t]
            name = {(False, True): OUTCOMES[0], (True, False): OUTCOMES[1], (False, False): OUTCOMES[2],
                    (True, True): OUTCOMES[3]}[(bool(b), bool(a))]
            want.setdefault(int(kind[t]), dict.fromkeys(OUTCOMES, 0))[name] += 1
    assert got == want


@pytest.mark.parametrize("n_layer", [1, 3])
def test_tah_trace_reads_the_forward_it_draws_and_its_attention_obeys_the_duo_causal_mask(n_layer):
    """The trace's passes and top-1s are the decider-routed forward's; each second-pass query's
    weights sum to 1 over the keys and fall only on keys (j, k) with j <= i (TaH Eq. 5; k <= 1
    holds for every key of two passes)."""
    torch.manual_seed(n_layer)
    cfg = TaHConfig(vocab_size=29, block_size=16, n_layer=n_layer, n_embd=32, n_head=4, n_kv_head=2, head_dim=8,
                    n_experts=0, ffn_hidden=32, logit_topk=29, kv_mirror=n_layer >= 3)
    model = ThinkAtHard(cfg).eval()
    with torch.no_grad():
        model.decider.mlp[-1].bias.fill_(3.0)  # sigmoid(score) > 0.9 for most tokens: a second pass to read
    idx = torch.randint(29, (1, 11))
    trace = tah_trace(model, idx)
    out = model(idx, mode="decider")
    assert torch.equal(trace["passes"], out.depths[0])
    assert torch.equal(trace["final"], out.logits[0].argmax(-1))
    assert torch.equal(trace["first"], out.first_logits[0].argmax(-1))
    went = (out.depths[0] > 1).nonzero().squeeze(1)
    assert len(went) > 0 and torch.equal(trace["query_pos"], went)
    w = trace["weights"]
    torch.testing.assert_close(w.sum(-1), torch.ones(len(went)))
    visible = trace["key_pos"][None, :] <= trace["query_pos"][:, None]
    assert (w[~visible] == 0).all()
    assert set(trace["key_depth"].tolist()) == {0, 1}


def test_head_probes_count_disagreement_against_the_final_stream():
    """Streams that disagree: stream k's share of positions whose top-1 differs from the final
    stream's (k = n-1), against a loop over positions. A probe that compared with stream 0
    instead would give stream 0 a share of 0 and the final stream a nonzero one."""
    torch.manual_seed(5)
    n, model = 3, hd_model(3)
    last = torch.randn(2, 7, n, 32) * 5  # (B, L, n, C): random states, so the streams' top-1s differ
    differs, _, _ = head_probes(model, last)
    with torch.no_grad():
        top = [[[model.head(last[b, i, k]).argmax().item() for k in range(n)] for i in range(7)] for b in range(2)]
    want = [sum(top[b][i][k] != top[b][i][n - 1] for b in range(2) for i in range(7)) / 14 for k in range(n)]
    assert want[n - 1] == 0 and want[0] > 0  # the example separates final from stream 0
    torch.testing.assert_close(differs, torch.tensor(want, dtype=differs.dtype))


def test_the_masks_picture_shows_the_mask_functions_cells():
    """figures.mask_panels on tiny sizes against the papers' definitions (a loop per cell), and
    the drawn figure's pixel at each cell's centre: dark exactly where the query sees the key."""
    pytest.importorskip("matplotlib")
    n, L, window, depths = 2, 3, 2, (2, 1, 2)
    panels = figures.mask_panels(n, L, window, depths)
    t = range(n * L)
    want = [[[kv <= q for kv in t] for q in t], [[0 <= q - kv < window for kv in t] for q in t],
            [[kv <= q and kv % n == q % n for kv in t] for q in t]]
    states = [(i, d) for d in range(2) for i, D in enumerate(depths) if D > d]  # the order a forward appends
    want.append([[j <= i and k <= d for (j, k) in states] for (i, d) in states])  # TaH Eq. 5
    assert [m.tolist() for _, m, _, _ in panels] == want
    assert panels[-1][2] == [f"{i}.{d + 1}" for i, d in states]  # token.pass, passes counted from 1
    fig = figures.draw_masks(panels)
    assert [t.get_text() for t in fig.legends[0].texts] == ["the query may attend to the key", "masked"]
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].mean(-1)  # (H, W) brightness, row 0 at the top
    for ax, (_, m, _, _) in zip(fig.axes, panels):
        for q in range(m.shape[0]):
            for k in range(m.shape[1]):
                x, y = ax.transData.transform((k, q))  # the cell's centre, y from the bottom
                dark = pixels[int(round(pixels.shape[0] - y)), int(round(x))] < 128
                assert dark == bool(m[q, k]), (ax.get_title(), q, k)
    figures.pyplot().close(fig)
