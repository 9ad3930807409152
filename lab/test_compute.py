"""What HD's compute buys (lab/compute.py): the looped model is the block stack run k times by
hand, k = 1 is the n = 1 model itself, its cached decoding is its full forward, and the FLOPs count
what each arm runs."""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/test_compute.py is no script: run python -m pytest lab/test_compute.py", file=sys.stderr)
    sys.exit(2)

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import experiment
from conftest import tiny
from hd import HiddenDecoding, expand_streams, layer_mask
from lab import compute, flops
from moe import Transformer, dense_mask
from tah import ThinkAtHard
from trainer import Stage


def n1_model(**kw):
    torch.manual_seed(0)
    return HiddenDecoding(tiny("hd", **{**dict(block_size=24, n_streams=1), **kw})).eval()  # conftest's tiny HD


def by_hand(model, idx, k, gates=None):
    """The blocks run k times in a plain loop, each layer its own dense mask, KV-Mirror's source
    handing its normalized input to its consumer within each pass; with gates, pass j > 1 moves
    the state by gates[j - 2] * (its output - its input)."""
    body, t = model.backbone, torch.arange(idx.size(1))
    x = model.tables[0](idx)
    for j in range(k):
        saved, y = {}, x
        for i, block in enumerate(body.blocks):
            kv_u = saved.pop(block.mirror_source) if block.mirror_source is not None else None
            y, u = block(y, t, dense_mask(layer_mask(model.cfg, i), t, t), kv_u=kv_u)
            if i in body.sources:
                saved[i] = u
        x = y if j == 0 or gates is None else x + gates[j - 1] * (y - x)
    return body.lm_head(body.norm_f(x))


