"""Decoding (generate.py) kept apart from the methods, and its caches' refusals; cached decoding
equals the full forward, one check for the backbone and HD (at the end: TaH's passes keep theirs in
test_tah.py)."""

import ast
import contextlib
import re
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from hypothesis import given, strategies as st

import generate as decoding
import moe
from conftest import COMPILE_MODELS, FAST, compile_model, tiny
from generate import (KVCache, StaticTaHCache, TaHCache, WindowCache, compiled_step, generate, generate_tah, lora_merged,
                      make_caches, sample)
from hd import HiddenDecoding
from moe import Transformer
from tah import ThinkAtHard, stage1_loss, stage2_loss
from test_hd import hd_models, twin  # the drawn HD models, and one's twin under other settings
from test_moe import build, model_configs  # the drawn backbones

HERE = Path(__file__).resolve().parent
SMALL = dict(vocab_size=61, block_size=16, n_layer=3, n_embd=32, n_head=6, n_kv_head=2, head_dim=8, n_experts=4,
             expert_hidden=16, ffn_hidden=48)


def imported_modules(path):
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("method_file", ["moe.py", "hd.py", "tah.py"])
def test_the_method_files_import_nothing_from_the_decoding_file(method_file):
    assert "generate" not in imported_modules(HERE / method_file)


@pytest.mark.parametrize("kind", ["moe", "hd", "hd-skip"])
def test_a_cache_continued_with_another_batch_size_is_refused_and_stays_as_it_was(kind):
    torch.manual_seed(0)
    model = (Transformer(tiny("moe", **SMALL)) if kind == "moe" else
             HiddenDecoding(tiny("hd", **SMALL, layout="IFI", window=8, mirror_skip=kind == "hd-skip"))).eval()
    idx = torch.randint(61, (3, 5))
    caches = make_caches(model)
    with torch.no_grad():
        model(idx[:, :4], caches=caches)
        before = [(len(c), c.k.clone(), c.v.clone()) for c in caches]
        with pytest.raises(ValueError, match="batch rows"):
            model(idx[:2, 4:], caches=caches)
        for c, (n, k, v) in zip(caches, before):
            assert len(c) == n and torch.equal(c.k, k) and torch.equal(c.v, v)
        got, _ = model(idx[:, 4:], caches=caches)  # the right batch still continues them
        torch.testing.assert_close(got, model(idx)[0][:, 4:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, None])
def test_caches_refuse_a_bad_size(bad):
    with pytest.raises(ValueError, match="capacity"):
        KVCache(bad)
    with pytest.raises(ValueError, match="batch rows"):
        TaHCache(ThinkAtHard(tiny("tah", **{**SMALL, "n_experts": 0}, logit_topk=8)), bad, "cpu")


def test_generate_writes_prompt_and_new_tokens_to_block_size_exactly():
    torch.manual_seed(0)
    model = Transformer(tiny("moe", **SMALL)).eval()
    out = generate(model, torch.randint(61, (2, 6)), 10, temperature=0)
    assert out.shape == (2, 16)
    with pytest.raises(ValueError, match="block_size"):
        generate(model, torch.randint(61, (2, 6)), 11)


def tah_model(n_layer=3):
    return ThinkAtHard(tiny("tah", vocab_size=11, block_size=16, n_layer=n_layer, head_dim=8, expert_hidden=64,
                            ffn_hidden=32, kv_mirror=n_layer >= 3, logit_topk=5, max_depth=2, lora_rank=4))


def moe_model():
    return Transformer(tiny("moe", vocab_size=11, block_size=16, head_dim=8))


IDX = torch.zeros(1, 4, dtype=torch.long)


