"""Property tests of Think-at-Hard (tah.py): the specification in executable form.

References: a brute-force loop over Eq. 5 plus the existence rule; token-by-token decoding;
the compute-everything-then-mask path; the backbone alone; hand-computed labels and losses.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

import tah
from conftest import COMPILE_TINY, F64, FAST, cuda, examples, f64_batch, gradcheck_wrt, tiny
from generate import TaHCache, generate_tah, lora_merged
from moe import LayerPlan
from tah import LoRALinear, ThinkAtHard, dense_batch_mask, duo_causal, oracle_depths, stage1_loss, stage2_loss



def tah_cfg(**kw):
    return tiny("tah", **{**dict(vocab_size=53, head_dim=8, ffn_hidden=48, logit_topk=8, decider_hidden=16,
                                 lora_rank=4), **kw})  # conftest's tiny TaH config, smaller


def make(seed=0, lora=True, **kw):
    """A model whose LoRA is switched on with random weights, so depth >= 1 really differs.
    float64: the paths compared here sum in different orders, which in float32 differs by up to
    ~1e-5 (sometimes past a 1e-5 tolerance); in float64 by ~1e-13."""
    torch.manual_seed(seed)
    model = ThinkAtHard(tah_cfg(**kw)).double().eval()
    if lora:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, LoRALinear):
                    m.B.normal_(std=0.2)
    return model


def mixed_decider(model):
    """Decider weights that send about half of the tokens on at threshold 0.5."""
    with torch.no_grad():
        model.decider.mlp[-1].weight.normal_(std=300.0)
        scores = model(torch.randint(model.cfg.vocab_size, (4, 16)), mode="decider").passes[0].score
        # the median's token would sit exactly on the threshold, where rounding decides: move it off
        model.decider.mlp[-1].bias.sub_(scores.median() + 0.5)
    return model


def twin(model, **kw):
    other = ThinkAtHard(replace(model.cfg, **kw)).to(model.backbone.wte.weight.dtype)
    other.load_state_dict(model.state_dict())
    return other.eval()


configs = st.fixed_dictionaries(dict(
    n_experts=st.sampled_from([0, 4]), kv_mirror=st.booleans(), max_depth=st.integers(2, 3),
    attention=st.sampled_from(["duo", "duo", "first_depth", "depth_local"])))


def random_depths(g, B, T, max_depth):
    return torch.randint(1, max_depth + 1, (B, T), generator=g)


def tokens_and_depths(seed, B, T, max_depth):
    """Token ids (B, T) and random depths in [1, max_depth], both drawn from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(53, (B, T), generator=g), random_depths(g, B, T, max_depth)


# -----------------------------------------------------------------------------
# the mask


def states_of(depths):
    """All (b, position, depth) states of a depth pattern, packed by depth as the forward does."""
    B, T = depths.shape
    pos, dep, val = [], [], []
    for d in range(int(depths.max())):
        act = depths > d
        n = int(act.sum(1).max())
        p = torch.zeros(B, n, dtype=torch.long)
        v = torch.zeros(B, n, dtype=torch.bool)
        for b in range(B):
            ids = torch.nonzero(act[b]).flatten()
            p[b, :len(ids)], v[b, :len(ids)] = ids, True
        pos.append(p), dep.append(torch.full((B, n), d)), val.append(v)
    return torch.cat(pos, 1), torch.cat(dep, 1), torch.cat(val, 1)


@FAST
@given(B=st.integers(1, 3), T=st.integers(1, 8), max_depth=st.integers(1, 4), seed=st.integers(0, 999))
def test_duo_causal_mask_equals_eq5_with_existence_rule(B, T, max_depth, seed):
    depths = random_depths(torch.Generator().manual_seed(seed), B, T, max_depth)
    pos, dep, val = states_of(depths)
    got = dense_batch_mask(duo_causal(pos, dep, pos, dep, val), B, pos.size(1), pos.size(1), "cpu")[:, 0]
    for b in range(B):
        for q in range(pos.size(1)):
            for k in range(pos.size(1)):
                i, d, j, kk = pos[b, q].item(), dep[b, q].item(), pos[b, k].item(), dep[b, k].item()
                exists = val[b, k].item() and kk < depths[b, j].item()  # token j reached depth kk
                assert got[b, q, k].item() == (j <= i and kk <= d and exists)


@FAST
@given(T=st.integers(1, 10))
def test_all_depth_one_is_plain_causal(T):
    pos, dep, val = states_of(torch.ones(1, T, dtype=torch.long))
    got = dense_batch_mask(duo_causal(pos, dep, pos, dep, val), 1, T, T, "cpu")[0, 0]
    assert torch.equal(got, torch.ones(T, T, dtype=torch.bool).tril())


# -----------------------------------------------------------------------------
# the model


@FAST
@given(c=configs, seed=st.integers(0, 999), T=st.integers(1, 12))
def test_standard_mode_equals_the_backbone(c, seed, T):
    model = make(seed, **c)
    idx = torch.randint(53, (2, T))
    with torch.no_grad():
        out = model(idx, mode="standard")
        torch.testing.assert_close(out.logits, model.backbone(idx)[0], atol=1e-5, rtol=1e-5)
    assert (out.depths == 1).all()