def opened(looped, seed=1):
    """The loop's gates set to random values (as training leaves them), so that every pass counts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gate in looped.gates:
            gate.copy_(torch.rand(gate.shape, generator=g) * 1.5)
    return looped


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("gated", [False, True])
def test_the_looped_model_runs_the_block_stack_k_times(k, gated):
    model = n1_model(attn_impl="dense", mirror_skip=False)
    idx = torch.randint(61, (2, 10))
    looped = opened(compute.Looped(model, k)) if gated else compute.Looped(model, k, gated=False)
    with torch.no_grad():
        got = looped(idx)[0]
        torch.testing.assert_close(got, by_hand(model, idx, k, looped.gates), atol=1e-5, rtol=1e-5)


def test_the_gated_loop_starts_as_the_n1_model_exactly_and_its_gates_train():
    """A fair start (as HD's expansion starts at the n = 1 function): the gated loop x2 and x4 at
    step 0 give n = 1's logits and loss exactly; the ungated loop does not. The gates get gradients
    and move under a step of AdamW."""
    model = n1_model()  # the fast paths and the KV-mirror skip, as the suite trains it
    idx, y = torch.randint(61, (2, 10)), torch.randint(61, (2, 10))
    with torch.no_grad():
        ref = model(idx, y)
        for k in (1, 2, 4):
            got = compute.Looped(model, k)(idx, y)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), k
        assert not torch.allclose(compute.Looped(model, 2, gated=False)(idx, y)[0], ref[0])
    looped = compute.Looped(model.train(), 4)
    opt = torch.optim.AdamW(looped.parameters(), lr=1e-2)
    looped(idx, y)[1].backward()
    assert all(g.grad is not None and g.grad.abs().sum() > 0 for g in looped.gates)
    opt.step()
    assert all(g.abs().sum() > 0 for g in looped.gates)


def test_looped_decoding_with_a_cache_per_pass_is_the_full_forward():
    looped = opened(compute.Looped(n1_model(), 3))
    idx = torch.randint(61, (2, 6))
    with torch.no_grad():
        full = looped(idx)[0][:, -1]
        from generate import make_caches
        caches = [make_caches(looped.model) for _ in range(3)]
        looped(idx[:, :4], caches=caches)
        looped(idx[:, 4:5], caches=caches)
        step = looped(idx[:, 5:6], caches=caches)[0][:, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


class Ahead:
    """K/V rows (Hkv, m, hd) put ahead of a layer's keys for one sequence (a ParScale copy's prefix)."""

    def __init__(self, k, v):
        self.k, self.v = k, v

    def update(self, k, v):
        return torch.cat([self.k.expand(k.size(0), -1, -1, -1), k], 2), torch.cat([self.v.expand(v.size(0), -1, -1, -1), v], 2)


def parscale_by_hand(ps, idx):
    """Each copy alone: the blocks in a plain loop, each layer's dense mask with the prefix's m
    columns in front (every query sees them), the copy's prefix rows ahead of its keys; then the
    weights softmax(W2 silu(W1 [h_1 .. h_P] + b1) + b2), smoothed by 0.01, and the head on the weighted sum."""
    model, P, m = ps.model, ps.copies, ps.prefix
    body, t = model.backbone, torch.arange(idx.size(1))
    states = []
    for p in range(P):
        saved, y = {}, model.tables[0](idx)
        for i, block in enumerate(body.blocks):
            mask = torch.cat([torch.ones(len(t), m, dtype=torch.bool), dense_mask(layer_mask(model.cfg, i), t, t)], 1)
            kv_u = saved.pop(block.mirror_source) if block.mirror_source is not None else None
            y, u = block(y, t, mask, kv_u=kv_u, cache=Ahead(ps.prefix_k[i, p], ps.prefix_v[i, p]))
            if i in body.sources:
                saved[i] = u
        states.append(body.norm_f(y))
    a0, a2 = ps.aggregate[0], ps.aggregate[2]
    scores = torch.nn.functional.silu(torch.cat(states, -1) @ a0.weight.T + a0.bias) @ a2.weight.T + a2.bias
    w = 0.99 * torch.softmax(scores, -1) + 0.01 / P  # the released code's smoothing, 0.01
    return body.lm_head(sum(w[..., p:p + 1] * states[p] for p in range(P)))


def trained_like(ps, seed=1):
    """ParScale's new weights set to random values (as training leaves them), so every copy differs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in (ps.prefix_k, ps.prefix_v, *ps.aggregate.parameters()):
            w.copy_(torch.randn(w.shape, generator=g) * 0.5)
    return ps


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("impl", ["fast", "dense"])
def test_parscale_is_p_copies_each_with_its_prefix_mixed_by_the_weighted_sum(P, impl):
    ps = trained_like(compute.ParScale(n1_model(attn_impl=impl), P, prefix=3))
    idx = torch.randint(61, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(ps(idx)[0], parscale_by_hand(ps, idx), atol=1e-5, rtol=1e-5)


def test_parscale_decoding_with_one_cache_for_the_copies_is_the_full_forward():
    from generate import make_caches
    ps = trained_like(compute.ParScale(n1_model(), 3))
    idx = torch.randint(61, (2, 9))
    with torch.no_grad():
        full = ps(idx)[0]
        caches = make_caches(ps.model)
        got = [ps(idx[:, :5], caches=caches)[0]] + [ps(idx[:, t:t + 1], caches=caches)[0] for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(got, 1), full, atol=1e-5, rtol=1e-5)


def test_parscale_starts_as_one_copy_and_its_prefixes_and_aggregator_train():
    """Copies with equal prefixes are one copy, whatever the weights (a convex mix of equal states):
    P = 3 gives P = 1's logits. At its start (prefix values 0) ParScale is near n = 1 (its prefix
    keys draw a little attention mass: the measured start is in the docstring); the prefixes and
    the aggregator get gradients and move under a step of AdamW."""
    model = n1_model()
    idx, y = torch.randint(61, (2, 10)), torch.randint(61, (2, 10))
    one, three = compute.ParScale(model, 1), trained_like(compute.ParScale(model, 3))
    with torch.no_grad():
        three.prefix_k.copy_(one.prefix_k.expand_as(three.prefix_k))
        three.prefix_v.copy_(one.prefix_v.expand_as(three.prefix_v))
        torch.testing.assert_close(three(idx)[0], one(idx)[0], atol=1e-5, rtol=1e-5)
        start = compute.ParScale(model, 4)(idx, y)[1]
        assert abs(start.item() - model(idx, y)[1].item()) < 0.01
    ps = compute.ParScale(model.train(), 4)
    before = [w.detach().clone() for w in (ps.prefix_k, ps.prefix_v, *ps.aggregate.parameters())]
    opt = torch.optim.AdamW(ps.parameters(), lr=1e-2)
    ps(idx, y)[1].backward()
    news = (ps.prefix_k, ps.prefix_v, *ps.aggregate.parameters())
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in news)
    opt.step()
    assert all(not torch.equal(w, b) for w, b in zip(news, before))


def test_parscale_refuses_what_it_cannot_run():
    model = n1_model()
    for bad in (expand_streams(model, 2), object(), compute.ParScale(model, 2), model.backbone):
        with pytest.raises(ValueError, match="ParScale takes an n = 1 HiddenDecoding"):
            compute.ParScale(bad, 2)
    for copies in (0, -1, True, 2.0, "2", 1025):
        with pytest.raises(ValueError, match=r"copies must be an int in \[1, 1024\]"):
            compute.ParScale(model, copies)
    for prefix in (0, 2.5, False, 25):
        with pytest.raises(ValueError, match=r"prefix must be an int in \[1, 24\]"):
            compute.ParScale(model, 2, prefix)