@pytest.mark.parametrize("call, words", [
    (lambda: TaHCache(tah_model(1), 1, "nodevice"), "device must be"),
    (lambda: TaHCache(tah_model(1), 1, "cpu:1"), "device 'cpu:1' is not a device of this machine"),
    (lambda: TaHCache(tah_model(1), 1, f"cuda:{torch.cuda.device_count()}"), "is not a device of this machine"),
    (lambda: moe_model().run_blocks(torch.zeros(1, 4, 32), []), "one plan per block: 3 blocks, 0 plans"),
    (lambda: tah_model(3)(IDX, cache=TaHCache(tah_model(1), 1, "cpu")), "made for 1 layer(s), this model has 3"),
    (lambda: tah_model(3)(IDX, cache=make_caches(moe_model())), "cache must be None or one TaH cache"),
    (lambda: generate(tah_model(), IDX, 2), "got ThinkAtHard: use TaHCache and generate_tah"),
    (lambda: make_caches(tah_model()), "got ThinkAtHard: use TaHCache and generate_tah"),
    (lambda: generate_tah(moe_model(), IDX, 2), "generate_tah takes a tah.ThinkAtHard, got Transformer"),
    (lambda: TaHCache(moe_model(), 1, "cpu"), "TaHCache takes a tah.ThinkAtHard, got Transformer"),
    (lambda: lora_merged(moe_model()).__enter__(), "lora_merged takes a tah.ThinkAtHard"),
    (lambda: moe_model()(IDX, caches=(1, 2, 3)), "caches must be a list of one KV cache per layer"),
    (lambda: moe_model()(IDX, caches=[None] * 3), "caches must be a list of one KV cache per layer"),
    (lambda: generate(moe_model(), IDX, 2, generator="x"), "generator must be None or a torch.Generator"),
    (lambda: generate_tah(tah_model(), IDX, 2, generator="x"), "generator must be None or a torch.Generator"),
    (lambda: sample(torch.full((2, 5), float("nan")), temperature=0), "logits must be finite"),
    (lambda: sample(torch.randn(32)), "logits must be a float tensor (B, V)"),
])
def test_decoding_refuses_what_it_cannot_serve_with_one_clear_error(call, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        call()


def test_a_cache_of_the_wrong_kind_for_its_layer_is_refused():
    """A window-1 L layer reads only its own row: given a plain cache (every row) in place of its
    ring, decoding would read rows its mask excludes, silently wrong. Refused, naming the layer;
    the right caches decode the full forward's logits (the reference)."""
    torch.manual_seed(0)
    model = HiddenDecoding(tiny("hd", vocab_size=11, block_size=16, head_dim=8, n_experts=0, expert_hidden=64,
                                layout="ILI", window=1)).eval()
    idx = torch.randint(11, (1, 6))
    caches = make_caches(model)
    wrong = caches[:1] + [KVCache(caches[1].capacity)] + caches[2:]
    with torch.no_grad(), pytest.raises(ValueError, match="cache 1 keeps every row, layer 1 reads the last 1 rows"):
        model(idx, caches=wrong)
    with torch.no_grad():
        model(idx[:, :5], caches=caches)
        torch.testing.assert_close(model(idx[:, 5:], caches=caches)[0][:, -1], model(idx)[0][:, -1],
                                   atol=1e-5, rtol=1e-5)


# -----------------------------------------------------------------------------
# Static caches: a decode step a CUDA graph can replay


class OpStream(TorchDispatchMode):
    """Every aten op a step runs, with its tensors' shapes and every other argument's value."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        self.ops.append((str(func), tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                                          for a in leaves)))
        return func(*args, **(kwargs or {}))


STATIC_MODELS = [("moe", {}), ("hd", dict(layout="IIFLII", window=5, n_streams=4)),
                 ("hd", dict(layout="FLI", window=3, n_streams=2, kv_mirror=True)),  # the skip's mirrored layer: I
                 ("hd", dict(layout="LIF", n_streams=3, mirror_skip=False)), ("hd", dict(layout="IFI", shared_kv=True))]


def static_model(kind, kw):
    torch.manual_seed(0)
    base = dict(vocab_size=64, block_size=40, n_layer=len(kw.get("layout", "abc")), n_embd=32, n_head=6, n_kv_head=2,
                head_dim=16, n_experts=4, kv_mirror=kw.pop("kv_mirror", False) if kind == "hd" else True)
    if kind == "moe":
        return Transformer(tiny("moe", **base, expert_hidden=64)).eval()
    return HiddenDecoding(tiny("hd", **{"window": 8, **base, "expert_hidden": 64, **kw})).eval()


@pytest.mark.parametrize("kind, kw", STATIC_MODELS)
def test_static_caches_decode_the_growing_caches_tokens_and_every_step_runs_the_same_ops(kind, kw):
    """StaticCache (every row read, the count on the device): greedy decoding gives the growing
    caches' tokens (themselves checked against the full forward), and two decode steps run the same
    ops on the same shapes with the same arguments, so one step captured as a CUDA graph replays
    every later one. The growing caches' steps differ (the check can fail)."""
    model = static_model(kind, dict(kw))
    idx = torch.randint(64, (2, 5))
    tokens, streams = {}, {}
    with torch.no_grad():
        for static in (False, True):
            caches = make_caches(model, static=static)
            x, out, logs = model(idx, caches=caches)[0][:, -1:].argmax(-1), [], []
            for _ in range(12):
                with OpStream() as log:
                    x = model(x, caches=caches)[0][:, -1:].argmax(-1)
                out.append(x)
                logs.append(log.ops)
            tokens[static], streams[static] = torch.cat(out, 1), logs
    assert torch.equal(tokens[True], tokens[False])
    assert streams[True][3] == streams[True][10]
    assert streams[False][3] != streams[False][10]


def test_cuda_graph_decoding_needs_cuda_and_no_compile():
    model = static_model("moe", {})
    with pytest.raises(ValueError, match="cuda_graph=True takes a model and tokens on a CUDA device"):
        generate(model, IDX, 2, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph must be True or False"):
        generate(model, IDX, 2, cuda_graph=1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind, kw", STATIC_MODELS)
def test_cuda_graph_decoding_gives_eagers_tokens(kind, kw):
    model = static_model(kind, dict(kw)).cuda()
    idx = torch.randint(64, (2, 5), device="cuda")
    eager = generate(model, idx, 20, temperature=0)
    assert torch.equal(generate(model, idx, 20, temperature=0, cuda_graph=True), eager)


def tah_static_model():
    torch.manual_seed(0)
    model = ThinkAtHard(tiny("tah", vocab_size=64, expert_hidden=64, threshold=0.5)).eval()
    with torch.no_grad():  # adapters that change the second pass, a decider that sends some tokens on
        for m in model.loras:
            m.B.normal_(std=0.2)
        torch.nn.init.normal_(model.decider.mlp[4].weight, std=2.0)
    return model


def tah_steps(model, cache, idx, mode, steps=10):
    """Greedy decoding through `cache`: the tokens, the passes, and each step's op stream."""
    out, tokens, passes, logs = model(idx, mode=mode, cache=cache), [], [], []
    for _ in range(steps):
        x = out.logits[:, -1:].argmax(-1)
        with OpStream() as log:
            out = model(x, mode=mode, cache=cache)
        tokens.append(x), passes.append(out.depths), logs.append(log.ops)
    return torch.cat(tokens, 1), torch.cat(passes, 1), logs


@pytest.mark.parametrize("B, mode", [(1, "always"), (2, "decider"), (3, "always")])
def test_static_tah_caches_decode_the_preallocated_caches_tokens_and_passes(B, mode):
    """StaticTaHCache (every slot read, its count and positions on the device) gives TaHCache's
    tokens and passes, also when the decider sends some rows on (their rows written by index);
    with every row on the same passes (B = 1, "always"), two steps run the same ops on the same
    shapes and arguments, which is what a replayed graph needs. TaHCache's steps differ."""
    model, idx = tah_static_model(), torch.randint(64, (B, 6), generator=torch.Generator().manual_seed(B))
    with torch.no_grad(), lora_merged(model):
        grow = tah_steps(model, TaHCache(model, B, "cpu"), idx, mode)
        static = tah_steps(model, StaticTaHCache(model, B, "cpu"), idx, mode)
    assert torch.equal(static[0], grow[0]) and torch.equal(static[1], grow[1])
    if mode == "always":
        assert static[2][2] == static[2][7] and grow[2][2] != grow[2][7]


def test_tah_cuda_graph_decoding_needs_cuda():
    with pytest.raises(ValueError, match="cuda_graph=True takes a model and tokens on a CUDA device"):
        generate_tah(tah_static_model(), IDX, 2, cuda_graph=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B, mode", [(1, "always"), (1, "decider"), (2, "decider")])
def test_cuda_graph_tah_decoding_gives_eagers_tokens_and_passes(B, mode):
    model = tah_static_model().cuda()
    idx = torch.randint(64, (B, 6), device="cuda")
    eager = generate_tah(model, idx, 16, temperature=0, mode=mode)
    graphed = generate_tah(model, idx, 16, temperature=0, mode=mode, cuda_graph=True)
    assert torch.equal(graphed[0], eager[0]) and torch.equal(graphed[1], eager[1])


# -----------------------------------------------------------------------------
# CUDA's rules for a captured step, pinned on the CPU: CUDA's stream and graph calls faked, each
# capture run once under NoHostRead with meta as the default device


aten = torch.ops.aten


HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "_unique2", "unique_dim",
              "unique_consecutive"}


class NoHostRead(TorchDispatchMode):
    """Fails on every op that hands the host a value the device computed: a CUDA graph's capture
    can wait on nothing (.item(), nonzero, a boolean-mask index, a data-dependent size)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                              aten._index_put_impl_.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        sized_by_data = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        if func.overloadpacket.__name__ in HOST_READS or bool_index or sized_by_data:
            raise AssertionError(f"{func} waits on the device inside a captured step")
        return func(*args, **kwargs)


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    """CUDA's stream and graph calls on the CPU: a side stream is the CPU itself, a capture runs its
    step once under NoHostRead with meta as the default device (a tensor made without device= would
    be meta, and meet the CPU's in the first op). Returns the phases and each MoE layer's dispatch
    in them, as (phase, dispatch)."""
    seen, phase = [], ["eager"]

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    class Graph:
        def replay(self):
            pass

    @contextlib.contextmanager
    def on_stream(stream):
        phase[0] = "warm-up"
        yield

    @contextlib.contextmanager
    def capture(graph, **kw):
        phase[0] = "capture"
        with NoHostRead(), torch.device("meta"):
            yield
        phase[0] = "eager"

    real = moe.dispatch
    monkeypatch.setattr(moe, "dispatch", lambda m, *a: seen.append((phase[0], real(m, *a))) or seen[-1][1])
    for name, fake in (("Stream", Stream), ("stream", on_stream), ("current_stream", lambda device=None: Stream()),
                       ("CUDAGraph", Graph), ("graph", capture)):
        monkeypatch.setattr(torch.cuda, name, fake)
    return seen


@pytest.mark.parametrize("kind, kw", STATIC_MODELS)
def test_a_captured_decode_step_reads_nothing_on_the_host_and_warms_up_on_its_own_dispatch(kind, kw,
                                                                                            fake_cuda_graphs):
    """generate.graphed_step's capture (the backbone; HD with every letter, the mirror and its skip,
    shared KV; experts on): no op waits on the device and no tensor is made off it; the warm-up
    before it runs the MoE dispatch the capture records, one of the static ones."""
    model = static_model(kind, dict(kw))
    caches = make_caches(model, static=True)
    with torch.no_grad():
        model(torch.randint(64, (2, 5)), caches=caches)  # the prompt, eager
    decoding.graphed_step(model, caches, 2)
    by_phase = {p: [d for q, d in fake_cuda_graphs if q == p] for p in ("warm-up", "capture")}
    assert by_phase["capture"] and by_phase["warm-up"] == by_phase["capture"], fake_cuda_graphs
    assert set(by_phase["capture"]) <= {"gather", "masked"}


@pytest.mark.parametrize("experts", [0, 4])
def test_every_captured_tah_pass_reads_nothing_on_the_host_and_warms_up_on_its_own_dispatch(experts,
                                                                                            fake_cuda_graphs):
    """StaticTaHCache's pass graphs, depth 0 and depth 1 (every token of 3 rows two passes): as above."""
    torch.manual_seed(0)
    model = ThinkAtHard(tiny("tah", vocab_size=64, n_experts=experts, expert_hidden=64)).eval()
    cache = StaticTaHCache(model, 3, "cpu")  # graphed=True takes CUDA: its replay, on faked graph calls, here
    cache.graphed = cache.replay
    with torch.no_grad(), lora_merged(model):
        out = model(torch.randint(64, (3, 6)), mode="always", cache=cache)  # the prompt, eager
        model(out.logits[:, -1:].argmax(-1), mode="always", cache=cache)  # a step: each depth's pass captured
    captured = [d for p, d in fake_cuda_graphs if p == "capture"]
    warmed = [d for p, d in fake_cuda_graphs if p == "warm-up"]
    assert warmed == captured and set(captured) <= {"gather", "masked"}
    assert len(captured) == (2 * 3 if experts else 0)  # two pass graphs of three MoE layers each


# -----------------------------------------------------------------------------
# Compiled decoding, and tensors made on the device asked for


def small_models():
    torch.manual_seed(0)
    return {"moe": moe.Transformer(tiny("moe")), "hd": HiddenDecoding(tiny("hd", n_streams=4, window=5)),
            "hd-shared": HiddenDecoding(tiny("hd", layout="LIF", window=8, shared_kv=True, mirror_skip=False)),
            "tah": ThinkAtHard(tiny("tah", n_experts=4, threshold=0.5))}  # conftest's tiny configs


@pytest.mark.parametrize("kind", ["moe", "hd", "hd-shared", "tah"])
def test_training_evaluation_and_decoding_make_no_tensor_without_a_device(kind):
    """A training step's forward and backward (TaH: both stages, the decider's routing), an
    evaluation forward and greedy decoding (cached; static caches; TaH's decider), with meta as
    the default device."""
    import generate as decoding
    model = small_models()[kind]
    idx = torch.randint(61, (2, 12))
    with torch.device("meta"):
        if kind == "tah":
            depths = 1 + (idx[:, :-1] % 2)
            stage1_loss(model, idx[:, :-1], idx[:, 1:], depths).backward()
            stage2_loss(model, idx[:, :-1], depths)[0].backward()
            with torch.no_grad():
                model(idx, mode="decider")
                decoding.generate_tah(model.eval(), idx[:, :4], 4, temperature=0)
                decoding.tah_decode(model, idx[:, :4], 4, 0, None, None, "always")
        else:
            model(idx[:, :-1], idx[:, 1:])[1].backward()
            with torch.no_grad():
                model.eval()(idx)
                decoding.generate(model, idx[:, :4], 4, temperature=0)
                caches = decoding.make_caches(model, static=True)
                model(idx[:, :4], caches=caches)
                model(idx[:, 4:5], caches=caches)


def decode(model, step, prompt, steps):
    """Greedy: the prompt eager, then `steps` calls of step(token, caches=...)."""
    caches = make_caches(model)
    x = model(prompt, caches=caches)[0][:, -1:].argmax(-1)
    out = [x]
    for _ in range(steps):
        x = step(x, caches=caches)[0][:, -1:].argmax(-1)
        out.append(x)
    return torch.cat(out, 1)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("kind, kw", COMPILE_MODELS)
def test_the_cached_decode_step_is_one_graph_for_twenty_steps(kind, kw):
    """Every layout letter (F; L on the ring; I folded; shared-KV I on the dense mask), with and
    without the KV-mirror skip: fullgraph tracing finds no break, and 20 steps after the first
    compile nothing recompiles: the rows a cache holds are a symbolic size (dynamic=True)."""
    torch.manual_seed(0)
    model = compile_model(kind, **kw).eval()
    counter = CompileCounter()
    step = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    prompt = torch.randint(64, (2, 6))
    with torch.no_grad():
        tokens = decode(model, step, prompt, 20)
        assert counter.frame_count == 1, f"{counter.frame_count} compiles over 20 steps"
        assert torch.equal(tokens, decode(model, model, prompt, 20))


@pytest.mark.usefixtures("fresh_dynamo")
def test_generate_compiled_gives_eagers_tokens_with_one_compiled_step_per_model():
    """Inductor, as users get it: greedy tokens equal eager's, one graph over every step, and a
    second call reuses the model's compiled step."""
    torch.manual_seed(0)
    model = compile_model("hd", n_layer=1, layout="L", kv_mirror=False).eval()  # the ring cache; one layer compiles fast
    prompt = torch.randint(64, (2, 6))
    with torch.no_grad():
        tokens = generate(model, prompt, 20, temperature=0, compile=True)
        assert torch.equal(tokens, generate(model, prompt, 20, temperature=0))
        assert torch.equal(generate(model, prompt, 8, temperature=0, compile=True), tokens[:, :6 + 8])
    assert counters["stats"]["unique_graphs"] == 1 and compiled_step(model) is compiled_step(model)
    caches = make_caches(model)  # holding the prompt, as in a decode step (an empty one would compile again)
    with torch.no_grad():
        model(prompt, caches=caches)
    with torch.no_grad(), pytest.raises(ValueError, match=r"idx must hold ids in \[0, vocab_size=64\), got \[64, 64\]"):
        compiled_step(model)(torch.full((2, 1), 64), caches=caches)  # checked eagerly, before the compiled step
    assert counters["stats"]["unique_graphs"] == 1
    with torch.no_grad():
        for _ in range(model.cfg.block_size - prompt.size(1)):  # the caches full
            compiled_step(model)(prompt[:, :1], caches=caches)
    with torch.no_grad(), pytest.raises(ValueError, match="sequence of 49 tokens exceeds block_size=48"):
        compiled_step(model)(prompt[:, :1], caches=caches)  # as eager says it
    with torch.no_grad(), pytest.raises(ValueError, match="sequence of 49 tokens exceeds block_size=48"):
        model(prompt[:, :1], caches=caches)


@pytest.mark.usefixtures("fresh_dynamo")
def test_generate_compile_must_be_a_bool():
    model = compile_model("moe").eval()
    with pytest.raises(ValueError, match="compile must be True or False"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 2, compile="yes")


# -----------------------------------------------------------------------------
# Sizes and arguments refused before anything is allocated


def small_hd():
    return HiddenDecoding(tiny("hd", vocab_size=64, block_size=16, head_dim=8, window=4)).eval()


@pytest.mark.parametrize("make, says", [
    (lambda: WindowCache(0, 8), "window must be an int >= 1"),
    (lambda: WindowCache(2.0, 8), "window must be an int >= 1"),
    (lambda: WindowCache(4, 0), r"capacity must be an int in \[1, 2\*\*53\]"),
    (lambda: KVCache(True), r"capacity must be an int in \[1, 2\*\*53\]"),
    (lambda: make_caches(torch.nn.Linear(2, 2)), "make_caches and generate take"),
])
def test_caches_reject_bad_sizes_and_models(make, says):
    with pytest.raises(ValueError, match=says):
        make()


@pytest.mark.parametrize("new", [lambda: KVCache(8), lambda: WindowCache(4, 8)])
@pytest.mark.parametrize("k, v, says", [
    (torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), "k and v of one shape"),
    (torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 5), "k and v of one shape"),
    (torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4), "holds 2 heads x 4"),
])
def test_a_cache_update_of_the_wrong_shape_is_refused_before_it_writes(new, k, v, says):
    cache = new()
    cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    with pytest.raises(ValueError, match=says):
        cache.update(k, v)
    assert len(cache) == 1  # nothing was written