@FAST
@given(c=configs, seed=st.integers(0, 999), T=st.integers(1, 9))
def test_parallel_forward_equals_token_by_token_decoding(c, seed, T):
    model = make(seed, **c)
    idx, depths = tokens_and_depths(seed, 2, T, model.cfg.max_depth)
    with torch.no_grad():
        par = model(idx, mode="oracle", depths=depths)
        cache = TaHCache(model, 2, idx.device)
        for t in range(T):
            step = model(idx[:, t:t + 1], mode="oracle", depths=depths[:, t:t + 1], cache=cache)
            torch.testing.assert_close(step.logits[:, 0], par.logits[:, t], atol=1e-5, rtol=1e-5)
    assert torch.equal(par.depths, depths)


@FAST
@given(c=configs, seed=st.integers(0, 999), T=st.integers(1, 10), mode=st.sampled_from(["oracle", "decider", "always"]))
def test_gathered_path_equals_compute_everything_then_mask(c, seed, T, mode):
    model = mixed_decider(make(seed, threshold=0.5, **c))
    ref = twin(model, gather=False)
    idx, depths = tokens_and_depths(seed, 2, T, model.cfg.max_depth)
    with torch.no_grad():
        a, b = model(idx, mode=mode, depths=depths), ref(idx, mode=mode, depths=depths)
    assert torch.equal(a.depths, b.depths)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)


@FAST
@given(seed=st.integers(0, 999), T=st.integers(2, 7), n_experts=st.sampled_from([0, 4]), data=st.data())
def test_black_box_state_jk_changes_exactly_i_ge_j_and_d_ge_k(seed, T, n_experts, data):
    # float64 with a loop over experts: re-routing token j changes how many rows each expert's
    # matmul sees, and in float32 that alone moves other rows' rounding (~1e-5); in float64 it
    # stays ~1e-15, far below the 1e-7 that tells a real dependence apart
    model = make(seed, max_depth=3, n_experts=n_experts, moe_dispatch="loop")
    idx, depths = tokens_and_depths(seed, 1, T, 3)
    j = data.draw(st.integers(0, T - 1))
    k = data.draw(st.integers(0, depths[0, j].item() - 1))  # a state that exists

    calls = []

    def bump(mod, args):  # noise on the residual input of state (j, k), at the first block
        d = len(calls)
        calls.append(d)
        if d != k:
            return None
        x = args[0].clone()
        row = int((depths[0, :j] > k).sum())  # j's row among the tokens packed at depth k
        x[0, row] += 10 * torch.randn(x.size(-1), generator=torch.Generator().manual_seed(1), dtype=x.dtype)
        return (x,) + args[1:]
    with torch.no_grad():
        clean = model(idx, mode="oracle", depths=depths)
        h = model.backbone.blocks[0].register_forward_pre_hook(bump)
        try:
            dirty = model(idx, mode="oracle", depths=depths)
        finally:
            h.remove()
    for pc, pd in zip(clean.passes, dirty.passes):
        for q in range(pc.sel.size(1)):
            if not pc.valid[0, q]:
                continue
            i = pc.sel[0, q].item()
            changed = (pd.hidden[0, q] - pc.hidden[0, q]).abs().max().item() > 1e-7
            assert changed == (i >= j and pc.depth >= k), (i, pc.depth, j, k)


@FAST
@given(seed=st.integers(0, 999), T=st.integers(2, 7), attention=st.sampled_from(["duo", "first_depth", "depth_local"]),
       data=st.data())
def test_black_box_key_jk_is_read_by_exactly_the_states_its_attention_rule_allows(seed, T, attention, data):
    """With the depth-to-depth input chain held fixed (every deeper pass gets the clean run's
    input), noise on the last layer's value of state (j, k) reaches exactly the states whose
    query may read that key: duo i >= j, d >= k; first_depth i >= j if k = 0; depth_local
    i >= j, d = k. (With the chain live, duo and depth_local reach the same set.)"""
    model = make(seed, max_depth=3, attention=attention)
    idx, depths = tokens_and_depths(seed, 1, T, 3)
    j = data.draw(st.integers(0, T - 1))
    k = data.draw(st.integers(0, depths[0, j].item() - 1))
    inputs, real_next = [], model.next_input

    def record(summed):
        inputs.append(real_next(summed))
        return inputs[-1]
    replayed = iter(inputs)
    calls = []

    def bump(mod, args, out):  # noise on the value of state (j, k) at the last layer
        d = len(calls)
        calls.append(d)
        if d != k:
            return None
        out = out.clone()
        out[0, int((depths[0, :j] > k).sum())] += torch.randn(out.size(-1), generator=torch.Generator().manual_seed(1),
                                                               dtype=out.dtype)
        return out
    with torch.no_grad():
        model.next_input = record
        clean = model(idx, mode="oracle", depths=depths)
        model.next_input = lambda summed: next(replayed)
        h = model.backbone.blocks[-1].attn.v_proj.register_forward_hook(bump)
        try:
            dirty = model(idx, mode="oracle", depths=depths)
        finally:
            h.remove()
            del model.next_input
    reads = {"duo": lambda i, d: i >= j and d >= k, "first_depth": lambda i, d: i >= j and k == 0,
             "depth_local": lambda i, d: i >= j and d == k}[attention]
    for pc, pd in zip(clean.passes, dirty.passes):
        for q in range(pc.sel.size(1)):
            if pc.valid[0, q]:
                i = pc.sel[0, q].item()
                changed = (pd.hidden[0, q] - pc.hidden[0, q]).abs().max().item() > 1e-9
                assert changed == reads(i, pc.depth), (attention, i, pc.depth, j, k)