def flop_models():
    """Models whose FLOPs per token are counted as they run: HD n = 1, 2, 4 with the KV-mirror skip,
    n = 4 without it, a layout with every letter and shared-KV I layers, the objective "all",
    looped x1 and x3, ParScale P = 2 and 4, the plain backbone, TaH at one pass and at two, TaH-3 at three; routed experts dispatched by
    the reference loop (each expert on exactly its rows)."""
    torch.manual_seed(0)
    hd = dict(vocab_size=61, block_size=24, n_layer=6, n_embd=32, n_head=4, n_kv_head=2, head_dim=16, n_experts=4,
              top_k=2, expert_hidden=16, layout="IIFLII", window=3, moe_dispatch="loop")
    n1 = HiddenDecoding(tiny("hd", **hd, n_streams=1))
    tah = ThinkAtHard(tiny("tah", vocab_size=61, block_size=24, n_layer=3, n_embd=32, n_head=2, n_kv_head=1,
                                head_dim=16, n_experts=4, top_k=2, expert_hidden=16, logit_topk=16, moe_dispatch="loop"))
    return {
        "HD n=1": (n1, {}), "HD n=2": (HiddenDecoding(tiny("hd", **hd, n_streams=2)), {}),
        "HD n=4": (HiddenDecoding(tiny("hd", **hd, n_streams=4)), {}),
        "HD n=4, no skip": (HiddenDecoding(tiny("hd", **hd, n_streams=4, mirror_skip=False)), {}),
        "HD n=3, FLIFLI, shared-KV": (HiddenDecoding(tiny("hd", **{**hd, "layout": "FLIFLI"}, n_streams=3,
                                                                shared_kv=True)), {}),
        "HD n=2, objective all": (HiddenDecoding(tiny("hd", **hd, n_streams=2, objective="all")), {}),
        "looped x1": (compute.Looped(n1, 1), {}), "looped x3": (compute.Looped(n1, 3), {}),
        "ParScale P=2": (compute.ParScale(n1, 2), {}), "ParScale P=4, 3 prefix rows": (compute.ParScale(n1, 4, 3), {}),
        "backbone": (Transformer(tiny("moe", **{k: v for k, v in hd.items() if k not in ("layout", "window")})), {}),
        "TaH standard": (tah, dict(mode="standard")), "TaH always": (tah, dict(mode="always")),
        "TaH-3 always": (ThinkAtHard(tiny("tah", vocab_size=61, block_size=24, n_layer=3, n_embd=32, n_head=2, expert_hidden=64,
                                               n_kv_head=1, head_dim=16, n_experts=0, ffn_hidden=32, logit_topk=16,
                                               max_depth=3)), dict(mode="always")),
    }


@pytest.mark.parametrize("name", list(flop_models()))
def test_the_flops_of_the_weights_are_what_torchs_flop_counter_counts_as_the_model_runs(name):
    """flops.parts' "weights": one training step (forward and backward) under
    torch.utils.flop_counter.FlopCounterMode, per token, exactly. The CPU's attention kernel (SDPA)
    is not one the counter counts, so its total is the weights' part alone; the next test counts
    attention's pairs."""
    from torch.utils.flop_counter import FlopCounterMode
    model, kw = flop_models()[name]
    B, T = 2, 12
    idx, y = torch.randint(61, (B, T)), torch.randint(61, (B, T))
    with FlopCounterMode(display=False) as counter:
        out = model(idx, y, **kw)
        (out.loss if hasattr(out, "loss") else out[1]).backward()
    passes = getattr(model.cfg, "max_depth", 1) if kw.get("mode") == "always" else 1
    assert counter.get_total_flops() / (B * T) == pytest.approx(flops.parts(model, T, passes)["weights"], rel=1e-12)


def test_tahs_decider_its_padded_rows_and_stage_2_are_counted_as_they_run():
    """TaH's FLOPs where the decider runs, pinned against FlopCounterMode as the weights above: a
    decider-routed forward with uneven routing (a gathered second pass, padded: passes_run counts
    its rows as run, more than the tokens sent on), its decider's MLP on every pass's rows, once;
    and stage 2 (stage2_loss, forward and backward): the forward once, the decider's MLP 3x."""
    from torch.utils.flop_counter import FlopCounterMode
    from tah import stage2_loss
    model = flop_models()["TaH always"][0]
    torch.manual_seed(3)
    B, T = 4, 12
    idx = torch.randint(61, (B, T))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = model(idx, mode="decider", threshold=0.524)  # the untrained decider's scores sit near 0.52
    run = flops.passes_run(out)
    assert (out.depths > 1).sum(1).tolist() == [3, 5, 4, 4] and run == 1 + 4 * 5 / (B * T)  # padded to 5 a row
    train, routed = (flops.parts(model, T, run, decider=d)["weights"] for d in (False, True))
    assert counter.get_total_flops() / (B * T) == pytest.approx(train / 3 + (routed - train), rel=1e-12)
    depths = torch.ones_like(idx) + (torch.rand(B, T) < 0.3).long()
    with FlopCounterMode(display=False) as counter:
        stage2_loss(model, idx, depths)[0].backward()
    assert counter.get_total_flops() / (B * T) == pytest.approx(flops.parts(model, T, stage2=True)["weights"], rel=1e-12)
    with pytest.raises(ValueError, match="decider and stage2 are TaH's"):
        flops.per_token(flop_models()["HD n=1"][0], T, decider=True)


