"""--suite all's ablations and contrasts (lab/ablations.py): the token-type router and the iterated
labels are what they say, every HD ablation continues the n = 1 checkpoint on the headline's
batches, and progressive expansion chains 1 -> 2 -> 4 on the control's batches."""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/test_ablations.py is no script: run python -m pytest lab/test_ablations.py", file=sys.stderr)
    sys.exit(2)

import copy
from dataclasses import replace

import pytest
import torch
from hypothesis import given, strategies as st

import hd_experiment
import tah_experiment
import tasks
import train_tiny as tt
import trainer
from conftest import examples, patch_train, suite_ctx, suite_run, tiny
from hd import HiddenDecoding, expand_streams
from lab import ablations, tokens
from tah import ThinkAtHard
from tasks import Lookups


@examples(10)
@given(per_problem=st.booleans(), seed=st.integers(0, 10_000), T=st.integers(4, 70))
def test_the_token_type_router_iterates_exactly_its_token_kind(per_problem, seed, T):
    """TokenRouter: 2 passes at every position whose token is a query that can need two hops (per
    problem: every query; on the query: the "x?2" tokens), 1 elsewhere; scanned token by token."""
    task = tasks.Lookups(5, 3, 0.4, per_problem=per_problem)
    x, _ = task.batch("train", 3, T, torch.Generator().manual_seed(seed))
    got = ablations.TokenRouter(task)(x)
    for b in range(3):
        for t in range(T):
            name = task.describe(x[b, t].item())
            kind = name.endswith("?") if per_problem else name.endswith("?2")
            assert got[b, t].item() == (2 if kind else 1)


@examples(5)
@given(seed=st.integers(0, 10_000))
def test_iterated_labels_give_a_third_pass_to_the_tah2_models_depth2_mistakes(seed):
    """TaH-3's iterated labels, brute force over one row at a time: 1 where the reference is right
    (or there is no target, or the input is in the prompt), else 2 if the TaH-2 model under the
    two-pass labels gets the target after its second pass, else 3."""
    torch.manual_seed(seed)
    task = tasks.Lookups(6, 4, 0.3, 0.3)
    x, y = task.batch("train", 3, 3 * task.problem_len, torch.Generator().manual_seed(seed))
    cfg = tah_experiment.tah_config(tt.PRESETS["default"], task, 1)
    ref, tah2 = ThinkAtHard(cfg).eval(), ThinkAtHard(cfg).eval()
    got = ablations.IteratedOracle(ref, tah2, task)(x, y)
    assert (got == 3).any() and (got == 1).any()  # an untrained pair leaves work for the third pass
    for b in range(3):
        xb, yb = x[b:b + 1], y[b:b + 1]
        ref_top = ref(xb, mode="standard").logits[0].argmax(-1)
        two = [2 if yb[0, t] >= 0 and ref_top[t] != yb[0, t] and task.describe(xb[0, t].item()).endswith(("?1", "?2", "?3"))
               or yb[0, t] >= 0 and ref_top[t] != yb[0, t] and task.describe(xb[0, t].item()).startswith("=") else 1
               for t in range(x.size(1))]
        second = tah2(xb, mode="oracle", depths=torch.tensor([two])).logits[0].argmax(-1)
        want = [3 if two[t] == 2 and second[t] != yb[0, t] else two[t] for t in range(x.size(1))]
        assert got[b].tolist() == want


def test_hd_ablations_continue_the_n1_checkpoint_on_the_headline_batches(tmp_path, monkeypatch):
    seen, real = {}, trainer.train  # name -> (config, backbone at the start, batches)

    def spy(name, model, loss_fn, data, P, *, ctx, seed, on_step=None, **kw):
        if "continued" not in name:
            return real(name, model, loss_fn, data, P, ctx=ctx, seed=seed, on_step=on_step, **kw)
        batches = []

        def recording(m, x, y):
            batches.append((x.clone(), y.clone()))
            return loss_fn(m, x, y)
        seen[name] = model.cfg, copy.deepcopy(model.backbone.state_dict()), batches
        return real(name, model, recording, data, P, ctx=ctx, seed=seed, on_step=on_step, **kw)
    patch_train(monkeypatch, spy)
    P = tt.PRESETS["smoke"]
    text = tasks.TextData("Out, out, brief candle! Life's but a walking shadow, a poor player " * 60,
                          tokens.TokenCache(tmp_path / "t.npz"))
    rows = suite_run("hd", P, suite_ctx(tmp_path), 0, text, ablations=True)
    _, body2, batches2 = seen["hd/n=2 continued"]
    trained = {}
    for effect, arm, how in ablations.hd_continued_ablation_arms(P):
        if isinstance(how, dict):
            cfg, body, batches = seen[f"hd/n=2 continued, {arm.label}"]
            assert all(getattr(cfg, k) == v for k, v in how.items()) and cfg.n_streams == 2
            assert all(torch.equal(body[k], body2[k]) for k in body2)  # the same n=1 checkpoint
            assert len(batches) == len(batches2) == P.hd_cont_iters
            assert all(torch.equal(x, x2) and torch.equal(y, y2) for (x, y), (x2, y2) in zip(batches, batches2))
        else:  # the headline's arm, its rows reused
            trained[(effect.id, arm.id)] = hd_experiment.hd_cont_arm(how).id
    assert len(seen) == 3 + sum(isinstance(h, dict) for _, _, h in ablations.hd_continued_ablation_arms(P))
    value = {(r["effect_id"], r["arm_id"], r["metric"]): r["value"] for r in rows}
    for (effect, arm), source in trained.items():
        assert value[(effect, arm, "loss")] == value[(hd_experiment.HD_N.id, source, "loss")]
    arms = {e.id: {a for (f, a, _) in value if f == e.id} for e in (ablations.HD_LAYOUTS_CONT, ablations.HD_OBJECTIVE_CONT,
                                                                    ablations.HD_KV_CONT, ablations.HD_SCRATCH)}
    for c in ablations.HD_ABLATION_CLAIMS:  # every claim names arms the suite writes
        assert {c.arm.id, c.baseline.id} <= arms[c.effect.id], c.name
    assert arms[ablations.HD_SCRATCH.id] == {arm.id for arm, _ in ablations.hd_scratch_arms(P)}


