"""torch.compile takes the models whole: the cached decode step and the training step of
moe.Transformer and hd.HiddenDecoding compile with fullgraph=True (no graph break), the decode
step compiles once for every step after it, and generate(..., compile=True) gives eager's tokens.
TaH compiles per pass (ThinkAtHard.compile_passes): each pass is one graph, and the decode steps
reuse them.

Dynamo's tracing decides graph breaks and recompiles, whatever backend runs the graph, so most
tests trace with the "eager" backends (seconds); one compiles with inductor, as users get it.
"""


import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch._dynamo.utils import counters

from generate import compiled_step, generate, make_caches
from hd import HDConfig, HiddenDecoding
from moe import ModelConfig, Transformer
import tah
from generate import generate_tah

TINY = dict(vocab_size=64, block_size=48, n_layer=3, n_embd=32, n_head=6, n_kv_head=2, head_dim=8,
            n_experts=4, top_k=2, expert_hidden=32, window=4)


def tiny(kind, **kw):
    if kind == "moe":
        return Transformer(ModelConfig(**{k: v for k, v in {**TINY, **kw}.items() if k != "window"}))
    return HiddenDecoding(HDConfig(**{**TINY, "n_streams": 2, **kw}))


MODELS = [("moe", {}), ("hd", dict(layout="IFL")), ("hd", dict(layout="FLI")),  # the skip's mirrored layer: L, I
          ("hd", dict(layout="LIF", mirror_skip=False)), ("hd", dict(layout="IFI", shared_kv=True))]


def decode(model, step, prompt, steps):
    """Greedy: the prompt eager, then `steps` calls of step(token, caches=...)."""
    caches = make_caches(model)
    x = model(prompt, caches=caches)[0][:, -1:].argmax(-1)
    out = [x]
    for _ in range(steps):
        x = step(x, caches=caches)[0][:, -1:].argmax(-1)
        out.append(x)
    return torch.cat(out, 1)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # every test counts its own compiles
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


@pytest.mark.parametrize("kind, kw", MODELS)
def test_the_cached_decode_step_is_one_graph_for_twenty_steps(kind, kw):
    """Every layout letter (F; L on the ring; I folded; shared-KV I on the dense mask), with and
    without the KV-mirror skip: fullgraph tracing finds no break, and 20 steps after the first
    compile nothing recompiles: the rows a cache holds are a symbolic size (dynamic=True)."""
    torch.manual_seed(0)
    model = tiny(kind, **kw).eval()
    counter = CompileCounter()
    step = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    prompt = torch.randint(64, (2, 6))
    with torch.no_grad():
        tokens = decode(model, step, prompt, 20)
        assert counter.frame_count == 1, f"{counter.frame_count} compiles over 20 steps"
        assert torch.equal(tokens, decode(model, model, prompt, 20))


@pytest.mark.parametrize("kind, kw", MODELS[:2])
def test_the_training_forward_and_backward_trace_whole_and_equal_eager(kind, kw):
    """The training step (forward, loss, backward) traces as one graph through aot_autograd,
    with eager's loss, gradients and balancing counts."""
    torch.manual_seed(0)
    model = tiny(kind, **kw).train()
    ref = tiny(kind, **kw, moe_dispatch="loop").train()
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


def test_generate_compiled_gives_eagers_tokens_with_one_compiled_step_per_model():
    """Inductor, as users get it: greedy tokens equal eager's, one graph over every step, and a
    second call reuses the model's compiled step."""
    torch.manual_seed(0)
    model = tiny("hd", n_layer=1, layout="L", kv_mirror=False).eval()  # the ring cache; one layer compiles fast
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


def test_generate_compile_must_be_a_bool():
    model = tiny("moe").eval()
    with pytest.raises(ValueError, match="compile must be True or False"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 2, compile="yes")


def tiny_tah(**kw):
    cfg = {k: v for k, v in TINY.items() if k != "window"}
    return tah.ThinkAtHard(tah.TaHConfig(**{**cfg, "n_experts": 0, "ffn_hidden": 48, "logit_topk": 16, **kw}))


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
