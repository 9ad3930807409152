"""Property tests of Hidden Decoding (hd.py): the specification in executable form.

References: brute-force loops over the paper's definitions via i(t) = t // n, s(t) = t % n;
the dense-mask path (SDPA with a boolean mask from the mask_mod); each stream run as its own
sequence through the backbone; full forwards over each prefix.
"""

from dataclasses import replace

import pytest
import torch
from hypothesis import given, strategies as st
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

import moe
from checks import FLEX_MIN_HEAD_DIM, check_flex
from conftest import COMPILE_MODELS, CUDA, F64, FAST, compile_model, cuda, f64_batch, gradcheck_wrt, tiny
from generate import KVCache, WindowCache, generate, make_caches
from hd import (LETTERS, HiddenDecoding, attention_path, expand_streams, fold, full, intra, local, shared_intra,
                unfold)
from moe import LayerPlan, Transformer, attend, dense_mask
from tah import ThinkAtHard

MASK_OF = {**{k: (lambda n, w, k=k: LETTERS[k].mask(n, w, False)) for k in LETTERS},
           "S": lambda n, w: LETTERS["I"].mask(n, w, True)}  # the table's masks; S: I with shared KV


def reference_allowed(kind, n, window, t, tp):
    """May query row t attend to key row tp? Written from HD §2.2 (and our shared-KV rule)."""
    i, s, ip, sp = t // n, t % n, tp // n, tp % n
    if kind == "F":
        return tp <= t
    if kind == "L":
        return t - window < tp <= t
    if kind == "I":
        return tp <= t and sp == s
    return (ip < i and sp == 0) or tp == t  # shared KV: stream 0's rows of earlier tokens, and itself


def hd_cfg(**kw):
    return tiny("hd", **{**dict(head_dim=8, ffn_hidden=48, layout="IFI"), **kw})  # conftest's tiny HD config


def twin(model, **kw):
    """The same weights under other HD settings (paths, skip, ...)."""
    other = HiddenDecoding(replace(model.cfg, **{"mirror_skip": None, **kw}))
    other.load_state_dict(model.state_dict())
    return other.train(model.training)


layouts = st.integers(3, 6).flatmap(lambda L: st.text("FLI", min_size=L, max_size=L))


@st.composite
def hd_models(draw, **fixed):
    layout = fixed.pop("layout", None) or draw(layouts)
    kw = dict(n_layer=len(layout), layout=layout, n_streams=draw(st.integers(1, 4)),
              window=draw(st.integers(1, 9)), kv_mirror=draw(st.booleans()),
              positions=draw(st.sampled_from(["expanded", "token"])), n_experts=draw(st.sampled_from([0, 4])))
    kw.update(fixed)
    if kw.get("shared_kv") and "I" not in kw["layout"]:
        kw["layout"] = "I" + kw["layout"][1:]
    torch.manual_seed(draw(st.integers(0, 10_000)))
    return HiddenDecoding(hd_cfg(**kw)).eval()


# -----------------------------------------------------------------------------
# the masks


@FAST
@given(kind=st.sampled_from("FLIS"), n=st.integers(1, 5), L=st.integers(1, 7), window=st.integers(1, 12))
def test_mask_mods_equal_the_paper_definitions(kind, n, L, window):
    t = torch.arange(n * L)
    got = dense_mask(MASK_OF[kind](n, window), t, t)
    ref = torch.tensor([[reference_allowed(kind, n, window, q, kv) for kv in range(n * L)] for q in range(n * L)])
    assert torch.equal(got, ref)


@FAST
@given(kind=st.sampled_from("FLIS"), n=st.integers(1, 5), L=st.integers(1, 7), window=st.integers(1, 12))
def test_the_letters_table_counts_what_each_mask_allows(kind, n, L, window):
    """hd.LETTERS, read by the config's check, the caches, the FLOPs count and bench: each
    letter's keys per query row and their sums over the rows (every row, or the final stream's)
    equal the reference mask's counts, and its reach is the oldest key a late query sees."""
    row = LETTERS["I" if kind == "S" else kind]
    allowed = [[reference_allowed(kind, n, window, q, kv) for kv in range(n * L)] for q in range(n * L)]
    assert [row.keys(n, window, q) for q in range(n * L)] == [sum(a) for a in allowed]
    assert row.pairs(n, window, L, False) == sum(map(sum, allowed))
    assert row.pairs(n, window, L, True) == sum(sum(allowed[q]) for q in range(n - 1, n * L, n))
    late, reach = n * L - 1, row.reach(window)
    oldest = next(kv for kv in range(n * L) if allowed[late][kv])  # the oldest key the last row sees
    assert oldest // n == 0 if reach is None else late - oldest == min(reach, late + 1) - 1  # every token, or the window