@pytest.mark.parametrize("rank, alpha", [(4, 2.0), (2, 16.0), (8, 8.0)])
def test_an_active_adapter_adds_alpha_over_r_times_b_a_x(rank, alpha):
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5, bias=False).double()
    lora = LoRALinear(base, rank, alpha).double()
    with torch.no_grad():
        lora.B.normal_()
    x = torch.randn(3, 6, dtype=torch.float64)
    torch.testing.assert_close(lora(x), base(x))  # inactive: the base alone
    lora.active = True
    ref = x @ base.weight.T + (alpha / rank) * (x @ lora.A.T @ lora.B.T)
    torch.testing.assert_close(lora(x), ref, atol=1e-12, rtol=1e-12)


def test_lora_starts_as_a_no_op_and_is_active_only_at_depth_one_and_beyond():
    base = torch.nn.Linear(8, 5)
    lora = LoRALinear(base, rank=2, alpha=4.0)
    x = torch.randn(3, 8)
    lora.active = True
    assert torch.equal(lora(x), base(x))  # B = 0 at the start
    fresh = make(0, lora=False)
    idx = torch.randint(53, (2, 9))
    with torch.no_grad():
        on = fresh(idx, mode="always")
        off_lora = fresh.backbone(idx)[0]
        trained = make(0, lora=True)  # same weights, LoRA moved away from zero
        t = trained(idx, mode="always")
    torch.testing.assert_close(t.first_logits, off_lora, atol=1e-5, rtol=1e-5)  # depth 0: no LoRA
    assert not torch.allclose(t.logits, on.logits, atol=1e-4)  # depth 1 sees the adapter


@FAST
@given(c=configs, seed=st.integers(0, 999), T=st.integers(1, 9))
def test_merged_adapters_give_the_forward_of_the_unmerged_ones(c, seed, T):
    """lora_merged (decoding): W + (alpha / r) B A in one matmul equals W x + (alpha / r) B A x
    for every pass, and the adapters are unmerged again afterwards, also after an error."""
    model = make(seed, **c)
    idx, depths = tokens_and_depths(seed, 2, T, model.cfg.max_depth)
    with torch.no_grad():
        ref = model(idx, mode="oracle", depths=depths)
        with lora_merged(model):
            got = model(idx, mode="oracle", depths=depths)
        torch.testing.assert_close(got.logits, ref.logits, atol=1e-10, rtol=1e-10)
        with pytest.raises(ValueError), lora_merged(model):
            model(idx, mode="nonsense")
    assert all(m.merged is None for m in model.loras) and len(model.loras) > 0


@FAST
@given(seed=st.integers(0, 999))
def test_next_input_with_topk_equal_vocab_is_full_softmax_mixture(seed):
    model = make(seed, logit_topk=53)
    logits = torch.randn(2, 5, 53, dtype=torch.float64) * 3
    ref = F.softmax(logits, -1) @ model.backbone.wte.weight
    torch.testing.assert_close(model.next_input(logits), ref, atol=1e-5, rtol=1e-5)
    small = make(seed, logit_topk=3)  # top-k: the other rows get no weight
    vals, ids = logits.topk(3, -1)
    ref3 = torch.einsum("btk,btkc->btc", F.softmax(vals, -1), small.backbone.wte.weight[ids])
    torch.testing.assert_close(small.next_input(logits), ref3, atol=1e-5, rtol=1e-5)


def test_output_logits_are_the_sum_over_depths_run():
    model = make(3, max_depth=3)
    idx = torch.randint(53, (1, 6))
    depths = torch.tensor([[1, 3, 2, 1, 3, 2]])
    with torch.no_grad():
        out = model(idx, mode="oracle", depths=depths)
        total = torch.zeros_like(out.logits)
        for p in out.passes:
            lg = model.backbone.lm_head(model.backbone.norm_f(p.hidden))
            for q in range(p.sel.size(1)):
                if p.valid[0, q]:
                    total[0, p.sel[0, q]] += lg[0, q]
    torch.testing.assert_close(out.logits, total, atol=1e-5, rtol=1e-5)