def test_a_window_cache_that_does_not_match_the_models_window_is_named():
    model = small_hd()
    caches = make_caches(model)
    caches[2] = WindowCache(3, caches[2].capacity)  # layer 2 is L with window 4
    with pytest.raises(ValueError, match="cache 2 keeps the last 3 rows, layer 2 reads the last 4 rows"):
        model(torch.zeros(1, 2, dtype=torch.long), caches=caches)


@pytest.mark.parametrize("make, says", [
    (lambda: KVCache(10**30), r"capacity must be an int in \[1, 2\*\*53\]"),
    (lambda: decoding.WindowCache(4, 10**30), r"capacity must be an int in \[1, 2\*\*53\]"),
    (lambda: decoding.StaticCache(10**30), r"capacity must be an int in \[1, 2\*\*53\]"),
    *[(lambda w=w: decoding.StaticCache(8, window=w), "window must be None or an int >= 1") for w in (0, -1, "x", 2.5)],
])
def test_caches_refuse_sizes_and_windows_they_cannot_hold(make, says):
    with pytest.raises(ValueError, match=says):
        make()


def test_a_cache_too_big_for_the_machine_is_refused_at_its_first_write_by_the_size_rule():
    """2**50 rows of keys and values: the size rule names them before the allocator meets them;
    TaH's caches with a batch of 10**9 at once."""
    k = torch.zeros(1, 2, 1, 8)
    for cache in (KVCache(2**50), decoding.StaticCache(2**50)):
        with pytest.raises(ValueError, match="needs ~.*GiB and the cpu has"):
            cache.update(k, k)
    tah_model = ThinkAtHard(tiny("tah", vocab_size=64, n_layer=1, expert_hidden=64, kv_mirror=False))
    for make in (TaHCache, StaticTaHCache):
        with pytest.raises(ValueError, match="needs ~.*GiB and the cpu has"):
            make(tah_model, 10**9, "cpu")