def test_a_letter_the_table_does_not_hold_is_refused_in_one_line_everywhere():
    """The config (checks.py), the mask, the FLOPs count (lab/flops.py) and bench's attention work:
    one ValueError naming the letter, never a count as if it were another."""
    import bench
    from hd import letter
    from lab import flops
    with pytest.raises(ValueError, match=r"layout must be a string of the letters FLI \(hd.LETTERS\)"):
        hd_cfg(layout="IXI")
    with pytest.raises(ValueError, match="layout letter 'X' is none of F, L, I"):
        letter("X")
    with pytest.raises(ValueError, match="layout letter 'X' is none of F, L, I"):
        bench.qk_pairs(2, "IXF", 8, 3)
    cfg = hd_cfg(layout="IFL")
    object.__setattr__(cfg, "layout", "IXL")  # past the config's check
    with pytest.raises(ValueError, match="layout letter 'X' is none of F, L, I"):
        flops.pairs(cfg, 1, 2, 8, False)


@FAST
@given(n=st.integers(1, 4), L=st.integers(1, 8))
def test_local_with_wide_window_is_full_and_n1_masks_are_causal(n, L):
    t = torch.arange(n * L)
    causal = torch.ones(n * L, n * L, dtype=torch.bool).tril()
    assert torch.equal(dense_mask(local(n * L), t, t), causal)
    assert torch.equal(dense_mask(full, t, t), causal)
    t1 = torch.arange(L)
    for make in (intra, shared_intra):
        assert torch.equal(dense_mask(make(1), t1, t1), torch.ones(L, L, dtype=torch.bool).tril())