def test_deeper_inputs_mix_embeddings_by_running_summed_logits_at_the_token_position():
    model = make(4, max_depth=3)
    idx = torch.randint(53, (1, 6))
    depths = torch.tensor([[3, 1, 2, 3, 1, 3]])
    seen = []
    h = model.backbone.blocks[0].register_forward_pre_hook(lambda mod, args: seen.append((args[0], args[1].t)))
    with torch.no_grad():
        out = model(idx, mode="oracle", depths=depths)
    h.remove()
    running = torch.zeros(6, 53)
    for p, (x, pos) in zip(out.passes, seen):
        tok = p.sel[0][p.valid[0]]
        assert torch.equal(pos[0][p.valid[0]], tok)  # RoPE position of (i, d) is i
        if p.depth == 0:
            torch.testing.assert_close(x[0][p.valid[0]], model.backbone.wte(idx[0, tok]))
        else:  # Eq. 4 on the logits summed over the depths run so far
            torch.testing.assert_close(x[0][p.valid[0]], model.next_input(running[tok]), atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            running[tok] += model.backbone.lm_head(model.backbone.norm_f(p.hidden[0][p.valid[0]]))


@pytest.mark.parametrize("bias, expect", [(20.0, 2), (-20.0, 1)])
def test_decider_continues_iff_sigmoid_above_threshold(bias, expect):
    model = make(0)
    with torch.no_grad():
        model.decider.mlp[-1].bias.fill_(bias)
    out = model(torch.randint(53, (2, 7)), mode="decider")
    assert (out.depths == expect).all()
    model2 = mixed_decider(make(1, threshold=0.5))
    with torch.no_grad():
        out = model2(torch.randint(53, (2, 9)), mode="decider")
    p0 = out.passes[0]
    go = torch.sigmoid(p0.score) > 0.5
    assert torch.equal(out.depths.gather(1, p0.sel) == 2, go & p0.valid)


def test_decider_generation_equals_parallel_decider_forward():
    model = mixed_decider(make(2, threshold=0.5))
    prompt = torch.randint(53, (2, 4))
    tokens, depths = generate_tah(model, prompt, 8, temperature=0)
    assert 0 < (depths > 1).sum() < depths.numel()  # some tokens iterate, some do not
    with torch.no_grad():
        par = model(tokens[:, :-1], mode="decider")
    assert torch.equal(par.depths, depths)
    assert torch.equal(par.logits[:, 3:].argmax(-1), tokens[:, 4:])


@examples(15)
@given(c=configs, seed=st.integers(0, 999), B=st.integers(2, 5), P=st.integers(1, 5))
def test_batched_decoding_equals_decoding_each_row_alone(c, seed, B, P):
    """generate over B rows (the second pass runs only the rows whose token goes on, gathered
    with their cache entries) gives each row the tokens, depths and logits it gets alone."""
    model = mixed_decider(make(seed, threshold=0.5, block_size=16, **c))
    prompt = torch.randint(53, (B, P), generator=torch.Generator().manual_seed(seed))
    tokens, depths = generate_tah(model, prompt, 8, temperature=0)
    for b in range(B):
        alone, d_alone = generate_tah(model, prompt[b:b + 1], 8, temperature=0)
        assert torch.equal(alone[0], tokens[b]) and torch.equal(d_alone[0], depths[b]), b


@FAST
@given(c=configs, seed=st.integers(0, 999), T=st.integers(2, 9))
def test_a_deeper_pass_runs_only_the_batch_rows_with_a_token_going_on(c, seed, T):
    """Oracle decoding token by token: each step's deeper passes run exactly the rows whose
    token goes that deep (seen as the batch size at the first block), and match the parallel
    forward."""
    model = make(seed, **c)
    idx, depths = tokens_and_depths(seed, 3, T, model.cfg.max_depth)
    sizes = []
    h = model.backbone.blocks[0].register_forward_pre_hook(lambda mod, args: sizes.append(args[0].size(0)))
    try:
        with torch.no_grad():
            par = model(idx, mode="oracle", depths=depths)
            sizes.clear()
            cache = TaHCache(model, 3, idx.device)
            for t in range(T):
                step = model(idx[:, t:t + 1], mode="oracle", depths=depths[:, t:t + 1], cache=cache)
                torch.testing.assert_close(step.logits[:, 0], par.logits[:, t], atol=1e-10, rtol=1e-10)
    finally:
        h.remove()
    expect = [int((depths[:, t] > d).sum()) for t in range(T) for d in range(model.cfg.max_depth)
              if (depths[:, t] > d).any()]
    assert sizes == expect


def test_decoding_fills_the_cache_to_block_size_in_place_then_one_more_token_is_a_clear_error():
    model = make(5, max_depth=3, block_size=7)
    idx = torch.randint(53, (2, 7))
    depths = torch.full((2, 7), 3)
    cache = TaHCache(model, 2, idx.device)
    with torch.no_grad():
        par = model(idx, mode="oracle", depths=depths)
        model(idx[:, :3], mode="oracle", depths=depths[:, :3], cache=cache)
        storage = [layer.k.data_ptr() for layer in cache.layers]
        for t in range(3, 7):  # every token at every depth: the cache ends exactly full
            out = model(idx[:, t:t + 1], mode="oracle", depths=depths[:, t:t + 1], cache=cache)
        torch.testing.assert_close(out.logits[:, 0], par.logits[:, -1], atol=1e-10, rtol=1e-10)
        assert [layer.k.data_ptr() for layer in cache.layers] == storage and cache.len == cache.capacity == 21
        with pytest.raises(ValueError, match="block_size"):
            model(idx[:, :1], mode="standard", cache=cache)
        with pytest.raises(ValueError, match="batch rows"):
            model(idx[:1, :1], cache=TaHCache(model, 2, idx.device))
    tokens, _ = generate_tah(model, idx[:, :3], 4, temperature=0)  # generate to block_size exactly
    assert tokens.shape == (2, 7)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_tah_decider_stage2_and_generate_run_in_the_weights_dtype_without_autocast(dtype):
    torch.manual_seed(0)
    model = ThinkAtHard(tiny("tah", **{**F64, "n_experts": 0}, logit_topk=5)).to(dtype)
    idx, tgt = f64_batch(2)
    out = model(idx, tgt, mode="decider")
    assert out.logits.dtype == dtype
    depths = oracle_depths(model(idx, mode="standard").logits, tgt, 2)
    loss, scores, labels = stage2_loss(model, idx, depths)
    assert torch.isfinite(loss) and scores.dtype == dtype
    tokens, d = generate_tah(model, idx[:, :2], 3, temperature=0)
    assert tokens.shape == (2, 5) and d.shape == (2, 4)


def test_gradcheck_tah_gathered_depths():
    torch.manual_seed(0)
    model = ThinkAtHard(tiny("tah", **{**F64, "n_experts": 0}, logit_topk=5, max_depth=3)).double()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".B"):
                p.normal_(std=0.2)  # LoRA on, so depth >= 1 really differs
    idx, tgt = f64_batch(5)
    depths = torch.tensor([[1, 3, 2, 1, 2], [2, 1, 1, 3, 1]])
    for name in ("backbone.wte.weight", "backbone.blocks.1.attn.q_proj.A"):
        gradcheck_wrt(model, name, lambda m: m(idx, tgt, mode="oracle", depths=depths).loss)