def test_a_window_past_the_block_decodes_as_every_row_in_a_ring_no_larger_than_the_block():
    """HDConfig(window=2**40): the L layer sees every row, its ring holds at most the cache's
    capacity (it was 2**40 rows), and decoding gives the full forward's tokens."""
    torch.manual_seed(0)
    model = HiddenDecoding(tiny("hd", vocab_size=64, block_size=16, expert_hidden=64, window=2**40)).eval()
    caches = make_caches(model)
    assert all(getattr(c, "ring", 0) <= c.capacity for c in caches)
    idx = torch.randint(64, (2, 5))
    out = generate(model, idx, 8, temperature=0)
    with torch.no_grad():
        step = idx
        for _ in range(8):
            step = torch.cat([step, model(step)[0][:, -1:].argmax(-1)], 1)
    assert torch.equal(out, step)


def test_static_tah_caches_refuse_a_graphed_that_is_not_a_bool_or_not_on_cuda():
    tah_model = ThinkAtHard(tiny("tah", vocab_size=64, n_layer=1, expert_hidden=64, kv_mirror=False))
    with pytest.raises(ValueError, match="graphed must be True or False, got 'yes'"):
        StaticTaHCache(tah_model, 1, "cpu", graphed="yes")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="graphed=True replays CUDA graphs: it takes a CUDA device"):
            StaticTaHCache(tah_model, 1, "cpu", graphed=True)