def test_progressive_expansion_chain_keeps_the_function_at_each_stage():
    """1 -> 2 -> 4 (HD §2.3): where expansion is exactly function-preserving (intra-stream layers,
    every stream of a token at its position), each stage starts with its predecessor's logits."""
    torch.manual_seed(0)
    cfg = tiny("hd", block_size=16, head_dim=8, layout="III", positions="token", n_streams=1)
    one = HiddenDecoding(cfg).eval()
    two = expand_streams(one, 2)
    with torch.no_grad():
        for p in two.parameters():  # stage 1 trains: the next expansion starts from other weights
            p.add_(0.01 * torch.randn_like(p))
    four = expand_streams(two, 4)
    idx = torch.randint(61, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(expand_streams(one, 2)(idx)[0], one(idx)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(four(idx)[0], two(idx)[0], atol=1e-5, rtol=1e-5)
    assert four.cfg.n_streams == 4 and torch.equal(four.tables[3].weight, two.tables[1].weight)


def test_the_progressive_suites_control_sees_the_batches_of_the_expanded_arms(tmp_path, monkeypatch):
    seen, real = [], trainer.train

    def recording(name, model, loss_fn, data, stage, *, ctx, seed, on_step=None, first_batch=0):
        seen.append((name, first_batch, stage.steps, getattr(model.cfg, "n_streams", 1)))
        return real(name, model, loss_fn, data, stage, ctx=ctx, seed=seed, on_step=on_step, first_batch=first_batch)
    patch_train(monkeypatch, recording)
    tt.main(["--smoke", "--suite", "hd-progressive", "--out", str(tmp_path)])
    P = tt.PRESETS["smoke"]
    by_stage = {}
    for name, first, iters, n in seen[1:]:
        by_stage.setdefault(name.rsplit(" ", 1)[1], set()).add((first, iters))
        assert name.startswith(f"hd-progressive/n={n} stage")
    assert by_stage == {"1": {(P.hd_base_iters, P.hd_cont_iters)}, "2": {(P.hd_base_iters + P.hd_cont_iters, P.hd_cont_iters)}}
    assert [n for *_, n in seen] == [1, 1, 2, 1, 2, 4]


def test_the_token_router_names_a_task_without_token_kinds_and_non_token_input():
    with pytest.raises(ValueError, match="reads a task's token kinds"):
        ablations.TokenRouter(object())
    router = ablations.TokenRouter(Lookups(4, 2, 0.5, per_problem=True))
    with pytest.raises(ValueError, match="routes token ids"):
        router(torch.zeros(2, 3))
    assert router(torch.zeros(2, 3, dtype=torch.long)).dtype == torch.long


def test_the_iterated_labels_name_a_model_or_task_they_cannot_read():
    task = Lookups(4, 2, 0.3, 0.3)
    cfg = tah_experiment.tah_config(tt.PRESETS["smoke"], task, 1)
    ref, tah2 = ThinkAtHard(cfg), ThinkAtHard(cfg)
    one_pass = ThinkAtHard(replace(cfg, max_depth=1))
    for args, says in [((torch.nn.Linear(2, 2), tah2, task), "ref must be a ThinkAtHard"),
                       ((ref, one_pass, task), "must run 2 passes"),
                       ((ref, tah2, object()), "reads the task's response positions")]:
        with pytest.raises(ValueError, match=says):
            ablations.IteratedOracle(*args)
    x, y = task.batch("train", 2, task.problem_len, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="inputs and targets of one shape"):
        ablations.IteratedOracle(ref, tah2, task)(x, y[:, :-1])
    assert set(ablations.IteratedOracle(ref, tah2, task)(x, y).unique().tolist()) <= {1, 2, 3}