def tiny_tah(**kw):
    cfg = {k: v for k, v in COMPILE_TINY.items() if k != "window"}
    return tah.ThinkAtHard(tiny("tah", **{**cfg, "n_experts": 0, "ffn_hidden": 48, **kw}))


@pytest.mark.usefixtures("fresh_dynamo")
def test_tah_compiles_each_pass_whole_and_decoding_reuses_the_passes_graphs(monkeypatch):
    """fullgraph per pass (tah.COMPILED_PASS, here on tracing backends): training (oracle depths,
    forward and backward) equals eager, and decoding compiles a fixed set of graphs (depth, first cache write, one query row or more)
    that every later step reuses: 30 steps compile what 10 did, and give eager's tokens."""
    torch.manual_seed(0)
    model = tiny_tah(n_layer=1, kv_mirror=False)  # symbolic shapes cost seconds per layer to trace
    idx, tgt = torch.randint(64, (2, 8)), torch.randint(64, (2, 8))
    depths = torch.randint(1, 3, (2, 8))
    eager = model(idx, tgt, mode="oracle", depths=depths)
    eager.loss.backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    counter = CompileCounterWithBackend("aot_eager")  # autograd traced too; training's shapes are fixed
    monkeypatch.setattr(tah, "COMPILED_PASS", torch.compile(tah.ThinkAtHard.run_pass, backend=counter,
                                                            fullgraph=True, dynamic=False))
    out = model.compile_passes()(idx, tgt, mode="oracle", depths=depths)
    out.loss.backward()
    torch.testing.assert_close(out.loss, eager.loss)
    for k, p in model.named_parameters():
        if k in want:
            torch.testing.assert_close(p.grad, want[k], atol=1e-6, rtol=1e-5)
    assert counter.frame_count >= 2  # the passes ran compiled (depth 0 and 1)
    counter = CompileCounter()  # decoding: dynamo's tracing alone
    monkeypatch.setattr(tah, "COMPILED_PASS", torch.compile(tah.ThinkAtHard.run_pass, backend=counter,
                                                            fullgraph=True, dynamic=True))
    model.compile_passes(False).eval()
    tokens, passes = generate_tah(model, idx, 10, temperature=0, mode="always")
    frames = counter.frame_count
    got = generate_tah(model, idx, 10, temperature=0, mode="always", compile=True)
    assert torch.equal(got[0], tokens) and torch.equal(got[1], passes) and not model.passes_compiled
    after_10 = counter.frame_count
    assert after_10 > frames
    long = generate_tah(model, idx, 30, temperature=0, mode="always", compile=True)
    assert counter.frame_count == after_10, "a later decode step compiled again"
    assert torch.equal(long[0][:, :18], tokens)
    with pytest.raises(ValueError, match="compile must be True or False"):
        generate_tah(model, idx, 2, compile=1)


# -----------------------------------------------------------------------------
# oracle labels and training losses