@pytest.mark.parametrize("model", [None, "moe", torch.nn.Linear(2, 2)])
def test_generate_refuses_what_is_not_a_model_in_one_line(model):
    with pytest.raises(ValueError, match="generate take a moe.Transformer or hd.HiddenDecoding, got"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 2)


# -----------------------------------------------------------------------------
# Cached decoding equals the full forward: one check, for the backbone and for HD (TaH's, through its
# passes' caches, is test_tah.py's)


def decodes_as_the_full_forward(model, idx, T, steps):
    """Cached decoding of idx: a T-token prompt, then each of `steps` new tokens a call (1 =
    ordinary decoding), each call's logits equal to the full forward's on that prefix. Returns
    the caches and the tokens they hold."""
    caches = make_caches(model)
    with torch.no_grad():
        torch.testing.assert_close(model(idx[:, :T], caches=caches)[0], model(idx[:, :T])[0], atol=1e-5, rtol=1e-5)
        t = T
        for k in steps:
            got, _ = model(idx[:, t:t + k], caches=caches)
            torch.testing.assert_close(got, model(idx[:, :t + k])[0][:, t:], atol=1e-5, rtol=1e-5)
            t += k
    return caches, t


@FAST
@given(c=model_configs, T=st.integers(2, 14), chunks=st.lists(st.integers(1, 4), min_size=1, max_size=6),
       seed=st.integers(0, 999))