@pytest.mark.parametrize("name", list(flop_models()))
def test_the_flops_of_attention_are_the_pairs_each_layers_mask_allows(name):
    """flops.parts' "attention": 3 x 4 x heads x head_dim per allowed (query, key) pair, against a
    count of the pairs by brute force from each layer's own mask function (HD: hd.layer_mask, the
    final-stream queries alone under the skip; TaH: (i, d) sees (j, k) iff j <= i and k <= d)."""
    model, kw = flop_models()[name]
    T = 12
    inner = getattr(model, "model", model)
    cfg = inner.cfg
    if isinstance(inner, ThinkAtHard):
        depth = cfg.max_depth if kw["mode"] == "always" else 1
        allowed = cfg.n_layer * sum(j <= i and k <= d for i in range(T) for d in range(depth)
                                    for j in range(T) for k in range(depth))
    else:
        n = getattr(cfg, "n_streams", 1)
        skip = inner.mirror_skip_from() if isinstance(inner, HiddenDecoding) else None
        allowed = 0
        for i in range(cfg.n_layer):
            mod = layer_mask(cfg, i) if isinstance(inner, HiddenDecoding) else (lambda b, h, q, kv: kv <= q)
            queries = range(n - 1, n * T, n) if skip is not None and i >= skip else range(n * T)
            allowed += sum(bool(mod(0, 0, torch.tensor(q), torch.tensor(kv))) for q in queries for kv in range(n * T))
            allowed += T * getattr(model, "prefix", 0)  # ParScale: each query sees its copy's prefix rows
        allowed *= getattr(model, "loops", 1) * getattr(model, "copies", 1)
    want = 3 * 4 * cfg.n_head * cfg.head_dim * allowed / T
    got = flops.parts(model, T, getattr(cfg, "max_depth", 1) if kw.get("mode") == "always" else 1)["attention"]
    assert got == pytest.approx(want, rel=1e-12)


