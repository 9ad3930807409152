"""Bad input to the newer surfaces gives one clear ValueError naming what is wrong, never a
deep torch error or a silent answer: the caches, moe.attend, tasks.Lookups, the token router,
TaH-3's iterated labels."""

from dataclasses import replace

import pytest
import torch

import ablations
import headline
import train_tiny as tt
from generate import KVCache, WindowCache, make_caches
from hd import HDConfig, HiddenDecoding
from moe import attend
from tasks import Lookups


def small_hd():
    return HiddenDecoding(HDConfig(vocab_size=64, block_size=16, n_layer=3, n_embd=32, n_head=6, n_kv_head=2,
                                   head_dim=8, n_experts=4, expert_hidden=16, layout="IFL", window=4)).eval()


@pytest.mark.parametrize("make, says", [
    (lambda: WindowCache(0, 8), "window must be an int >= 1"),
    (lambda: WindowCache(2.0, 8), "window must be an int >= 1"),
    (lambda: WindowCache(4, 0), "capacity must be an int >= 1"),
    (lambda: KVCache(True), "capacity must be an int >= 1"),
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
    with pytest.raises(ValueError, match="cache 2 keeps the last 3 rows, layer 2 reads 4"):
        model(torch.zeros(1, 2, dtype=torch.long), caches=caches)


q, k = torch.randn(1, 6, 2, 8), torch.randn(1, 2, 5, 8)


@pytest.mark.parametrize("args, says", [
    ((q[0], k, k, None), "4-D tensors"),
    ((torch.randn(1, 5, 2, 8), k, k, None), "Hkv dividing H=5"),
    ((q, torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), None), "head_dim=8"),
    ((q, k, torch.randn(1, 2, 4, 8), None), "k and v of one shape"),
    ((q, k, k, torch.ones(2, 5)), "must be boolean"),
    ((q, k, k, torch.ones(3, 5, dtype=torch.bool)), r"does not broadcast to \(B, H, Tq, Tk\) = \(1, 6, 2, 5\)"),
    ((q, k, k, torch.ones(2, 2, 5, dtype=torch.bool)), "does not broadcast"),
    ((q, k, k, 5), "'causal', None, a boolean tensor or a BlockMask"),
])
def test_attend_names_shapes_it_cannot_fold_or_broadcast(args, says):
    with pytest.raises(ValueError, match=says):
        attend(*args)


def test_attend_still_takes_every_mask_form_it_documents():
    for mask in (None, torch.ones(2, 5, dtype=torch.bool), torch.ones(1, 1, 2, 5, dtype=torch.bool),
                 torch.ones(1, 6, 2, 5, dtype=torch.bool)):
        assert attend(q, k, k, mask).shape == (1, 6, 2, 8)
    assert attend(q, k[:, :, :2], k[:, :, :2], "causal").shape == (1, 6, 2, 8)


@pytest.mark.parametrize("kw, says", [
    (dict(symbols=1, queries=2, two_hop=0.5), "symbols must be an int >= 2"),
    (dict(symbols=4.0, queries=2, two_hop=0.5), "symbols must be an int >= 2"),
    (dict(symbols=4, queries=0, two_hop=0.5), "queries must be an int >= 1"),
    (dict(symbols=4, queries=2, two_hop=1.5), r"two_hop must be a probability in \[0, 1\]"),
    (dict(symbols=4, queries=2, two_hop=0.5, three_hop=-0.1), "three_hop must be a probability"),
    (dict(symbols=4, queries=2, two_hop=0.7, three_hop=0.4), "two_hop \\+ three_hop must be at most 1"),
    (dict(symbols=4, queries=2, two_hop=0.5, per_problem=1), "per_problem must be True or False"),
])
def test_lookups_refuse_sizes_that_cannot_form_a_problem(kw, says):
    with pytest.raises(ValueError, match=says):
        Lookups(**kw)


def test_the_token_router_names_a_task_without_token_kinds_and_non_token_input():
    with pytest.raises(ValueError, match="reads a task's token kinds"):
        headline.TokenRouter(object())
    router = headline.TokenRouter(Lookups(4, 2, 0.5, per_problem=True))
    with pytest.raises(ValueError, match="routes token ids"):
        router(torch.zeros(2, 3))
    assert router(torch.zeros(2, 3, dtype=torch.long)).dtype == torch.long


def test_the_iterated_labels_name_a_model_or_task_they_cannot_read():
    task = Lookups(4, 2, 0.3, 0.3)
    cfg = headline.tah_config(tt.PRESETS["smoke"], task, 1)
    ref, tah2 = headline.ThinkAtHard(cfg), headline.ThinkAtHard(cfg)
    one_pass = headline.ThinkAtHard(replace(cfg, max_depth=1))
    for args, says in [((torch.nn.Linear(2, 2), tah2, task), "ref must be a ThinkAtHard"),
                       ((ref, one_pass, task), "must run 2 passes"),
                       ((ref, tah2, object()), "reads the task's response positions")]:
        with pytest.raises(ValueError, match=says):
            ablations.IteratedOracle(*args)
    x, y = task.batch("train", 2, task.problem_len, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="inputs and targets of one shape"):
        ablations.IteratedOracle(ref, tah2, task)(x, y[:, :-1])
    assert set(ablations.IteratedOracle(ref, tah2, task)(x, y).unique().tolist()) <= {1, 2, 3}
