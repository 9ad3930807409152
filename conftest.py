"""
What every test file shares: hypothesis's settings (CI draws a fixed sequence of examples, so a
red run is reproducible), the `cuda` marker, the tiny configs, train_tiny's command line as the
tests parse it, and the one `--smoke` run that several files read.
"""

import os
from dataclasses import replace
from pathlib import Path

from lab import startup

startup.threads_from_env(quiet=True)  # before torch loads libgomp: an empty or invalid value reads as unset

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def examples(n):
    """The tests' hypothesis settings, defined here once: n drawn examples, no deadline (a forward
    or two each, whose time varies with the machine); the CI profile above draws them derandomized."""
    return settings(max_examples=n, deadline=None)


FAST = examples(25)  # a property over drawn shapes, each example a forward or two

HERE = Path(__file__).resolve().parent


def cuda(test):
    """A test that needs a CUDA GPU: marked `cuda` (python -m pytest -m cuda runs only these), skipped without one."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


# The tiny shapes most tests build their models at: 3 layers (KV-Mirror's first and last third),
# GQA with 6 query heads on 2, 4 experts top-2, head_dim 16 (CUDA's flex kernels take 16 and up).
TINY = dict(vocab_size=61, block_size=32, n_layer=3, n_embd=32, n_head=6, n_kv_head=2, head_dim=16, n_experts=4,
            top_k=2, expert_hidden=16)


def tiny(kind="moe", **overrides):
    """A tiny config: the backbone's (moe.ModelConfig), HD's (n = 2, layout IFL) or TaH's (dense)."""
    from hd import HDConfig
    from moe import ModelConfig
    from tah import TaHConfig
    if kind == "moe":
        return ModelConfig(**{**TINY, **overrides})
    if kind == "hd":
        return HDConfig(**{**TINY, "n_streams": 2, "layout": "IFL", "window": 3, **overrides})
    return TaHConfig(**{**TINY, "n_experts": 0, "logit_topk": 16, **overrides})


CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it off a GPU

# float64 checks (gradcheck) at smaller shapes still
F64 = dict(vocab_size=11, block_size=16, n_layer=3, n_embd=16, n_head=4, n_kv_head=2, head_dim=8, n_experts=4, top_k=2,
           expert_hidden=8, ffn_hidden=24)


def f64_batch(seed, B=2, T=5, V=11):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(V, (B, T), generator=g), torch.randint(V, (B, T), generator=g)


def gradcheck_wrt(model, name, loss_of_model):
    """gradcheck of loss_of_model(model) as a function of the parameter called `name`. Fast mode
    compares u^T J v for random u, v (a central difference along v against the backward's
    vector-Jacobian product): a wrong gradient fails it almost surely, at the cost of two
    evaluations instead of two per weight."""
    from torch.func import functional_call
    w = dict(model.named_parameters())[name].detach().clone().requires_grad_(True)

    def f(w):
        return loss_of_model(lambda *a, **k: functional_call(model, {name: w}, a, k))
    assert torch.autograd.gradcheck(f, (w,), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)


# compiled models (torch.compile), each test counting its own compiles (fresh_dynamo)
COMPILE_TINY = dict(vocab_size=64, block_size=48, n_layer=3, n_embd=32, n_head=6, n_kv_head=2, head_dim=8, n_experts=4,
                    top_k=2, expert_hidden=32, window=4)
COMPILE_MODELS = [("moe", {}), ("hd", dict(layout="IFL")), ("hd", dict(layout="FLI")),  # the skip's mirrored layer: L, I
                  ("hd", dict(layout="LIF", mirror_skip=False)), ("hd", dict(layout="IFI", shared_kv=True))]


def compile_model(kind, **kw):
    from hd import HiddenDecoding
    from moe import Transformer
    if kind == "moe":
        return Transformer(tiny("moe", **{k: v for k, v in {**COMPILE_TINY, **kw}.items() if k != "window"}))
    return HiddenDecoding(tiny("hd", **{**COMPILE_TINY, **kw}))


@pytest.fixture
def fresh_dynamo():
    """dynamo reset, its counters cleared and a recompile limit of 64: a test counts its own compiles."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


def tiny_backbone(seed=0):
    """A tiny MoE backbone on a 13-token vocabulary (the addition task's), seeded."""
    from moe import Transformer
    torch.manual_seed(seed)
    return Transformer(tiny(vocab_size=13, block_size=16, head_dim=8))


# -----------------------------------------------------------------------------
# train_tiny.py, as the tests drive it


def flags(argv):
    """train_tiny's command line, parsed and checked (nothing is opened until runner.open_run)."""
    import train_tiny as tt
    from lab import presets, runner
    return runner.parse_flags(argv, doc=tt.__doc__, presets=tt.PRESETS, suites=tt.SUITES, headline=tt.HEADLINE,
                              text_suites=tt.TEXT, check=presets.check_preset)


SMOKE = ["--smoke", "--ckpt_every", "1", "--jobs", "1"]  # one process: a patched train is the one used


def patch_train(monkeypatch, fn):
    """Every suite trains through `fn`: the experiments', the ablations' and lab/compute's own name for trainer.train."""
    import hd_experiment
    import tah_experiment
    from lab import ablations, compute
    for module in (hd_experiment, tah_experiment, ablations, compute):
        monkeypatch.setattr(module, "train", fn)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """One `--smoke` run (every suite with every arm), shared by the tests that read it: its
    out folder and the stages it trained."""
    import train_tiny as tt
    import trainer
    out, stages, real = tmp_path_factory.mktemp("smoke"), [], trainer.train

    def counting(name, model, loss_fn, data, stage, *, ctx, seed, on_step=None, **kw):
        stages.append((name, stage.steps))
        return real(name, model, loss_fn, data, stage, ctx=ctx, seed=seed, on_step=on_step, **kw)
    with pytest.MonkeyPatch.context() as mp:
        patch_train(mp, counting)
        tt.main(SMOKE + ["--out", str(out)])
    return out, stages


def suite_run(name, preset, ctx, seed, data, ablations):
    """One (suite, seed), as train_tiny runs it (ablations: with its extra arms, as --suite all)."""
    import train_tiny as tt
    return tt.train_seed(name, preset, replace(ctx, ablations=ablations), seed, data)


def suite_ctx(tmp_path):
    """A run's context as lab/runner.py makes it: checkpoints and analyses kept, FLOPs counted."""
    import trainer
    from lab import figures, files, flops
    return trainer.Context(tmp_path, log_every=100, ckpt_every=100, checkpoints=files.Checkpoints(), keep=figures.Kept(),
                           flops=flops.per_token)


if __name__ == "__main__":
    from checks import not_a_script
    not_a_script("conftest.py", "python -m pytest")