@given(st.sampled_from("FLI"), st.integers(1, 6), st.integers(1, 40), st.integers(1, 50), st.booleans())
def test_the_pairs_closed_form_is_the_sum_over_the_query_rows(letter, n, T, window, final_only):
    """flops.pairs counts in closed form (its cost does not grow with T); here the sum it replaces,
    row by row: F sees every row up to its own, L its window, I its own stream's."""
    cfg = tiny("hd", vocab_size=8, block_size=64, expert_hidden=64, n_layer=1, n_embd=8, n_head=1, n_kv_head=1, head_dim=8, n_experts=0,
                   ffn_hidden=8, layout=letter, window=window, kv_mirror=False)
    rows = range(n - 1, n * T, n) if final_only else range(n * T)
    want = sum({"F": r + 1, "L": min(r + 1, window), "I": r // n + 1}[letter] for r in rows)
    assert flops.pairs(cfg, 0, n, T, final_only) == want


def test_flops_refuse_what_they_cannot_count_in_one_line_at_once():
    """Not a model (None, a state_dict), T not an int in [1, block_size] (0, -1, 2.5, True, 10**30,
    past the block), passes on a model without them or outside TaH's range, an unknown mask letter:
    one ValueError each, without counting (10**30 once summed a range of that length)."""
    models = flop_models()
    hd, tah = models["HD n=4"][0], models["TaH always"][0]
    for bad in (None, hd.state_dict(), torch.nn.Linear(2, 2)):
        with pytest.raises(ValueError, match="flops counts a model of moe.py, hd.py or tah.py"):
            flops.per_token(bad, 8)
    for model in (hd, tah, models["looped x3"][0], models["ParScale P=2"][0]):
        for T in (0, -1, 2.5, True, 10**30, 25, "8"):
            with pytest.raises(ValueError, match=r"T must be an int in \[1, block_size 24\]"):
                flops.per_token(model, T)
    for passes in (0, 2, 1.0, True, None):
        with pytest.raises(ValueError, match="passes is TaH's"):
            flops.per_token(hd, 8, passes)
    for passes in (0, 0.5, 2.5, 3, float("nan"), True, "2"):
        with pytest.raises(ValueError, match=r"passes must be in \[1, 2\], or a whole number up to max_depth 2"):
            flops.per_token(tah, 8, passes)
    assert flops.per_token(tah, 8, 1.5) > flops.per_token(tah, 8, 1)
    odd = tiny("hd", vocab_size=8, block_size=8, n_layer=1, n_embd=8, n_head=1, n_kv_head=1, head_dim=8,
               n_experts=0, ffn_hidden=8, layout="F", kv_mirror=False)
    object.__setattr__(odd, "layout", "X")  # past the config's own check: the count still refuses it
    with pytest.raises(ValueError, match="layout letter 'X' is none of F, L, I"):
        flops.pairs(odd, 0, 2, 4, False)


def test_an_arms_training_flops_are_its_flops_per_token_times_the_tokens_its_stage_trains_on():
    base = n1_model()
    stage, four = Stage(10, 1e-3, warmup=1, batch=2, block=8), Stage(40, 1e-3, warmup=1, batch=2, block=8)
    for model in (base, compute.Looped(base, 4), expand_streams(base, 4)):
        assert compute.training_flops(model, stage) == flops.per_token(model, 8) * 10 * 2 * 8
        assert compute.training_flops(model, four) == 4 * compute.training_flops(model, stage)


def test_hd_n4_costs_about_twice_n1_as_run_at_the_default_preset():
    """What the formula got wrong (it charged n = 4 4.8x n = 1): at the default run's shapes (width
    64, its 9,711-token vocabulary, T = 64) n = 4 runs about 2x n = 1's FLOPs, n = 2 about 1.3x,
    looped x4 about 2.3x and x2 1.4x, because the head (~61% of the weights' work) runs once a
    token and the two KV-mirrored layers one row a token."""
    import train_tiny as tt
    from hd_experiment import hd_config
    p = tt.PRESETS["default"]
    with torch.device("meta"):
        ms = {n: HiddenDecoding(hd_config(p, 9711, n)) for n in (1, 2, 4)}
        ratio = {k: flops.per_token(m, p.block) / flops.per_token(ms[1], p.block) for k, m in
                 {"n2": ms[2], "n4": ms[4], "x2": compute.Looped(ms[1], 2), "x4": compute.Looped(ms[1], 4)}.items()}
    assert 1.8 < ratio["n4"] < 2.2 and 1.2 < ratio["n2"] < 1.4 and 2.1 < ratio["x4"] < 2.5 and 1.3 < ratio["x2"] < 1.5, ratio


def test_looped_refuses_what_it_cannot_loop():
    """Looped takes an n = 1 HiddenDecoding (not HD n = 2, not a non-model, not a Looped), an int
    loops (no bool, none past 2**53 or the size rule), a bool gated, and one cache list per pass,
    each its own: one line each."""
    model = n1_model()
    for bad in (expand_streams(model, 2), object(), compute.Looped(model, 2), model.backbone):
        with pytest.raises(ValueError, match="Looped takes an n = 1 HiddenDecoding"):
            compute.Looped(bad, 2)
    for loops in (0, -1, True, 2.0, "2", 10**30):
        with pytest.raises(ValueError, match=r"loops must be an int in \[1, 2\*\*53\]"):
            compute.Looped(model, loops)
    with pytest.raises(ValueError, match="Looped x1,000,000,000,000: this configuration needs"):
        compute.Looped(model, 10**12)  # the size rule, before any pass allocates
    idx = torch.randint(61, (1, 4))
    for caches in ([None], [None] * 3, "caches"):
        with pytest.raises(ValueError, match="one generate.make_caches per pass: 2 of them"):
            compute.Looped(model, 2)(idx, caches=caches)
    for gated in ("no", "False", 2, 0, float("nan"), None):
        with pytest.raises(ValueError, match=r"Looped's gated must be True \(the gated loop\) or False"):
            compute.Looped(model, 2, gated=gated)
    from generate import make_caches
    shared = make_caches(model)
    with pytest.raises(ValueError, match="each its own: the same list was given to two passes"):
        compute.Looped(model, 2)(idx, caches=[shared, shared])


def test_the_suite_trains_the_arms_of_hd_ns_and_judges_their_claims(tmp_path):
    """--hd_ns 1,3: the arms n = 1, n = 3, n = 1 looped x3 and the curve of more steps, and no other
    (the default's 2 and 4 are not trained unseen); k = 3's claims."""
    import json
    import train_tiny as tt
    tt.main(["--smoke", "--suite", "hd-compute", "--hd_ns", "1,3", "--seeds", "1", "--jobs", "1",
             "--hd_base_iters", "2", "--hd_cont_iters", "2", "--out", str(tmp_path)])
    rows = json.loads(next(tmp_path.glob("run-*/rows.json")).read_text())["rows"]
    arms = {(r["effect_id"], r["arm_id"]) for r in rows if r["suite"] == "hd-compute"}
    steps = {f"n1-steps{k:g}" for k in compute.STEPS}  # the curve of more steps, whatever --hd_ns
    early, late = compute.HD_COMPUTE.id, compute.LATE.id
    assert arms == {(early, a) for a in {"n1-continued", "n3-continued", "n1-looped3", "parscale3"} | steps} | {
        (late, a) for a in {"n1-continued", "n3-continued"} | steps}, arms
    said = {v["claim"] for v in json.loads((tmp_path / "results.json").read_text())["verdicts"]}
    assert {c.name for c in compute.claims((1, 3))} <= said and not any("n=4" in c or "x4" in c for c in said), said


def test_the_figure_plots_each_arms_paired_difference_from_the_control_against_its_flops(tmp_path, monkeypatch):
    """compute.plot: per way, x the arm's FLOPs, y its loss minus the control's paired by seed, the
    error bar the 95% t interval of those differences (not the unpaired spread of the losses)."""
    from lab import report
    rows = []
    for seed, shift in enumerate((0.0, 0.3, -0.2)):  # the seeds' common shift cancels in the paired difference
        for arm, loss, f in ((compute.N1, 5.0, 1.0), (compute.streams_arm(2), 4.9, 1.3), (compute.steps_arm(2), 4.7, 2.0),
                             (compute.looped_arm(2), 5.1 + 0.01 * seed, 1.4)):
            rows += experiment.result_rows(compute.HD_COMPUTE, arm, seed, {"loss": loss + shift, compute.FLOPS: f})
    rows += [r for seed in range(3) for arm, loss in ((compute.N1, 5.0), (compute.streams_arm(2), 4.95))
             for r in experiment.result_rows(compute.LATE, arm, seed, {"loss": loss, compute.FLOPS: 1.0 + 0.3 * (
                 arm != compute.N1)})]  # the late regime: a panel of its own
    drawn, late = {}, {}
    real = compute.figures.pyplot()
    fig, (ax, ax_late) = real.subplots(1, 2, squeeze=True)
    monkeypatch.setattr(ax, "errorbar", lambda x, y, yerr, **kw: drawn.setdefault(kw["label"], (x, y, yerr)))
    monkeypatch.setattr(ax_late, "errorbar", lambda x, y, yerr, **kw: late.setdefault(kw["label"], (x, y, yerr)))
    monkeypatch.setattr(real, "subplots", lambda *a, **kw: (fig, np.array([[ax, ax_late]])))
    assert compute.plot(report.summarize(rows), tmp_path, (1, 2)) == tmp_path / "hd_compute.png"
    assert "paired difference from the control" in ax.get_title() and ax_late.get_title().startswith("late")
    assert list(late) == ["more streams (HD)"] and list(late["more streams (HD)"][1]) == pytest.approx([0, -0.05])
    x, y, yerr = drawn["more streams (HD)"]
    assert list(x) == pytest.approx([1.0, 1.3]) and list(y) == pytest.approx([0.0, -0.1]) and yerr == pytest.approx([0, 0], abs=1e-9)
    x, y, yerr = drawn["looping, gated (recurrent depth)"]
    d = [0.1, 0.11, 0.12]
    assert y[1] == pytest.approx(0.11) and yerr[1] == pytest.approx((report.interval95(d)[1] - report.interval95(d)[0]) / 2)
    tags = {t.get_text(): t.get_color() for t in ax.texts}  # each arm tagged in its way's colour
    assert tags == {"n=2": "C0", "2x": "C1", "x2": "C2", "control": "black"}, tags
    assert [compute.tag(a.label) for a in (compute.steps_arm(0.5), compute.looped_arm(4), compute.parscale_arm(2))] == [
        "0.5x", "x4", "P=2"]


def test_every_arm_of_the_suite_trains_compiled(tmp_path, monkeypatch):
    """--compile runs every arm, the looped and ParScale ones too (each compiles whole, like HD): dynamo
    traces each fullgraph (backend "eager" here, for the time; inductor's kernels are torch's)."""
    import json
    import train_tiny as tt
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, **{**kw, "backend": "eager"}))
    tt.main(["--smoke", "--compile", "--suite", "hd-compute", "--seeds", "1", "--jobs", "1", "--hd_base_iters", "2",
             "--hd_cont_iters", "2", "--out", str(tmp_path)])
    rows = json.loads(next(tmp_path.glob("run-*/rows.json")).read_text())["rows"]
    assert {r["arm_id"] for r in rows} == {"n1-continued", "n2-continued", "n4-continued", "n1-looped2",
                                           "n1-looped4", "parscale2", "parscale4"} | {f"n1-steps{k:g}" for k in compute.STEPS}