def test_cached_steps_equal_full_forward_on_each_prefix(c, T, chunks, seed):
    model = build(c, seed)
    decodes_as_the_full_forward(model, torch.randint(model.cfg.vocab_size, (2, T + sum(chunks))), T, chunks)


@FAST
@given(model=hd_models(), T=st.integers(1, 6), steps=st.lists(st.integers(1, 3), min_size=1, max_size=4),
       shared=st.booleans(), B=st.sampled_from([1, 2, 4, 16, 64]))  # bench.py decodes batches 1, 4, 16, 64
def test_cached_decoding_equals_the_full_forward(model, T, steps, shared, B):
    if shared and "I" in model.cfg.layout:
        model = twin(model, shared_kv=True)
    caches, t = decodes_as_the_full_forward(model, torch.randint(model.cfg.vocab_size, (B, T + sum(steps))), T, steps)
    # every stream's rows are kept: n per token, or one per token with the streams as batch rows
    assert [len(c) * c.k.size(0) for c in caches] == [t * model.cfg.n_streams * B] * model.cfg.n_layer \
        or model.mirror_skip_from() is not None


@FAST
@given(model=hd_models(block_size=42, window=2), T=st.integers(1, 30), steps=st.lists(st.integers(1, 4), max_size=3))
def test_cached_decoding_with_prompts_many_windows_long_equals_the_full_forward(model, T, steps):
    """A window of 2 rows against prompts of up to 30 tokens (up to 120 rows): the L layers'
    rings wrap many times, in the prompt and in every chunk after it."""
    decodes_as_the_full_forward(model, torch.randint(model.cfg.vocab_size, (2, T + sum(steps))), T, steps)


if __name__ == "__main__":
    from checks import not_a_script
    not_a_script("test_generate.py", "python -m pytest test_generate.py")