@FAST
@given(n=st.integers(1, 4), L=st.integers(1, 9), heads=st.sampled_from([(4, 2), (2, 2)]), seed=st.integers(0, 999))
def test_intra_fold_equals_dense_mask_equals_independent_streams(n, L, heads, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads[0], n * L, 8, generator=g)
    k, v = (torch.randn(2, heads[1], n * L, 8, generator=g) for _ in range(2))
    t = torch.arange(n * L)
    dense = attend(q, k, v, dense_mask(intra(n), t, t))
    f = lambda x: fold(x.transpose(1, 2), n).transpose(1, 2)  # fold works on (B, T, ...)
    folded = unfold(attend(f(q), f(k), f(v), "causal").transpose(1, 2), n).transpose(1, 2)
    separate = torch.empty_like(dense)
    for s in range(n):  # every stream as its own causal sequence
        separate[:, :, s::n] = attend(q[:, :, s::n], k[:, :, s::n], v[:, :, s::n], "causal")
    torch.testing.assert_close(folded, dense, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(separate, dense, atol=1e-6, rtol=1e-5)


# -----------------------------------------------------------------------------
# the model against independent references


@FAST
@given(model=hd_models(layout="III", mirror_skip=False), L=st.integers(1, 8))
def test_all_intra_model_runs_each_stream_as_its_own_sequence(model, L):
    cfg, n = model.cfg, model.cfg.n_streams
    idx = torch.randint(cfg.vocab_size, (2, L))
    with torch.no_grad():
        h = model.hidden(idx)
        t = torch.arange(n * L)
        pos = t if cfg.positions == "expanded" else t // n
        for s in range(n):  # the backbone alone, on E_s[x] at that stream's positions
            p = pos[s::n]
            ref = model.backbone.run_blocks(model.tables[s](idx), [LayerPlan(p, "causal")] * cfg.n_layer)
            torch.testing.assert_close(h[:, s::n], ref, atol=1e-5, rtol=1e-5)


@FAST
@given(c=st.fixed_dictionaries(dict(n_layer=st.integers(3, 5), kv_mirror=st.booleans(), n_experts=st.sampled_from([0, 4]))),
       seed=st.integers(0, 999), L=st.integers(1, 10))
def test_n1_all_full_reproduces_the_backbone(c, seed, L):
    torch.manual_seed(seed)
    backbone = Transformer(tiny("moe", head_dim=8, ffn_hidden=48, **c)).eval()
    model = expand_streams(backbone, 1).eval()
    idx = torch.randint(61, (2, L + 1))
    with torch.no_grad():
        a, la = backbone(idx[:, :-1], idx[:, 1:])
        b, lb = model(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lb, la, atol=1e-6, rtol=1e-6)


@FAST
@given(model=hd_models(mirror_skip=False), L=st.integers(1, 8), impl=st.sampled_from(["fast", "flex"]),
       shared=st.booleans())
def test_every_path_equals_the_dense_reference(model, L, impl, shared):
    if shared and "I" not in model.cfg.layout:
        shared = False
    ref = twin(model, attn_impl="dense", shared_kv=shared)
    other = twin(model, attn_impl=impl, shared_kv=shared)
    idx = torch.randint(model.cfg.vocab_size, (2, L))
    with torch.no_grad():
        torch.testing.assert_close(other.hidden(idx), ref.hidden(idx), atol=2e-5, rtol=1e-5)


@FAST
@given(kind=st.sampled_from("FLIS"), n=st.integers(1, 3), L=st.integers(1, 5), window=st.integers(1, 6),
       impl=st.sampled_from(["fast", "dense", "flex"]), data=st.data())
def test_one_layer_black_box_changes_exactly_what_the_mask_allows(kind, n, L, window, impl, data):
    torch.manual_seed(0)
    layout = "I" if kind == "S" else kind
    model = HiddenDecoding(hd_cfg(n_layer=1, layout=layout, kv_mirror=False, n_streams=n, window=window,
                                  shared_kv=kind == "S", attn_impl=impl)).eval()
    idx = torch.randint(61, (1, L))
    j, s = data.draw(st.integers(0, L - 1)), data.draw(st.integers(0, n - 1))
    row = j * n + s
    bump = torch.zeros(1, L, 32)
    bump[0, j] = 10 * torch.randn(32)
    with torch.no_grad():
        clean = model.hidden(idx)
        h = model.tables[s].register_forward_hook(lambda mod, args, out: out + bump)  # row (j, s) only
        try:
            dirty = model.hidden(idx)
        finally:
            h.remove()
    # MoE groups rows by expert, so a rerouted row may shift others by float rounding (~1e-10);
    # a change through attention is >= 1e-4 here
    changed = (dirty - clean).abs().amax(-1)[0] > 1e-7
    allowed = torch.tensor([reference_allowed(kind, n, window, q, row) for q in range(n * L)])
    assert torch.equal(changed, allowed)


@FAST
@given(model=hd_models(kv_mirror=True, objective="final"), L=st.integers(1, 7), shared=st.booleans(),
       impl=st.sampled_from(["fast", "dense"]))
def test_mirror_skip_equals_running_every_stream(model, L, shared, impl):
    if shared and "I" not in model.cfg.layout:
        shared = False
    skip = twin(model, mirror_skip=True, shared_kv=shared, attn_impl=impl).train()
    ref = twin(model, mirror_skip=False, shared_kv=shared, attn_impl="dense").train()
    assert skip.cfg.mirror_skip_on and not ref.cfg.mirror_skip_on
    idx = torch.randint(model.cfg.vocab_size, (2, L + 1))
    a, la = skip(idx[:, :-1], idx[:, 1:])
    b, lb = ref(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(la, lb, atol=1e-6, rtol=1e-6)
    la.backward()
    lb.backward()
    for (name, p), q in zip(skip.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None or p.grad.abs().max() == 0, name
        else:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_under_the_skip_mirrored_routers_count_only_final_stream_rows():
    """The one thing the skip changes (documented at HDConfig.mirror_skip): the loads that
    loss-free balancing reads in the mirrored layers."""
    torch.manual_seed(0)
    model = HiddenDecoding(hd_cfg(kv_mirror=True, n_streams=2)).train()  # 3 layers: the last is mirrored
    ref = twin(model, mirror_skip=False).train()
    B, L, n, k = 2, 5, 2, model.cfg.top_k
    idx = torch.randint(61, (B, L + 1))
    model(idx[:, :-1], idx[:, 1:])
    ref(idx[:, :-1], idx[:, 1:])
    for skip_block, ref_block in zip(model.backbone.blocks, ref.backbone.blocks):
        mirrored = skip_block.mirror_source is not None
        assert skip_block.ffn.step_load.sum() == B * L * k * (1 if mirrored else n)
        assert ref_block.ffn.step_load.sum() == B * L * k * n


def test_mirror_skip_is_on_by_default_only_where_exact():
    assert hd_cfg(kv_mirror=True).mirror_skip_on is True
    assert hd_cfg(kv_mirror=False).mirror_skip_on is False
    assert hd_cfg(kv_mirror=True, objective="sum").mirror_skip_on is False


def test_config_copies_and_replaces_like_any_dataclass():
    cfg = hd_cfg(kv_mirror=True)
    assert replace(cfg) == cfg and cfg.mirror_skip is None  # the skip is resolved, not written back
    off = replace(cfg, kv_mirror=False)  # raised before: mirror_skip had been set to True
    assert off.mirror_skip is None and not off.mirror_skip_on
    assert replace(off, kv_mirror=True) == cfg
    assert replace(cfg, objective="sum").mirror_skip_on is False
    with pytest.raises(ValueError, match="mirror_skip"):
        replace(cfg, mirror_skip=True, objective="all")


@pytest.mark.parametrize("objective", ["final", "all", "sum"])
def test_objectives_equal_their_definitions(objective):
    torch.manual_seed(0)
    model = HiddenDecoding(hd_cfg(n_streams=3, objective=objective, kv_mirror=False))
    idx = torch.randint(61, (2, 7))
    x, y = idx[:, :-1], idx[:, 1:]
    logits, loss = model(x, y)
    h = model.hidden(x)  # (B, L*n, C): row t = i*n + k
    head = lambda z: model.backbone.lm_head(model.backbone.norm_f(z))
    ce = torch.nn.functional.cross_entropy
    if objective == "final":
        ref = ce(head(h[:, 2::3]).flatten(0, 1), y.flatten())
    elif objective == "all":
        ref = sum(ce(head(h[:, k::3]).flatten(0, 1), y.flatten()) for k in range(3)) / 3
    else:
        ref = ce(head(h[:, 0::3] + h[:, 1::3] + h[:, 2::3]).flatten(0, 1), y.flatten())
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    assert logits.shape == (2, 6, 61)


def test_gradcheck_hd_intra_folded_into_the_batch():
    torch.manual_seed(0)
    model = HiddenDecoding(tiny("hd", **{**F64, "n_experts": 0}, n_streams=3, layout="III", window=8, mirror_skip=False)).double()
    idx, tgt = f64_batch(3)
    for name in ("tables.1.weight", "backbone.blocks.1.attn.q_proj.weight"):
        gradcheck_wrt(model, name, lambda m: m(idx, tgt)[1])


def test_gradcheck_hd_kv_mirror_mirror_skip_on():
    torch.manual_seed(0)
    model = HiddenDecoding(tiny("hd", **{**F64, "n_experts": 0}, n_streams=2, layout="IFL", window=3,
                                    mirror_skip=True)).double()
    assert model.cfg.mirror_skip_on
    idx, tgt = f64_batch(4)
    for name in ("tables.0.weight", "backbone.blocks.0.attn.k_proj.weight", "backbone.blocks.2.attn.k_proj.weight"):
        gradcheck_wrt(model, name, lambda m: m(idx, tgt)[1])


# -----------------------------------------------------------------------------
# progressive expansion


@FAST
@given(model=hd_models(positions="token", mirror_skip=False), L=st.integers(1, 8))
def test_expansion_copies_tables_cyclically_and_all_intra_keeps_the_final_stream(model, L):
    n = model.cfg.n_streams
    model = twin(model, layout="I" * model.cfg.n_layer)
    big = expand_streams(model, 2 * n).eval()
    for k in range(2 * n):  # E_{n+k} <- E_k
        assert torch.equal(big.tables[k].weight, model.tables[k % n].weight)
    idx = torch.randint(model.cfg.vocab_size, (2, L))
    with torch.no_grad():
        torch.testing.assert_close(big(idx)[0], model(idx)[0], atol=1e-5, rtol=1e-5)


def test_expansion_from_an_n1_backbone_checkpoint():
    torch.manual_seed(0)
    backbone = Transformer(tiny("moe", head_dim=8))
    model = expand_streams(backbone, 2, layout="IFI")
    assert model.cfg.n_streams == 2 and model.cfg.layout == "IFI"
    for t in model.tables:
        assert torch.equal(t.weight, backbone.wte.weight)
    for name, p in model.backbone.named_parameters():
        assert torch.equal(p, backbone.get_parameter(name))
    other = Transformer(tiny("moe", n_embd=48, head_dim=8))
    with pytest.raises(ValueError, match="n_embd"):
        from hd import load_backbone
        load_backbone(model, {k: v for k, v in other.state_dict().items() if not k.startswith("wte")}, other.cfg)
    with pytest.raises(ValueError, match="multiple"):
        expand_streams(model, 3)


@pytest.mark.parametrize("training", [True, False])
def test_expand_streams_keeps_dtype_and_mode(training):
    torch.manual_seed(0)
    model = HiddenDecoding(tiny("hd", **F64, n_streams=1, layout="IFI", window=8)).double().train(training)
    grown = expand_streams(model, 2)
    assert all(p.dtype == torch.float64 for p in grown.parameters())
    assert grown.training == training
    idx, tgt = f64_batch(1)
    assert grown(idx, tgt)[1].dtype == torch.float64


# -----------------------------------------------------------------------------
# cached decoding


@FAST
@given(model=hd_models(block_size=6), shared=st.booleans(), data=st.data())
def test_cache_filled_to_block_size_in_place_then_one_more_token_is_a_clear_error(model, shared, data):
    """The preallocated caches: every step writes into the buffers allocated at the first one,
    filling them to block_size tokens exactly still equals the full forward, and one token
    more raises."""
    if shared and "I" in model.cfg.layout:
        model = twin(model, shared_kv=True)
    T = data.draw(st.integers(1, 6))
    idx = torch.randint(model.cfg.vocab_size, (2, 6))
    caches = make_caches(model)
    with torch.no_grad():
        model(idx[:, :T], caches=caches)
        storage = [c.k.data_ptr() for c in caches]
        for t in range(T, 6):
            got, _ = model(idx[:, t:t + 1], caches=caches)
            torch.testing.assert_close(got[:, 0], model(idx[:, :t + 1])[0][:, t], atol=1e-5, rtol=1e-5)
        assert [c.k.data_ptr() for c in caches] == storage
        assert [len(c) for c in caches] == [6 * model.kv_rows_per_token(i) for i in range(model.cfg.n_layer)]
        with pytest.raises(ValueError, match="block_size"):
            model(idx[:, :1], caches=caches)


@FAST
@given(window=st.integers(1, 9), chunks=st.lists(st.integers(1, 12), min_size=1, max_size=8), seed=st.integers(0, 99))
def test_the_window_cache_returns_the_window_of_a_full_cache(window, chunks, seed):
    """The ring (generate.WindowCache) against a brute force: a full KVCache fed the same chunks,
    from which a chunk's queries can reach its rows and the window - 1 rows before it. Chunks
    cross the ring's wrap-around and outgrow the window; the ring never holds more than it, nor more
    than the cache's capacity."""
    g = torch.Generator().manual_seed(seed)
    full, ring = KVCache(sum(chunks)), WindowCache(window, sum(chunks))
    for T in chunks:
        k, v = torch.randn(2, 2, T, 4, generator=g), torch.randn(2, 2, T, 4, generator=g)
        K, V = full.update(k, v)
        Kr, Vr = ring.update(k, v)
        first = max(0, len(full) - T - (window - 1))
        assert torch.equal(Kr, K[:, :, first:]) and torch.equal(Vr, V[:, :, first:])
        assert len(ring) == len(full) and ring.k.size(2) == min(window, sum(chunks))  # a window past the capacity: every row


def test_an_l_layer_reads_the_same_rows_per_step_at_2x_and_20x_its_window():
    """The L layer's decode step: its cache holds `window` rows and hands the step the window - 1
    rows before it plus the new token's n rows, after a prompt 2 or 20 windows long."""
    n, window = 2, 4
    model = HiddenDecoding(hd_cfg(layout="IFL", n_streams=n, window=window, block_size=81, kv_mirror=False)).eval()
    read = []
    for prompt in (2 * window, 20 * window):  # tokens
        caches = make_caches(model)
        with torch.no_grad():
            model(torch.randint(61, (1, prompt)), caches=caches)
            K, _ = caches[2].update(*(torch.zeros(1, 2, n, 8) for _ in range(2)))  # what the next step reads
        read.append((K.size(2), caches[2].k.size(2)))
    assert read[0] == read[1] == (window - 1 + n, window)


def test_caches_that_do_not_fit_the_layers_are_refused():
    model = HiddenDecoding(hd_cfg(layout="IFI")).eval()
    idx = torch.randint(61, (1, 4))
    with pytest.raises(ValueError, match="make_caches"):  # layer 1 keeps n rows per token: room too small
        model(idx, caches=[KVCache(model.cfg.block_size) for _ in range(3)])
    with pytest.raises(ValueError, match="make_caches"):
        model(idx, caches=make_caches(model)[:2])  # one short
    other = HiddenDecoding(hd_cfg(layout="FFI")).eval()
    caches = make_caches(other)
    with torch.no_grad():
        other(idx, caches=caches)
        with pytest.raises(ValueError, match="make_caches"):  # written by another layout: rows per token differ
            model(idx[:, :1], caches=caches)


def test_greedy_generate_equals_argmax_of_full_forwards():
    torch.manual_seed(0)
    model = HiddenDecoding(hd_cfg(n_streams=3, layout="IFL")).eval()
    idx = torch.randint(61, (2, 4))
    out = generate(model, idx, 5, temperature=0)
    ref = idx
    with torch.no_grad():
        for _ in range(5):
            ref = torch.cat([ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)


# -----------------------------------------------------------------------------
# flex_attention, CUDA paths and compiled training


def test_compiled_flex_forward_on_cpu_equals_dense_for_every_mask():
    n, L, window = 3, 50, 7  # 150 rows: not a multiple of the 128 block
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, n * L, 16, generator=g)
    k, v = (torch.randn(1, 2, n * L, 16, generator=g) for _ in range(2))
    t = torch.arange(n * L)
    compiled = torch.compile(flex_attention, dynamic=False)
    for kind, make in MASK_OF.items():
        mod = make(n, window)
        bm = create_block_mask(mod, None, None, n * L, n * L, device="cpu")
        ref = attend(q, k, v, dense_mask(mod, t, t))
        torch.testing.assert_close(flex_attention(q, k, v, block_mask=bm, enable_gqa=True), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(compiled(q, k, v, block_mask=bm, enable_gqa=True), ref, atol=1e-5, rtol=1e-5)


@cuda
@pytest.mark.parametrize("layout, shared", [("FLI", False), ("IIF", False), ("LLL", False), ("IFI", True)])
def test_cuda_flex_forward_and_backward_equal_dense(layout, shared):
    """Every mask as a flex BlockMask (L and shared-KV I on the fast path; F and L and shared I
    as the mirrored last layer under the skip, through on_final_rows) against the dense path."""
    torch.manual_seed(0)
    model = HiddenDecoding(hd_cfg(n_streams=4, layout=layout, window=5, kv_mirror=True, shared_kv=shared,
                                  head_dim=16)).cuda()  # 16: flex's CUDA kernels (below, the dense path)
    ref = twin(model, attn_impl="dense").cuda()
    idx = torch.randint(61, (2, 20), device="cuda")
    a, la = model(idx[:, :-1], idx[:, 1:])
    b, lb = ref(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    la.backward()
    lb.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3)


@cuda
def test_cuda_bf16_training_step_follows_float32():
    """What train_tiny does on CUDA: autocast bf16 forward (flex BlockMasks, grouped-matmul
    experts), float32 loss, finite gradients, and an AdamW step that lowers the loss."""
    torch.manual_seed(0)
    model = HiddenDecoding(hd_cfg(n_streams=4, layout="IFL", window=5, head_dim=16)).cuda()
    idx = torch.randint(61, (4, 33), device="cuda")
    with torch.no_grad():
        ref = model(idx[:, :-1], idx[:, 1:])[1]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with torch.autocast("cuda", torch.bfloat16):
        loss = model(idx[:, :-1], idx[:, 1:])[1]
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, atol=3e-2, rtol=1e-2)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    opt.step()
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        assert model(idx[:, :-1], idx[:, 1:])[1] < loss


@cuda
def test_cuda_compiled_model_equals_eager():
    """The default CUDA run's compiled training step (fullgraph, flex BlockMasks, the gather
    dispatch): eager's logits, loss and gradients."""
    torch.manual_seed(0)
    model = HiddenDecoding(hd_cfg(n_streams=2, layout="FLI", head_dim=16)).cuda()  # L takes flex, inside the graph
    idx = torch.randint(61, (2, 17), device="cuda")
    runs = []
    for m in (model, torch.compile(model, fullgraph=True)):
        logits, loss = m(idx[:, :-1], idx[:, 1:])
        loss.backward()
        runs.append((logits, loss, [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    (a, la, ga), (b, lb, gb) = runs
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)
    for x, y in zip(gb, ga):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-3)


@cuda
@pytest.mark.parametrize("hd", [False, True])
def test_cuda_forward_and_decode_step_never_wait_for_the_device(hd):
    """Input checks read no values on CUDA (a min or max would make the host wait once per
    forward): a training forward with targets and a cached decode step run under
    torch.cuda.set_sync_debug_mode("error"), which raises at any synchronizing call. Dense
    feed-forward: the MoE's loop dispatch reads expert counts on the host by design."""
    torch.manual_seed(0)
    cfg = hd_cfg(n_streams=3, layout="IFI", n_experts=0)
    model = (HiddenDecoding(cfg) if hd else Transformer(tiny("moe", head_dim=8, ffn_hidden=48, n_experts=0))).cuda().eval()
    idx = torch.randint(61, (2, 8), device="cuda")
    caches = make_caches(model)
    with torch.no_grad():
        model(idx, caches=caches)  # the prefill allocates the caches
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(idx, idx)
            model(idx[:, :1], caches=caches)
        finally:
            torch.cuda.set_sync_debug_mode(0)


def hd(head_dim=16, **kw):
    return tiny("hd", head_dim=head_dim, **kw)  # conftest's tiny HD config


def tah_cfg(head_dim):
    return tiny("tah", vocab_size=53, n_layer=1, head_dim=head_dim, kv_mirror=False, attn_impl="flex")


def equal_to_dense(model, idx, atol=1e-4):
    """model's loss and gradients against its twin on the dense reference path."""
    ref = HiddenDecoding(replace(model.cfg, attn_impl="dense")).to(idx.device)
    ref.load_state_dict(model.state_dict())
    (a, la), (b, lb) = model(idx[:, :-1], idx[:, 1:]), ref(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(a, b, atol=atol, rtol=atol)
    la.backward()
    lb.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=1e-3)


@pytest.mark.parametrize("head_dim, path", [(8, "dense"), (15, "dense"), (16, "block"), (32, "block")])
def test_the_fast_path_gives_cuda_flex_only_from_head_dim_16(head_dim, path):
    """The L layer (index 2 of "IFL") on CUDA takes flex's BlockMask from head_dim 16 on, the
    dense mask below; on the CPU it is dense at any width, and I and F keep their kernels."""
    cfg = hd(head_dim)
    assert attention_path(cfg, 2, False, CUDA) == path
    assert attention_path(cfg, 2, False, torch.device("cpu")) == "dense"
    assert [attention_path(cfg, i, False, CUDA) for i in (0, 1)] == ["fold", "causal"]


def test_an_explicit_flex_is_refused_on_cuda_below_head_dim_16():
    ThinkAtHard(tah_cfg(8))  # the config is fine: the refusal is the device's, at the forward
    for head_dim in (8, FLEX_MIN_HEAD_DIM - 1):
        with pytest.raises(ValueError, match=f"needs head_dim >= 16 on CUDA.*got {head_dim}"):
            check_flex("flex", CUDA, head_dim)
    check_flex("flex", CUDA, FLEX_MIN_HEAD_DIM)  # 16 passes
    check_flex("fast", CUDA, 8)  # the fast path picks dense itself


@cuda
@pytest.mark.parametrize("head_dim", [8, 16])
def test_cuda_both_sides_of_16_train_and_equal_the_dense_reference(head_dim):
    """Below 16 the L layer runs dense, from 16 flex: either way a training step's loss and
    gradients are the dense reference's; and an explicit flex below 16 says so in one line."""
    torch.manual_seed(0)
    equal_to_dense(HiddenDecoding(hd(head_dim, n_streams=4)).cuda(), torch.randint(61, (2, 20), device="cuda"))
    if head_dim < FLEX_MIN_HEAD_DIM:
        tah_model = ThinkAtHard(tah_cfg(head_dim)).cuda()
        with pytest.raises(ValueError, match="needs head_dim >= 16 on CUDA"):
            tah_model(torch.randint(53, (2, 8), device="cuda"))


def test_a_model_whose_layers_take_flex_compiles_whole():
    """Every layer a BlockMask (attn_impl "flex"; the CPU runs its forward), compiled with
    fullgraph=True: one graph, eager's logits."""
    torch.manual_seed(0)
    model = HiddenDecoding(hd(attn_impl="flex", layout="FLI")).eval()
    counter = CompileCounter()
    idx = torch.randint(61, (2, 12))
    with torch.no_grad():
        got = torch.compile(model, backend=counter, fullgraph=True)(idx)[0]
        torch.testing.assert_close(got, model(idx)[0], atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


@cuda
def test_cuda_eager_flex_is_the_one_compiled_flex_and_compiled_models_trace_their_own(monkeypatch):
    """Eager CUDA calls moe.FLEX for every flex layer; a compiled model never calls it (it traces
    flex_attention in its own graph) and equals eager."""
    calls = []
    real = moe.FLEX
    monkeypatch.setattr(moe, "FLEX", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.manual_seed(0)
    model = HiddenDecoding(hd(layout="FLI")).cuda()
    idx = torch.randint(61, (2, 12), device="cuda")
    eager = model(idx)[0]
    assert len(calls) == 1  # the one L layer
    compiled = torch.compile(model, fullgraph=True)(idx)[0]
    assert len(calls) == 1
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("kind, kw", COMPILE_MODELS[:2])
def test_the_training_forward_and_backward_trace_whole_and_equal_eager(kind, kw):
    """The training step (forward, loss, backward) traces as one graph through aot_autograd,
    with eager's loss, gradients and balancing counts."""
    torch.manual_seed(0)
    model = compile_model(kind, **kw).train()
    ref = compile_model(kind, **kw, moe_dispatch="loop").train()
    ref.load_state_dict(model.state_dict())
    counter = CompileCounterWithBackend("aot_eager")
    idx = torch.randint(64, (2, 12))
    loss = torch.compile(model, backend=counter, fullgraph=True)(idx, idx)[1]
    loss.backward()
    ref_loss = ref(idx, idx)[1]
    ref_loss.backward()
    assert counter.frame_count == 1
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    body = lambda m: m.backbone if kind == "hd" else m
    for a, b in zip(body(model).moe_layers(), body(ref).moe_layers()):
        assert torch.equal(a.step_load, b.step_load)


def test_a_block_mask_is_built_once_per_shape_and_reused_by_every_later_forward(monkeypatch):
    """P4's BlockMask cache: hd.block_mask builds a mask once per (parameters, lengths, device) and
    hands the same object back (no create_block_mask: ~90 kernels on CUDA); other lengths build
    their own; past MAX_BLOCK_MASKS the oldest goes; a forward of an attn_impl="flex" model twice
    builds its masks in the first forward only."""
    import hd
    built, real = [], hd.create_block_mask
    monkeypatch.setattr(hd, "create_block_mask", lambda *a, **kw: built.append(a[3:5]) or real(*a, **kw))
    monkeypatch.setattr(hd, "BLOCK_MASKS", {})
    first = hd.block_mask(intra(2), ("I", 2), 8, 8, "cpu")
    assert hd.block_mask(intra(2), ("I", 2), 8, 8, "cpu") is first and len(built) == 1
    assert hd.block_mask(intra(2), ("I", 2), 16, 16, "cpu") is not first and len(built) == 2
    for i in range(hd.MAX_BLOCK_MASKS):
        hd.block_mask(intra(2), ("I", 2, i), 8, 8, "cpu")
    assert len(hd.BLOCK_MASKS) == hd.MAX_BLOCK_MASKS and (("I", 2), 8, 8, "cpu") not in hd.BLOCK_MASKS
    model = HiddenDecoding(tiny("hd", block_size=16, n_head=2, n_kv_head=1, n_experts=0, ffn_hidden=32,
                                 attn_impl="flex")).eval()
    idx = torch.randint(61, (1, 6))
    built.clear()
    with torch.no_grad():
        a = model(idx)[0]
        after_first = len(built)
        b = model(idx)[0]
    assert after_first >= 1 and len(built) == after_first
    torch.testing.assert_close(a, b)


# -----------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("kw, words", [
    (dict(n_streams=0), "n_streams"),
    (dict(layout="IF"), "layout"),
    (dict(layout="IFX"), "layout"),
    (dict(window=0), "window"),
    (dict(positions="rope"), "positions"),
    (dict(objective="mean"), "objective"),
    (dict(attn_impl="triton"), "attn_impl"),
    (dict(layout="FFF", shared_kv=True), "shared_kv"),
    (dict(objective="all", mirror_skip=True), "mirror_skip"),
    (dict(objective="sum", mirror_skip=True), "mirror_skip"),
    (dict(kv_mirror=False, mirror_skip=True), "mirror_skip"),
    (dict(layout=None), "layout"),
    (dict(layout=123), "layout"),
    (dict(n_streams=True), "n_streams"),
    (dict(mirror_skip="on"), "mirror_skip"),
])
def test_bad_config_raises(kw, words):
    with pytest.raises(ValueError, match=words):
        hd_cfg(**kw)


def test_too_long_sequence_raises():
    model = HiddenDecoding(hd_cfg(block_size=8))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="block_size"):
        generate(model, torch.zeros(1, 5, dtype=torch.long), 4)


def test_bad_inputs_raise_one_clear_error():
    model = HiddenDecoding(hd_cfg())
    V = model.cfg.vocab_size
    with pytest.raises(ValueError, match="idx must hold ids"):
        model(torch.full((1, 4), V))
    with pytest.raises(ValueError, match="targets must have idx's shape"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="every target is -1"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3), -1))
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="n_new must be an int"):
        expand_streams(model, 4.0)
    with pytest.raises(ValueError, match="n_streams=8 contradicts n_new=4"):
        expand_streams(model, 4, n_streams=8)
    flex = HiddenDecoding(hd_cfg(attn_impl="flex"))
    with pytest.raises(ValueError, match="forward only on CPU"):
        flex(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    with torch.no_grad():
        flex(torch.zeros(1, 3, dtype=torch.long))  # forward only: fine


if __name__ == "__main__":
    from checks import not_a_script
    not_a_script("test_hd.py", "python -m pytest test_hd.py")