def test_effective_compute_reads_the_flops_n1_needs_off_its_curve_in_log_flops():
    """By hand: n = 1 reaches loss 5.0 at 1e12 FLOPs and 4.0 at 4e12; an arm at 4.5 is halfway in
    log FLOPs, 2e12; spent with 1e12 it is worth 2x, with 4e12 half. Above the curve's first loss
    or below its last: nan (beyond the curve, not extrapolated). A curve that turns back up is
    read at its first crossing."""
    curve = [(4e12, 4.0), (1e12, 5.0), (2e12, 4.4)]  # any order
    assert compute.effective_compute([(1e12, 5.0), (4e12, 4.0)], 4.5, 1e12) == pytest.approx(2.0)
    assert compute.effective_compute([(1e12, 5.0), (4e12, 4.0)], 4.5, 4e12) == pytest.approx(0.5)
    assert compute.effective_compute(curve, 5.0, 1e12) == pytest.approx(1.0)
    assert compute.effective_compute(curve, 4.7, 1e12) == pytest.approx(2 ** 0.5)  # (5.0 - 4.7) / 0.6 of a doubling
    import math
    assert math.isnan(compute.effective_compute(curve, 5.1, 1e12)) and math.isnan(compute.effective_compute(curve, 3.9, 1e12))
    assert compute.effective_compute([(1e12, 5.0), (2e12, 4.0), (4e12, 4.5)], 4.2, 1e12) == pytest.approx(2 ** 0.8)