def test_oracle_labels_on_constructed_cases():
    V = 5
    targets = torch.tensor([[1, 2, 3, -1, 0]])
    ref = torch.full((1, 5, V), -5.0)
    for t, top in enumerate([1, 0, 3, 2, 4]):  # right, wrong, right, ignored, wrong
        ref[0, t, top] = 5.0
    assert oracle_depths(ref, targets, 2).tolist() == [[1, 2, 1, 1, 2]]
    assert oracle_depths(ref, targets, 1).tolist() == [[1, 1, 1, 1, 1]]
    # max_depth 3: the two hard tokens split by reference CE, the higher CE deeper
    ref[0, 4, 0] = -9.0  # token 4's target is now much less likely than token 1's
    assert oracle_depths(ref, targets, 3).tolist() == [[1, 2, 1, 1, 3]]
    T = 40  # equal-count bins: 4 bins of 10 hard tokens
    ref = torch.randn(1, T, V)
    tgt = (ref.argmax(-1) + 1) % V  # every token hard
    d = oracle_depths(ref, tgt, 5)
    assert torch.bincount(d.flatten(), minlength=6)[2:].tolist() == [10, 10, 10, 10]
    ce = F.cross_entropy(ref[0], tgt[0], reduction="none")
    assert (ce[d[0] == 5].min() >= ce[d[0] == 4].max())


def test_stage1_loss_is_ce_at_the_oracle_depth():
    model = make(0)
    idx = torch.randint(53, (2, 8))
    depths = random_depths(torch.Generator().manual_seed(0), 2, 7, 2)
    loss = stage1_loss(model, idx[:, :-1], idx[:, 1:], depths)
    out = model(idx[:, :-1], mode="oracle", depths=depths)
    torch.testing.assert_close(loss, F.cross_entropy(out.logits.flatten(0, 1), idx[:, 1:].flatten()))
    loss.backward()
    lora_grads = [m.B.grad for m in model.modules() if isinstance(m, LoRALinear)]
    assert all(g is not None and g.abs().sum() > 0 for g in lora_grads)
    assert model.backbone.wte.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("max_depth", [2, 3])
