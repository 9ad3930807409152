"""The input checks (checks.py): every config field has a rule, and a bad value gets one line
naming it."""

from dataclasses import fields

import pytest

from checks import HD, MODEL, TAH
from hd import HDConfig
from moe import ModelConfig
from tah import TaHConfig


@pytest.mark.parametrize("config, table", [(ModelConfig, MODEL), (HDConfig, HD), (TaHConfig, TAH)])
def test_each_config_check_table_covers_every_field(config, table):
    names = {f.name for f in fields(config)}
    assert sorted(names - set(table)) == []  # a field without a rule
    assert sorted(set(table) - names) == []  # a rule for no field


@pytest.mark.parametrize("config", [ModelConfig, HDConfig, TaHConfig])
def test_the_defaults_pass_their_table(config):
    config()


def test_the_readme_is_short_and_names_no_commit():
    """README.md is what a clone sees today: at most 200 lines, and no commit hash (history
    lives in docs/journal.md)."""
    import re
    from pathlib import Path
    text = (Path(__file__).parent / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    hashes = re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)
    assert not hashes, hashes


# -----------------------------------------------------------------------------
# The one rule for sizes


from hypothesis import given, settings, strategies as st  # noqa: E402

from checks import parameters  # noqa: E402
from hd import HiddenDecoding, expand_streams  # noqa: E402
from moe import Transformer  # noqa: E402
from tah import ThinkAtHard  # noqa: E402


@settings(max_examples=25, deadline=None)
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
    (lambda: expand_streams(Transformer(ModelConfig(n_layer=3, n_embd=16, n_head=2, n_kv_head=1, head_dim=8,
                                                    vocab_size=50)), 10**30), "n_streams must be an int in"),
    (lambda: expand_streams(Transformer(ModelConfig(n_layer=3, n_embd=16, n_head=2, n_kv_head=1, head_dim=8,
                                                    vocab_size=50)), 10**8), "needs ~"),
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
    cfg = ModelConfig(n_layer=3, n_embd=16, n_head=2, n_kv_head=1, head_dim=8, vocab_size=50, block_size=16)
    need = 4 * (parameters(cfg) * 4 + checks.activations(cfg, 8, scores=True))
    monkeypatch.setattr(checks, "memory_limit", lambda device="cpu": 3 * need)
    checks.check_fits(cfg, 8, training=True, sharing=3)
    with pytest.raises(ValueError, match=r"needs ~.*\(4 processes share its"):
        checks.check_fits(cfg, 8, training=True, sharing=4)