def test_the_suites_wiring_every_arm_from_the_backbone_on_the_control_batches_each_on_its_own_schedule(monkeypatch):
    """hd_compute with a train that moves the weights in place (as training does): every early arm
    starts from the backbone's weights (a copy each, not one another arm trained), every late arm
    from the longest steps arm's weights as trained, each regime on its control's seed and first
    batch; each steps arm's stage spans its own steps (0.5x to 4x), the rest the control's; the
    effective compute rows read each seed's curve in their regime."""
    import train_tiny as tt
    from dataclasses import replace as with_fields
    preset = with_fields(tt.PRESETS["smoke"], hd_base_iters=2, hd_cont_iters=8)
    base = n1_model(block_size=preset.block)  # the preset's sequences (the FLOPs count refuses T past the block)
    monkeypatch.setattr(compute.hd_experiment, "hd_backbone", lambda *a: base)
    started = {}

    def train(name, model, loss, data, stage, ctx, seed, first_batch):
        body = model.model if isinstance(model, (compute.Looped, compute.ParScale)) else model
        started[name] = (body.backbone.lm_head.weight.sum().item(), stage, seed, first_batch)
        with torch.no_grad():
            for w in model.parameters():
                w.add_(1.0)
    losses = iter(range(100))
    monkeypatch.setattr(compute, "train", train)
    monkeypatch.setattr(compute, "evaluate", lambda model, data, preset, ctx: {"loss": 5.0 - 0.01 * next(losses)})
    data = type("Text", (), {"split": {"train": torch.zeros(1000)}})()
    rows = compute.hd_compute(preset, trainer_ctx(), 3, data)
    want = base.backbone.lm_head.weight.sum().item()  # the backbone as trained, before any arm
    longest = want + base.backbone.lm_head.weight.numel()  # the 4x arm's, after its one (in-place) training
    steps = preset.hd_cont_iters
    for name, (start, stage, seed, first) in started.items():
        late = name.startswith(compute.LATE.id + "/")
        assert start == pytest.approx(longest if late else want), name
        assert seed == 3 and first == preset.hd_base_iters + (4 * steps if late else 0), name
        k = next((k for k in compute.STEPS if name.endswith(f"{k:g}x the steps (repeated data)")), 1)
        assert stage.steps == max(1, round(k * steps)), (name, stage)
    ks = len(preset.hd_ns) - 1
    assert len(started) == 2 * (len(preset.hd_ns) + len(compute.STEPS)) + 2 * ks
    effective = {(r["effect_id"], r["arm_id"]) for r in rows if r["metric"] == compute.EFFECTIVE}
    hd = {f"n{k}-continued" for k in preset.hd_ns[1:]}
    assert effective == {(compute.HD_COMPUTE.id, a) for a in hd | {f"n1-looped{k}" for k in preset.hd_ns[1:]} | {
        f"parscale{k}" for k in preset.hd_ns[1:]}} | {(compute.LATE.id, a) for a in hd}


LOSS_OF = {" 0.5x the steps": 5.20, " 1.5x the steps": 4.90, " 2x the steps": 4.80, " 4x the steps": 4.60,
           "n=1 continued": 5.00, "n=2 continued": 4.95, "n=4 continued": 4.85, "looped x2": 5.10, "looped x4": 4.50,
           "ParScale P=2": 5.30, "ParScale P=4": 4.70}  # each arm's loss by its label (the steps arms' first)


def test_effective_compute_is_pinned_by_its_values_recomputed_by_hand_from_the_rows(monkeypatch):
    """A small run whose arms end at chosen losses: every arm's effective compute row equals what
    the rows give by hand, per regime and seed: the n = 1 curve of the control and the steps arms
    only (their FLOPs and losses rows), interpolated in log FLOPs, over the arm's FLOPs; beyond the
    curve the bound (a lower one below it, an upper one above). A curve from every arm, a wrong
    bracket, or linear FLOPs each gives other values (checked)."""
    import math
    import train_tiny as tt
    from dataclasses import replace as with_fields
    preset = with_fields(tt.PRESETS["smoke"], hd_base_iters=2, hd_cont_iters=8)
    monkeypatch.setattr(compute.hd_experiment, "hd_backbone", lambda *a: n1_model(block_size=preset.block))
    last = []
    monkeypatch.setattr(compute, "train", lambda name, *a, **k: last.append(name))
    monkeypatch.setattr(compute, "evaluate", lambda model, data, preset, ctx: {
        "loss": next(v for k, v in LOSS_OF.items() if k in last[-1]) + (0.3 if "late" in last[-1] else 0.0),
        "acc": 0.1})
    data = type("Text", (), {"split": {"train": torch.zeros(1000)}})()
    rows = compute.hd_compute(preset, trainer_ctx(), 0, data)
    val = {(r["effect_id"], r["arm_id"], r["metric"]): r["value"] for r in rows}

    def by_hand(effect, arm, log_space=True):
        curve = sorted((val[effect, a, compute.FLOPS], val[effect, a, "loss"]) for (e, a, m) in val
                       if e == effect and m == compute.FLOPS and (a == "n1-continued" or a.startswith("n1-steps")))
        f, loss = val[effect, arm, compute.FLOPS], val[effect, arm, "loss"]
        xs, ys = [l for _, l in curve][::-1], [math.log(c) if log_space else c for c, _ in curve][::-1]
        if not xs[0] <= loss <= xs[-1]:  # beyond the curve: the FLOPs of its nearest end
            return (curve[-1][0] if loss < xs[0] else curve[0][0]) / f
        got = float(np.interp(loss, xs, ys))
        return (math.exp(got) if log_space else got) / f

    checked = 0
    for (effect, arm, metric), v in val.items():
        if metric == compute.EFFECTIVE:
            assert v == pytest.approx(by_hand(effect, arm), rel=1e-9), (effect, arm)
            checked += 1
            if arm in ("n4-continued", "n1-looped2"):  # inside the curve: in linear FLOPs, another number
                assert v != pytest.approx(by_hand(effect, arm, log_space=False), rel=1e-3)
    assert checked == 6 + 2
    everything = [(val[e, a, compute.FLOPS], val[e, a, "loss"]) for (e, a, m) in val if e == "hd-compute"
                  and m == compute.FLOPS]  # a curve built from every arm reads other values
    assert any(compute.effective_compute(everything, val["hd-compute", a, "loss"], val["hd-compute", a, compute.FLOPS])
               != pytest.approx(val["hd-compute", a, compute.EFFECTIVE], rel=1e-3) for a in ("n4-continued", "n2-continued"))
    assert val["hd-compute", "n1-looped4", compute.BEYOND] == 1 and val["hd-compute", "parscale2", compute.BEYOND] == -1
    assert val["hd-compute", "n4-continued", compute.BEYOND] == 0


