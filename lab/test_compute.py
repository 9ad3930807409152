"""What HD's compute buys (lab/compute.py): the looped model is the block stack run k times by
hand, k = 1 is the n = 1 model itself, its cached decoding is its full forward, and the FLOPs count
what each arm runs."""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/test_compute.py is no script: run python -m pytest lab/test_compute.py", file=sys.stderr)
    sys.exit(2)

import pytest
import torch

from hd import HDConfig, HiddenDecoding, expand_streams, layer_mask
from lab import compute
from moe import dense_mask
from trainer import Stage


def n1_model(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=61, block_size=24, n_layer=3, n_embd=32, n_head=6, n_kv_head=2, head_dim=16, n_experts=4,
               top_k=2, expert_hidden=16, n_streams=1, layout="IFL", window=3)
    return HiddenDecoding(HDConfig(**{**cfg, **kw})).eval()


def by_hand(model, idx, k):
    """The blocks run k times in a plain loop, each layer its own dense mask, KV-Mirror's source
    handing its normalized input to its consumer within each pass."""
    body, t = model.backbone, torch.arange(idx.size(1))
    x = model.tables[0](idx)
    for _ in range(k):
        saved = {}
        for i, block in enumerate(body.blocks):
            kv_u = saved.pop(block.mirror_source) if block.mirror_source is not None else None
            x, u = block(x, t, dense_mask(layer_mask(model.cfg, i), t, t), kv_u=kv_u)
            if i in body.sources:
                saved[i] = u
    return body.lm_head(body.norm_f(x))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_looped_model_runs_the_block_stack_k_times(k):
    model = n1_model(attn_impl="dense", mirror_skip=False)
    idx = torch.randint(61, (2, 10))
    with torch.no_grad():
        got = compute.Looped(model, k)(idx)[0]
        torch.testing.assert_close(got, by_hand(model, idx, k), atol=1e-5, rtol=1e-5)


def test_one_pass_is_the_n1_model_exactly_and_two_are_not():
    model = n1_model()  # the fast paths and the KV-mirror skip, as the suite trains it
    idx, y = torch.randint(61, (2, 10)), torch.randint(61, (2, 10))
    with torch.no_grad():
        one, two = compute.Looped(model, 1)(idx, y), compute.Looped(model, 2)(idx, y)
        ref = model(idx, y)
    assert torch.equal(one[0], ref[0]) and torch.equal(one[1], ref[1])
    assert not torch.allclose(two[0], ref[0])


def test_looped_decoding_with_a_cache_per_pass_is_the_full_forward():
    looped = compute.Looped(n1_model(), 3)
    idx = torch.randint(61, (2, 6))
    with torch.no_grad():
        full = looped(idx)[0][:, -1]
        from generate import make_caches
        caches = [make_caches(looped.model) for _ in range(3)]
        looped(idx[:, :4], caches=caches)
        looped(idx[:, 4:5], caches=caches)
        step = looped(idx[:, 5:6], caches=caches)[0][:, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


def test_the_flops_of_each_arm_are_what_it_runs():
    """Looped x k costs k passes of the n = 1 model, k x the steps k x its stage; n = 4 four rows a
    token, each reading four times the keys; each against the formula by hand."""
    base = n1_model()
    stage, four = Stage(10, 1e-3, warmup=1, batch=2, block=8), Stage(40, 1e-3, warmup=1, batch=2, block=8)
    n1 = compute.training_flops(base, stage)
    assert compute.training_flops(compute.Looped(base, 4), stage) == pytest.approx(4 * n1)
    assert compute.training_flops(base, four) == pytest.approx(4 * n1)
    # n = 4: four rows a token through the same weights, attention over four times the keys (by hand)
    body, T = base.backbone, stage.block
    per_row = sum(p.numel() * (base.cfg.top_k / base.cfg.n_experts if n.endswith(("w_gate_up", "w_down")) else 1)
                  for n, p in body.named_parameters() if p.ndim >= 2 and "wte" not in n)
    attention = 12 * base.cfg.n_layer * base.cfg.n_head * base.cfg.head_dim / 2
    assert n1 == pytest.approx((6 * per_row + attention * T) * 10 * 2 * T)
    assert compute.training_flops(expand_streams(base, 4), stage) == pytest.approx(
        4 * (6 * per_row + attention * 4 * T) * 10 * 2 * T)


def test_looped_refuses_what_it_cannot_loop():
    """Looped takes an n = 1 HiddenDecoding (not HD n = 2, not a non-model, not a Looped), an int
    loops (no bool, none past 2**53 or the size rule), and one cache list per pass: one line each."""
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


def test_the_suite_trains_the_arms_of_hd_ns_and_judges_their_claims(tmp_path):
    """--hd_ns 1,3: the arms n = 1, n = 3, n = 1 for 3x the steps, n = 1 looped x3, and no other
    (the default's 2 and 4 are not trained unseen); a claim for k = 3 against each."""
    import json
    import train_tiny as tt
    tt.main(["--smoke", "--suite", "hd-compute", "--hd_ns", "1,3", "--seeds", "1", "--jobs", "1",
             "--hd_base_iters", "2", "--hd_cont_iters", "2", "--out", str(tmp_path)])
    rows = json.loads(next(tmp_path.glob("run-*/rows.json")).read_text())["rows"]
    arms = {r["arm_id"] for r in rows if r["suite"] == "hd-compute"}
    assert arms == {"n1-continued", "n3-continued", "n1-steps3", "n1-looped3"}, arms
    said = {v["claim"] for v in json.loads((tmp_path / "results.json").read_text())["verdicts"]}
    assert {c.name for c in compute.claims((1, 3))} <= said and not any("n=4" in c or "x4" in c for c in said), said