def test_stage2_loss_trains_only_the_decider_on_oracle_labels(max_depth):
    model = make(0, max_depth=max_depth).train()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(53, (2, 9), generator=g)
    depths = random_depths(g, 2, 9, max_depth)
    loss, scores, labels = stage2_loss(model, idx, depths)
    # labels by brute force: after pass d of token i (if it ran), continue iff D_i > d + 1
    ref = [float(depths[b, i] > d + 1) for d in range(max_depth - 1)
           for b in range(2) for i in range(9) if depths[b, i] > d]
    assert labels.tolist() == ref

    def brute(w_fixed=None):  # the paper's loss, decision by decision, w^(d) counted per depth
        total, k = 0.0, 0
        for d in range(max_depth - 1):
            c = [float(depths[b, i] > d + 1) for b in range(2) for i in range(9) if depths[b, i] > d]
            w = c.count(0.0) / max(c.count(1.0), 1) if w_fixed is None else w_fixed
            for ci in c:
                total -= w * ci * F.logsigmoid(scores[k]) + (1 - ci) * F.logsigmoid(-scores[k])
                k += 1
        return total / k
    torch.testing.assert_close(loss, brute(), rtol=1e-12, atol=1e-12)  # float64 through, the weights too
    torch.testing.assert_close(stage2_loss(model, idx, depths, pos_weight=4.8)[0], brute(4.8), rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # the scores: the decider on a forward that runs every pass (stage 2 skips the last)
        full = model(idx, mode="oracle", depths=depths, features=True)
        ref_scores = torch.cat([model.decider(p.features.rows(p.valid)) for p in full.passes[:max_depth - 1]])
    torch.testing.assert_close(scores.detach(), ref_scores)
    loss.backward()
    for name, p in model.named_parameters():
        if name.startswith("decider."):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_stage2_weight_when_every_decision_continues_is_stop_over_continue_zero():
    """w^(d) = #stop / #continue: with no stop at all the continue term weighs 0 and so does the
    loss (a clamp on the numerator would give 1 / #continue)."""
    model = make(0, max_depth=2)
    loss, scores, labels = stage2_loss(model, torch.tensor([[3, 7, 1, 4]]), torch.full((1, 4), 2))
    assert labels.tolist() == [1.0] * 4 and loss.item() == 0.0


@pytest.mark.parametrize("depths, pos_weight, words", [
    (torch.tensor([[1, 3, 1, 2]]), None, "depths must be in"),  # 3 > max_depth 2: not silently "continue"
    (None, None, "depths of the same shape"),
    (torch.tensor([[1, 2, 1]]), None, "depths of the same shape"),
    (torch.tensor([[1.0, 2.0, 1.0, 2.0]]), None, "depths must be integers"),
    (torch.tensor([[1, 2, 1, 2]]), 0, "pos_weight"),
    (torch.tensor([[1, 2, 1, 2]]), -1.0, "pos_weight"),
    (torch.tensor([[1, 2, 1, 2]]), float("nan"), "pos_weight"),
    (torch.tensor([[1, 2, 1, 2]]), float("inf"), "pos_weight"),
])
def test_stage2_loss_refuses_bad_depths_and_weights(depths, pos_weight, words):
    with pytest.raises(ValueError, match=words):
        stage2_loss(make(0), torch.tensor([[3, 7, 1, 4]]), depths, pos_weight=pos_weight)


@pytest.mark.parametrize("kw, words", [
    (dict(response=torch.ones(8, dtype=torch.bool)), "response"),
    (dict(response=torch.ones(2, 4, dtype=torch.long)), "response"),
    (dict(max_depth=0), "max_depth"),
    (dict(max_depth=2.5), "max_depth"),
    (dict(targets=torch.zeros(2, 3, dtype=torch.long)), "ref_logits"),
])
def test_oracle_depths_refuses_bad_inputs(kw, words):
    args = dict(ref_logits=torch.randn(2, 4, 5), targets=torch.zeros(2, 4, dtype=torch.long), max_depth=2)
    with pytest.raises(ValueError, match=words):
        oracle_depths(**{**args, **kw})


def test_decider_reads_hidden_states_indexed_as_the_authors_0_is_the_pass_input():
    """decider_layers=(0, l): the pass's input (the embedding at depth 0, Eq. 4's mixture deeper)
    and block l - 1's output, and for l = n_layer the last block's output after the final norm
    (Hugging Face's last hidden state, as the authors read it), checked against the backbone
    run by hand."""
    model = make(0, decider_layers=(0, 2, 3))
    idx = torch.randint(53, (2, 7))
    out = model(idx, mode="always", features=True)
    f0, f1 = out.passes[0].features, out.passes[1].features
    x = model.backbone.wte(idx)
    torch.testing.assert_close(f0.states[0], x)
    outs = []  # each block's output; depth 0 alone is a causal pass (no deeper keys exist yet)
    model.backbone.run_blocks(x, [LayerPlan(torch.arange(7), "causal")] * model.cfg.n_layer, outs)
    torch.testing.assert_close(f0.states[1], outs[1])
    normed = outs[2] / outs[2].pow(2).mean(-1, keepdim=True).add(model.cfg.norm_eps).sqrt() * model.backbone.norm_f.weight
    torch.testing.assert_close(f0.states[2], normed)  # state 3 = n_layer: after the final RMSNorm
    assert not torch.allclose(f0.states[2], outs[2])
    torch.testing.assert_close(f1.states[0], model.next_input(out.first_logits))
    with pytest.raises(ValueError, match="decider_layers"):
        make(0, decider_layers=(4,))  # n_layer 3: states 0..3


def test_stage2_loss_at_one_pass_says_there_is_nothing_to_learn():
    model = make(0, max_depth=1)
    idx = torch.randint(53, (1, 5))
    with pytest.raises(ValueError, match="max_depth >= 2"):
        stage2_loss(model, idx, torch.ones_like(idx))


@examples(40)
@given(seed=st.integers(0, 10_000), B=st.integers(1, 3), T=st.integers(1, 24), max_depth=st.integers(3, 5),
       p_hard=st.floats(0.0, 1.0))
def test_oracle_quantile_bins_per_sample_equal_a_brute_force(seed, B, T, max_depth, p_hard):
    """The authors' original binning: per sample, hard tokens by reference CE (highest first) in
    max_depth - 1 bins, sizes as even as possible with the larger bins first; bin k runs
    max_depth - k passes. Prompt positions (response False) and ignored targets stay at 1."""
    g = torch.Generator().manual_seed(seed)
    V = 6
    ref = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    right = ref.argmax(-1)
    wrong = (right + torch.randint(1, V, (B, T), generator=g)) % V
    targets = torch.where(torch.rand(B, T, generator=g) < p_hard, wrong, right)
    targets[torch.rand(B, T, generator=g) < 0.1] = -1
    response = torch.rand(B, T, generator=g) < 0.8
    got = oracle_depths(ref, targets, max_depth, response)
    for b in range(B):
        hard = [t for t in range(T) if targets[b, t] >= 0 and response[b, t] and right[b, t] != targets[b, t]]
        ce = {t: -torch.log_softmax(ref[b, t], -1)[targets[b, t]].item() for t in hard}
        order = sorted(hard, key=lambda t: -ce[t])
        bins = max_depth - 1
        sizes = [len(order) // bins + (k < len(order) % bins) for k in range(bins)]
        want = [1] * T
        start = 0
        for k, size in enumerate(sizes):
            for t in order[start:start + size]:
                want[t] = max_depth - k
            start += size
        assert got[b].tolist() == want


# -----------------------------------------------------------------------------
# flex_attention


@FAST
@given(seed=st.integers(0, 999), T=st.integers(1, 10), max_depth=st.integers(2, 3))
def test_flex_forward_on_cpu_equals_dense(seed, T, max_depth):
    # float64: in float32 the two kernels' different summation orders differ by ~1e-5
    model = make(seed, max_depth=max_depth)
    flex = twin(model, attn_impl="flex")
    idx, depths = tokens_and_depths(seed, 2, T, max_depth)
    with torch.no_grad():
        torch.testing.assert_close(flex(idx, mode="oracle", depths=depths).logits,
                                   model(idx, mode="oracle", depths=depths).logits, atol=1e-10, rtol=1e-10)


@cuda
def test_cuda_flex_forward_and_backward_equal_dense():
    model = make(0, max_depth=3, head_dim=16).float().cuda()  # float32, head_dim 16: the compiled flex kernels
    flex = twin(model, attn_impl="flex").cuda()
    idx = torch.randint(53, (2, 20), device="cuda")
    depths = torch.randint(1, 4, (2, 19), device="cuda")
    a = stage1_loss(flex, idx[:, :-1], idx[:, 1:], depths)
    b = stage1_loss(model, idx[:, :-1], idx[:, 1:], depths)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    a.backward()
    b.backward()
    for p, q in zip(flex.parameters(), model.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3)


# -----------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("kw, words", [
    (dict(threshold=0.0), "threshold"),
    (dict(threshold=1.0), "threshold"),
    (dict(logit_topk=54), "topk"),
    (dict(decider_layers=(0, 4)), "decider_layers"),  # n_layer 3: hidden states 0..3
    (dict(decider_layers=(-1,)), "decider_layers"),
    (dict(max_depth=0), "max_depth"),
    (dict(attention="full"), "attention"),
    (dict(attn_impl="fast"), "attn_impl"),
    (dict(decider_layers=(0.5,)), "decider_layers"),
    (dict(lora_alpha=float("nan")), "lora_alpha"),
    (dict(lora_rank=2.5), "lora_rank"),
    (dict(logit_topk=3.0), "logit_topk"),
    (dict(decider_layers=5), "decider_layers"),
    (dict(threshold="0.9"), "threshold"),
])
def test_bad_config_raises(kw, words):
    with pytest.raises(ValueError, match=words):
        tah_cfg(**kw)