def test_the_search_chooses_each_ways_rates_by_its_mean_dev_loss_over_the_seeds_it_all_ran():
    """search_choice: per way, the (rate, added) of the lowest mean dev loss over the seeds, among the
    points every seed ran (a second-stage point one seed alone ran is left out); a diverged point
    (inf) is never chosen; way_of names RATES' keys."""
    E, arm = compute.HD_COMPUTE_LR, compute.searched_arm
    rows = []
    for seed, losses in ((0, {(0.5, 1): 5.0, (1, 1): 4.9, (2, 1): 4.8, (4, 1): float("inf"), (2, 10): 4.7}),
                         (1, {(0.5, 1): 5.0, (1, 1): 4.7, (2, 1): 4.75, (4, 1): 4.9, (1, 10): 4.0})):
        for (rate, new), loss in losses.items():
            rows += experiment.result_rows(E, arm(compute.looped_arm(4), rate, new), seed, {compute.DEV_LOSS: loss})
    for seed, losses in ((0, {0.5: 5.1, 1: 5.0, 2: 5.3, 4: 5.4}), (1, {0.5: 5.2, 1: 5.0, 2: 5.1, 4: float("inf")})):
        rows += [r for rate, loss in losses.items()
                 for r in experiment.result_rows(E, arm(compute.N1, rate, 1), seed, {compute.DEV_LOSS: loss})]
    # looped x4: means 5.0, 4.8, 4.775, inf at 1x added; (2, 10) and (1, 10) one seed each: left out
    assert compute.search_choice(rows) == {"looped4": (2.0, 1.0), "n1": (1.0, 1.0)}
    assert [compute.way_of(a) for a in (compute.N1, compute.steps_arm(2), compute.streams_arm(4),
                                        compute.looped_arm(2), compute.parscale_arm(4))] == [
        "n1", "n1", "n4", "looped2", "parscale4"]


def test_what_each_way_adds_trains_at_its_rate_and_how_far_a_peer_moved_is_read_off_it():
    """added: HD's tables past the first, the loop's gates, ParScale's prefixes and aggregation MLP,
    nothing for n = 1; at_rates scales the peak rate and, past 1x, those parameters; moved reads
    the loop's mean |gate| and ParScale's prefix values' RMS (0 at the start: the n = 1 function)
    and, after a forward, its mixing weights' mean distance from 1/P."""
    base = n1_model()
    four, loop, ps = expand_streams(base, 4), compute.Looped(base, 3), compute.ParScale(base, 2)
    assert compute.added(base) == () and compute.added(four) == ("tables.1.weight", "tables.2.weight",
                                                                 "tables.3.weight")
    assert compute.added(loop) == ("gates.0", "gates.1")
    assert compute.added(ps) == ("prefix_k", "prefix_v") + tuple(f"aggregate.{i}.{w}" for i in (0, 2)
                                                                 for w in ("weight", "bias"))
    stage = Stage(10, 1e-3, warmup=1, batch=2, block=8)
    assert compute.at_rates(stage, four, 2, 1) == replace(stage, lr=2e-3)
    assert compute.at_rates(stage, loop, 0.5, 30) == replace(stage, lr=5e-4, scaled=("gates.0", "gates.1"), scale=30)
    assert compute.moved(loop) == {compute.MOVED["gates"]: 0.0} and compute.moved(four) == {}
    assert compute.moved(ps) == {compute.MOVED["prefix_v"]: 0.0}  # no forward yet: no mixing weights to read
    with torch.no_grad():
        loop.gates[1].fill_(0.5)
        ps.prefix_v.fill_(2.0)
        ps(torch.randint(61, (2, 5)))
    assert compute.moved(loop)[compute.MOVED["gates"]] == pytest.approx(0.25)
    got = compute.moved(ps)
    assert got[compute.MOVED["prefix_v"]] == pytest.approx(2.0)
    assert got[compute.MOVED["mixed"]] == pytest.approx((ps.mixed - 0.5).abs().mean().item()) and ps.mixed.shape == (2, 5, 2)


def trainer_ctx():
    from pathlib import Path
    from trainer import Context
    return Context(Path("."))