def test_config_copies_and_replaces_like_any_dataclass():
    cfg = tah_cfg()
    assert replace(cfg) == cfg and cfg.decider_layers == ()  # the default is resolved, not written back
    assert cfg.decider_states == (0, 1, 3)
    deeper = replace(cfg, n_layer=5)  # the default follows the new depth
    assert deeper.decider_states == (0, 2, 5)
    assert replace(deeper, n_layer=3) == cfg
    assert replace(cfg, decider_layers=(1,)).decider_states == (1,)


def test_bad_call_raises():
    model = make(0)
    idx = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="depths"):
        model(idx, mode="oracle", depths=torch.tensor([[1, 2, 3, 1]]))
    with pytest.raises(ValueError, match="depths"):
        model(idx, mode="oracle", depths=torch.tensor([[0, 1, 1, 1]]))
    with pytest.raises(ValueError, match="depths"):
        model(idx, mode="oracle")
    with pytest.raises(ValueError, match="depths"):
        model(idx, mode="oracle", depths=[[1, 2, 1, 1]])  # a list, not a tensor
    with pytest.raises(ValueError, match="forward only on CPU"):
        twin(model, attn_impl="flex").train()(idx, idx)
    with pytest.raises(ValueError, match="mode"):
        model(idx, mode="sometimes")
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="depths must be integers"):
        model(idx, mode="oracle", depths=torch.tensor([[1.0, 2.0, 1.4, 1.0]]))
    with pytest.raises(ValueError, match="shape"):
        model(torch.zeros(1, 0, dtype=torch.long))  # an empty sequence: no logits=None
    with pytest.raises(ValueError, match="idx must hold ids"):
        model(torch.full((1, 4), 53))
    with pytest.raises(ValueError, match="targets must have idx's shape"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_tah(model, idx, -1)
    with pytest.raises(ValueError, match="temperature"):
        generate_tah(model, idx, 2, temperature=float("nan"))


@pytest.mark.parametrize("shape", [(8,), (1, 2, 3)])
def test_an_idx_of_the_wrong_rank_is_refused_before_anything_unpacks_it(shape):
    model = ThinkAtHard(tiny("tah", vocab_size=11, block_size=16, n_layer=1, head_dim=8, ffn_hidden=32, kv_mirror=False,
                               logit_topk=5, lora_rank=4))
    with pytest.raises(ValueError, match=r"idx must have shape \(B, T\)"):
        model(torch.zeros(shape, dtype=torch.long))


@pytest.mark.parametrize("target", [-5, 11])
def test_oracle_targets_outside_the_vocabulary_are_refused_and_minus_one_means_ignored(target):
    logits = torch.randn(2, 3, 11)
    with pytest.raises(ValueError, match=r"targets must be -1 \(ignored: never hard\) or a token id in \[0, 11\)"):
        oracle_depths(logits, torch.full((2, 3), target), 2)
    assert (oracle_depths(logits, torch.full((2, 3), -1), 2) == 1).all()


if __name__ == "__main__":
    from checks import not_a_script
    not_a_script("test_tah.py", "python -m pytest test_tah.py")
