"""The experiment's specification (train_tiny.py, experiment.py, hd_experiment.py, tah_experiment.py,
trainer.py, tasks.py): the data round-trips and the tasks are what they say, the loop's cut of a batch
and its resume are exact, the protocols continue from one checkpoint on the same batches and label as
the paper says, the one verdict rule, and the probes give what is known of a model built to know it.
The machinery around them (flags, processes, files) is specified in lab/test_runner.py."""

import copy
import json
import math
import os
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import experiment
import hd_experiment
import moe
import tah_experiment
import tasks
import train_tiny as tt
import trainer
from conftest import SMOKE, examples, flags, patch_train, suite_ctx, suite_run, tiny, tiny_backbone
from experiment import attention_weights, recording_attention
from hd import HiddenDecoding
from hd_experiment import entropy, head_probes, reference_copy, stream_cosine, stream_mass, stream_states
from lab import ablations, compute, files, tokens
from lab.arith import Arith
from tah import ThinkAtHard
from tah_experiment import OUTCOMES, iteration_outcomes, tah_trace
from tasks import Lookups


# -----------------------------------------------------------------------------
# data


def test_text_round_trips_through_bpe_and_compact_ids(tmp_path):
    text = "When shall we three meet again\nIn thunder, lightning, or in rain?\n" * 3
    data = tasks.TextData(text, tokens.TokenCache(tmp_path / "t.npz"))
    ids = tasks.load_bpe().encode_ordinary(text)
    assert data.vocab[data.tokens].tolist() == ids  # compact id -> BPE id
    assert data.vocab_size == len(set(ids)) == data.tokens.max() + 1
    assert data.decode(data.tokens) == text
    assert data.decode(data.encode("When shall we three meet again")) == "When shall we three meet again"
    cached = tasks.TextData(text, tokens.TokenCache(tmp_path / "t.npz"))  # read back from the token file
    assert np.array_equal(cached.tokens, data.tokens) and np.array_equal(cached.vocab, data.vocab)
    raw = (tmp_path / "t.npz").read_bytes()
    at = raw.index(data.tokens.tobytes()) + 4  # one bit of one token flipped in the file
    for damaged in (raw[:len(raw) // 2], raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:]):
        (tmp_path / "t.npz").write_bytes(damaged)
        again = tasks.TextData(text, tokens.TokenCache(tmp_path / "t.npz"))  # rebuilt, not used as is
        assert np.array_equal(again.tokens, data.tokens) and np.array_equal(again.vocab, data.vocab)
        assert tokens.read_token_cache(tmp_path / "t.npz") is not None  # and the cache rewritten
    with pytest.raises(ValueError, match="vocabulary"):
        data.encode("zebra")
    other = "Now is the winter of our discontent\n" * 3  # another text's valid cache at this path
    tasks.TextData(other, tokens.TokenCache(tmp_path / "o.npz"))
    (tmp_path / "t.npz").write_bytes((tmp_path / "o.npz").read_bytes())
    again = tasks.TextData(text, tokens.TokenCache(tmp_path / "t.npz"))  # refused and rebuilt
    assert np.array_equal(again.tokens, data.tokens) and again.decode(again.tokens) == text
    assert tokens.read_token_cache(tmp_path / "t.npz", text) is not None


@given(N=st.integers(2, 300), T=st.integers(1, 40))
@examples(40)
def test_whole_split_windows_cover_every_target_exactly_once(N, T):
    data = tasks.TextData.__new__(tasks.TextData)
    data.split = {"val": torch.arange(1000, 1000 + N)}  # token j of the split holds 1000 + j
    x, y = data.windows("val", T)
    kept = y[y != -1]
    assert sorted(kept.tolist()) == list(range(1001, 1000 + N))  # targets 1 .. N-1, each once
    assert torch.equal(x[y != -1] + 1, kept)  # each target's input is the token before it


def test_clean_play_removes_the_markdown():
    md = "# Macbeth\n\n## ACT I\n\n_Thunder. Enter three\nWitches_\n\n**First Witch**  \nWhen shall we \\*three\\* meet?  \n"
    out = tasks.clean_play(md)
    assert out == "Macbeth\n\nACT I\n\nThunder. Enter three\nWitches\n\nFirst Witch:\nWhen shall we three meet?\n"


def test_shakespeare_comes_from_the_package_with_a_checked_tokenizer(tmp_path):
    data = tasks.shakespeare(tokens.TokenCaches(tmp_path), ("macbeth",))
    assert 20_000 < len(data.tokens) < 40_000
    assert "Fair is foul, and foul is fair" in data.decode(data.tokens[:2000])


@examples(25)
@given(S=st.integers(3, 9), Q=st.integers(1, 6), two_hop=st.floats(0.0, 0.6), three_hop=st.sampled_from([0.0, 0.2, 0.39]),
       seed=st.integers(0, 10_000), T=st.integers(4, 90))
def test_lookup_answers_are_a_walk_of_the_listed_pairs(S, Q, two_hop, three_hop, seed, T):
    task = tasks.Lookups(S, Q, two_hop, three_hop)
    H = 3 if three_hop else 2  # hop counts the query ids cover
    x, y = task.batch("train", 3, T, torch.Generator().manual_seed(seed))
    assert x.shape == y.shape == (3, T) and x.max() < task.vocab_size == S * S + (H + 1) * S + 1
    L = S + 2 * Q + 1  # S pairs, Q (query, answer), ';'
    for b in range(3):
        want = [-1] * T
        for k in range(T // L + 1):
            row = x[b, k * L:(k + 1) * L].tolist()
            pairs = [divmod(t, S) for t in row[:S]]
            if len(pairs) == S:  # the listed pairs are one cycle through every symbol
                f = dict(pairs)
                assert sorted(f) == sorted(f.values()) == list(range(S))
                a, seen = 0, set()
                while a not in seen:
                    seen.add(a)
                    a = f[a]
                assert len(seen) == S
            for j in range(Q):
                t = k * L + S + 2 * j
                if t >= T:
                    break
                extra, sym = divmod(x[b, t].item() - S * S, S)  # ids S*S..: "x, 1 hop", "x, 2 hops", ...
                assert extra in range(H)
                assert task.hops(x[b, t]).item() == 1 + extra
                assert task.describe(x[b, t].item()) == f"{'abcdefghi'[sym]}?{1 + extra}"
                for _ in range(1 + extra):  # walk the pairs listed before the query
                    sym = f[sym]
                want[t] = S * S + H * S + sym  # the answer token of sym
                if t + 1 < T:
                    assert x[b, t + 1].item() == want[t]
            if (k + 1) * L - 1 < T:
                assert x[b, (k + 1) * L - 1].item() == S * S + (H + 1) * S  # ';'
        assert y[b].tolist() == want


@examples(25)
@given(S=st.integers(3, 9), Q=st.integers(1, 6), two_hop=st.floats(0.0, 1.0), seed=st.integers(0, 10_000),
       T=st.integers(4, 90))
def test_lookups_with_the_hop_count_per_problem_are_a_walk_of_the_listed_pairs(S, Q, two_hop, seed, T):
    """Per problem: a header names the hop count, every query token its symbol alone; each answer
    is that many steps along the pairs listed before it (one step: the listed pair itself)."""
    task = tasks.Lookups(S, Q, two_hop, per_problem=True)
    x, y = task.batch("train", 3, T, torch.Generator().manual_seed(seed))
    L = 1 + S + 2 * Q + 1  # header, S pairs, Q (query, answer), ';'
    assert task.problem_len == L and task.vocab_size == S * S + 2 + 2 * S + 1 and x.max() < task.vocab_size
    hops = task.hops(x)
    for b in range(3):
        want = [-1] * T
        for k in range(T // L + 1):
            row = x[b, k * L:(k + 1) * L].tolist()
            if not row:
                break
            h = row[0] - S * S + 1  # the header: "[1 hop]" or "[2 hops]"
            assert h in (1, 2) and task.describe(row[0]) == f"[{h} hop{'s' * (h == 2)}]"
            f = dict(divmod(t, S) for t in row[1:S + 1])
            for j in range(Q):
                t = k * L + 1 + S + 2 * j
                if t >= T:
                    break
                sym = x[b, t].item() - (S * S + 2)  # one query id per symbol, whatever the hop count
                assert sym in range(S) and task.describe(x[b, t].item()) == f"{'abcdefghi'[sym]}?"
                assert hops[b, t].item() == h and bool(task.sometimes_hard(x)[b, t])
                for _ in range(h):  # walk the listed pairs
                    sym = f[sym]
                want[t] = S * S + 2 + S + sym
        assert y[b].tolist() == want
        assert (hops[b][torch.tensor(want) < 0] == 0).all()  # only queries have a hop count


def test_hard_and_easy_queries_have_the_same_query_tokens():
    """The headline's task hides hardness from the token: the query tokens of one-hop and of
    two-hop problems have the same distribution (histograms of 20,000 queries each, every symbol's
    share within 0.02), and a one-pass model sees the same ids in both."""
    task = tasks.Lookups(8, 5, 0.3, per_problem=True)
    x, _ = task.batch("train", 400, 200 * task.problem_len, torch.Generator().manual_seed(0))
    hops, is_query = task.hops(x), task.is_query(x)
    hist = {h: torch.bincount(x[hops == h] - task.query0, minlength=8).double() for h in (1, 2)}
    assert min(hist[1].sum(), hist[2].sum()) > 20_000
    assert (hist[1] / hist[1].sum() - hist[2] / hist[2].sum()).abs().max() < 0.02
    assert set(x[is_query & (hops == 1)].tolist()) == set(x[is_query & (hops == 2)].tolist()) == set(range(task.query0, task.query0 + 8))
    share = (hops == 2).sum() / is_query.sum()  # two-hop problems are drawn with probability 0.3
    assert abs(share.item() - 0.3) < 0.02
    q = tasks.Lookups(8, 5, 0.3)  # the hop count on the query: the ids of the two kinds never meet
    xq, _ = q.batch("train", 50, 10 * q.problem_len, torch.Generator().manual_seed(0))
    assert not set(xq[q.hops(xq) == 1].tolist()) & set(xq[q.hops(xq) == 2].tolist())


@examples(25)
@given(digits=st.integers(1, 5), seed=st.integers(0, 10_000), T=st.integers(8, 80))
def test_arith_answers_are_correct_by_construction(digits, seed, T):
    task = Arith(digits)
    x, y = task.batch("train", 3, T, torch.Generator().manual_seed(seed))
    assert x.shape == y.shape == (3, T)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        text = task.decode(row_x)
        for m in re.finditer(r"(\d+)\+(\d+)=(\d+);", text):
            a, b, c = m.groups()
            if m.end() <= T and len(c) == digits + 1:
                assert int(a) + int(b) == int(c)
        # targets: the next token where it is an answer digit, -1 elsewhere
        nxt = row_x[1:] + [None]
        for t, target in enumerate(row_y):
            pos = (t + 1) % task.problem_len
            is_answer = 2 * digits + 2 <= pos < 3 * digits + 3
            assert (target != -1) == is_answer
            if is_answer and nxt[t] is not None:
                assert target == nxt[t]


@examples(10)
@given(seed=st.integers(0, 10_000))
def test_tah3_oracle_bins_each_problems_hard_answers_by_reference_ce(seed):
    """The TaH-3 suite's oracle on its own task: per sample (a row of whole problems), the
    reference's wrong answers sorted by its CE, the higher half 3 passes, the rest 2 (the larger
    bin first); every other position 1 pass. Brute force over the rows."""
    torch.manual_seed(seed)
    task = tasks.Lookups(6, 4, 0.3, 0.3)
    x, y = task.batch("train", 3, 3 * task.problem_len, torch.Generator().manual_seed(seed))
    ref = ThinkAtHard(tah_experiment.tah_config(tt.PRESETS["default"], task, 1)).eval()
    got = tah_experiment.Oracle(ref, 3, task)(x, y)
    logits = ref(x, mode="standard").logits.detach()
    for b in range(3):
        hard = [t for t in range(x.size(1)) if y[b, t] >= 0 and logits[b, t].argmax() != y[b, t]]
        ce = {t: -torch.log_softmax(logits[b, t], -1)[y[b, t]].item() for t in hard}
        order = sorted(hard, key=lambda t: -ce[t])
        deep = (len(order) + 1) // 2
        want = [3 if t in order[:deep] else 2 if t in order[deep:] else 1 for t in range(x.size(1))]
        assert got[b].tolist() == want


# -----------------------------------------------------------------------------
# trainer


@given(st.integers(1, 64), st.integers(1, 64))
def test_batch_pieces_cover_the_batch_in_order_and_differ_by_at_most_one_row(batch, pieces):
    if pieces > batch:
        return
    cuts = [trainer.batch_piece(j, pieces, batch) for j in range(pieces)]
    assert cuts[0][0] == 0 and cuts[-1][1] == batch and all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
    assert max(hi - lo for lo, hi in cuts) - min(hi - lo for lo, hi in cuts) <= 1 and min(hi - lo for lo, hi in cuts) >= 1


@pytest.mark.parametrize("accum", [3, 5, 8])
def test_an_uneven_cut_of_the_batch_gives_the_whole_batchs_loss_and_gradients(accum, tmp_path):
    """8 rows in 3 (or 5, or 8) micro-steps: the pieces' losses, each weighted by its rows, sum to
    the whole batch's mean loss in one forward, and so do the gradients (what 3, 5, 6 or 7 ranks
    of torchrun do with --batch 8)."""
    P = trainer.Stage(steps=1, lr=1e-3, warmup=1, batch=8, block=16)
    x, y = Arith(2).batch("train", 8, 16, torch.Generator().manual_seed(0))
    grads = []
    for a in (1, accum):
        model = tiny_backbone()
        total = trainer.MicroSteps(model, experiment.lm_loss, trainer.Context(tmp_path, accum=a), stage=P, label="arm s0")(x, y)
        grads.append((total, [p.grad for p in model.parameters()]))
    (one, g1), (cut, g2) = grads
    assert cut == pytest.approx(one, rel=1e-6)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("muon", [False, True])
def test_a_stages_scaled_parameters_train_at_their_multiple_of_the_rate(muon, tmp_path):
    """Stage.scaled at scale 10: AdamW's first step moves each of those weights by about 10 x lr
    (Adam's first update is lr x the gradient's sign, weight decay aside), every other weight by
    about lr, with Muon's matrices too; a name the model does not train is refused."""
    lr, name = 1e-4, "lm_head.weight"
    P = trainer.Stage(steps=1, lr=lr, warmup=1, batch=4, block=16, scaled=(name,), scale=10.0)
    model = tiny_backbone()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train("arm", model, experiment.lm_loss, Arith(2), P, ctx=trainer.Context(tmp_path, muon=muon), seed=0)
    step = {n: (p.detach() - before[n]).abs() for n, p in model.named_parameters()}
    moved = step[name][step[name] > 0]
    assert moved.median().item() == pytest.approx(10 * lr, rel=0.05)
    other = step["wte.weight"][step["wte.weight"] > 0]  # AdamW in both (embeddings are not Muon's)
    assert other.median().item() == pytest.approx(lr, rel=0.05)
    with pytest.raises(ValueError, match="scales parameters the model does not train"):
        trainer.make_optimizer(model, lr, muon, ("no.such.weight",), 10.0)


def test_resume_after_interruption_reproduces_the_uninterrupted_losses(tmp_path):
    P = trainer.Stage(steps=6, lr=3e-3, warmup=2, batch=4, block=16)
    data = Arith(2)
    args = lambda d: trainer.Context(d, accum=2, log_every=100, ckpt_every=1, checkpoints=files.Checkpoints())
    straight = trainer.train("arm", tiny_backbone(), experiment.lm_loss, data, P, ctx=args(tmp_path / "a"), seed=3)

    class Killed(Exception):
        pass

    def kill(step):
        if step == 3:
            raise Killed
    with pytest.raises(Killed):
        trainer.train("arm", tiny_backbone(), experiment.lm_loss, data, P, ctx=args(tmp_path / "b"), seed=3, on_step=kill)
    resumed = trainer.train("arm", tiny_backbone(seed=99), experiment.lm_loss, data, P, ctx=args(tmp_path / "b"), seed=3)
    assert len(resumed) == 6
    assert resumed == straight  # bit for bit on CPU


def all_effects():
    """Every Effect the suite files define: alone, in a tuple (a TaH task's), or in a dict, and the
    HD probes' effects of each n > 1."""
    found = []
    for module in (hd_experiment, tah_experiment, ablations, compute):
        for v in vars(module).values():
            for group in (v.values() if isinstance(v, dict) else [v]):
                found += [e for e in (group if isinstance(group, tuple) else [group]) if isinstance(e, experiment.Effect)]
    found += [e for n in tt.PRESETS["smoke"].hd_ns if n > 1 for e in hd_experiment.hd_effects(n)]  # made per n
    return list(dict.fromkeys(found))


def test_smoke_runs_every_suite_and_writes_results(smoke_run):
    tmp_path, stages = smoke_run
    assert {s.split("/")[0].removesuffix("-late") for s, _ in stages} == set(tt.SUITES)  # hd-compute-late: its late regime
    md = (tmp_path / "results.md").read_text()
    effects = all_effects()
    assert len(effects) == 31  # 8 HD and MoE, TaH-3, 4 each TaH lookups task, 3 addition, 2 attention, 3 HD inside per n,
    # compute early and late, and its learning-rate search
    assert len({e.id for e in effects}) == len(effects)
    for effect in effects:  # every effect reported, with the paper's figure in its caption
        assert f"**{effect.name}** (paper: {effect.paper})" in md, effect
    identifiers_and_labels_name_each_other_one_to_one(json.loads(next(tmp_path.glob("run-*/rows.json")).read_text())["rows"])
    result = json.loads((tmp_path / "results.json").read_text())
    assert [v["claim"] for v in result["verdicts"]] == [c.name for c in tt.claims(flags(["--smoke"]))]  # every claim
    assert all(v["verdict"] == "not shown" for v in result["verdicts"])  # one seed can never show an effect
    assert "With one seed the rule cannot say shown" in md and "(one seed)" in md
    assert not list(tmp_path.glob("run-*/ckpt"))  # --smoke removes its checkpoints once reported
    tt.main(SMOKE + ["--out", str(tmp_path)])  # a second run finds every suite done
    assert (tmp_path / "results.md").read_text().split("\n", 1)[1] == md.split("\n", 1)[1]


# -----------------------------------------------------------------------------
# the demonstrations' protocols


def test_hd_continuations_start_from_one_checkpoint_and_see_the_same_batches(tmp_path, monkeypatch):
    seen, real = {}, trainer.train

    def spy(name, model, loss_fn, data, stage, *, ctx, seed, on_step=None, **kw):
        if "continued" not in name:
            return real(name, model, loss_fn, data, stage, ctx=ctx, seed=seed, on_step=on_step, **kw)
        start = (copy.deepcopy(model.backbone.state_dict()), [t.weight.detach().clone() for t in model.tables])
        batches = []
        assert (stage.lr, stage.steps) == (P.hd_cont_lr, P.hd_cont_iters)  # the continuation's own budget

        def recording(m, x, y):
            batches.append((x.clone(), y.clone()))
            return loss_fn(m, x, y)
        seen[model.cfg.n_streams] = start, batches
        return real(name, model, recording, data, stage, ctx=ctx, seed=seed, on_step=on_step, **kw)
    patch_train(monkeypatch, spy)
    P = replace(tt.PRESETS["smoke"], hd_cont_lr=1e-3)
    text = tasks.TextData("Is this a dagger which I see before me, the handle toward my hand? " * 60,
                          tokens.TokenCache(tmp_path / "t.npz"))
    suite_run("hd", P, suite_ctx(tmp_path), 0, text, ablations=False)
    assert sorted(seen) == [1, 2, 4]
    (body1, (e0,)), batches1 = seen[1]
    for n in (2, 4):
        (body, tables), batches = seen[n]
        assert body.keys() == body1.keys()
        assert all(torch.equal(body[k], body1[k]) for k in body)  # bit-identical backbone
        assert len(tables) == n and all(torch.equal(t, e0) for t in tables)  # E_k <- E_{k mod 1} = E_0
        assert len(batches) == len(batches1) == P.hd_cont_iters
        assert all(torch.equal(x, x1) and torch.equal(y, y1) for (x, y), (x1, y1) in zip(batches, batches1))


@pytest.mark.parametrize("suite", ["tah", "tah-hidden", "tah-add"])
def test_tah_oracle_labels_are_the_standard_models_top1_mistakes_in_the_response(suite, tmp_path, monkeypatch):
    trained, labelled, real, training = {}, [], trainer.train, [None]

    def spy(name, model, loss_fn, data, P, *, ctx, seed, on_step=None, **kw):
        training[0] = name
        out = real(name, model, loss_fn, data, P, ctx=ctx, seed=seed, on_step=on_step, **kw)
        trained[name] = model
        return out
    real_stage1 = tah_experiment.stage1_loss

    def stage1(model, idx, targets, depths):
        if training[0] == f"{suite}/TaH stage 1":  # not the token-type router's stage 1
            labelled.append((idx.clone(), targets.clone(), depths.clone()))
        return real_stage1(model, idx, targets, depths)
    patch_train(monkeypatch, spy)
    monkeypatch.setattr(tah_experiment, "stage1_loss", stage1)
    P = tt.PRESETS["smoke"]
    task = {"tah": tasks.Lookups(P.symbols, P.queries, P.two_hop), "tah-add": Arith(P.digits),
            "tah-hidden": tasks.Lookups(P.symbols, P.queries, P.two_hop, per_problem=True)}[suite]
    suite_run(suite, P, suite_ctx(tmp_path), 0, task, ablations=False)
    ref = trained[f"{suite}/Standard"].eval()
    if suite != "tah-add":  # the response: queries and answers, the ids after the pairs (and 2 headers) up to ';'
        first = P.symbols ** 2 + 2 * (suite == "tah-hidden")  # then S queries (2S on the query) and S answers
        last = first + (2 if suite == "tah-hidden" else 3) * P.symbols
        response = lambda b, t: first <= x[b, t].item() < last
    else:  # the response: the answer digits and ';', from position 2n+2 of a problem on ('=' is the prompt's)
        response = lambda b, t: t % task.problem_len >= 2 * P.digits + 2
    assert labelled
    for x, y, depths in labelled:
        for b in range(x.size(0)):
            for t in range(x.size(1)):  # brute force: the reference reads the prefix alone
                with torch.no_grad():
                    top1 = ref(x[b:b + 1, :t + 1], mode="standard").logits[0, -1].argmax().item()
                hard = y[b, t].item() != -1 and top1 != y[b, t].item() and response(b, t)
                assert depths[b, t].item() == (2 if hard else 1)


@examples(30)
@given(digits=st.integers(1, 4), seed=st.integers(0, 10_000), T=st.integers(6, 60), p_wrong=st.floats(0, 0.5))
def test_exact_match_counts_the_problems_whose_every_answer_digit_is_right(digits, seed, T, p_wrong):
    task = Arith(digits)
    g = torch.Generator().manual_seed(seed)
    x, y = task.batch("val", 3, T, g)
    ok = torch.rand(y.shape, generator=g) > p_wrong
    right, total = 0, 0
    L = task.problem_len
    for b in range(3):  # brute force: problem k's answer digits are x[k*L + 2n+2 .. k*L + 3n+2] = y[t + 1]
        for k in range(T // L + 2):
            ts = [t for t in range(T) if k * L + 2 * digits + 1 <= t < k * L + 3 * digits + 2]
            assert all(y[b, t] != -1 for t in ts)
            if len(ts) == digits + 1:
                total += 1
                right += all(ok[b, t] for t in ts)
    got = tasks.answer_exact(ok, y, task.problem_len, task.answers)
    if total == 0:
        assert np.isnan(got)
    else:
        assert got == pytest.approx(right / total)


def test_claims_match_rows_by_identifier_and_an_identifier_without_rows_is_an_error():
    rows = [r for n in (1, 2, 4) for s in (0, 1)
            for r in experiment.result_rows(hd_experiment.HD_N, hd_experiment.hd_cont_arm(n), s, {"loss": 5.0 - 0.01 * n - 0.001 * s})]
    claims = tt.claims(flags([]))
    judged = experiment.judge(rows, claims)
    assert [v["claim"] for v in judged] == [c.name for c in claims if c.effect == hd_experiment.HD_N]  # other suites did not run
    assert len(judged) == 3
    relabelled = [{**r, "effect": r["effect"] + " (renamed)", "arm": r["arm"] + " (renamed)"} for r in rows]
    assert experiment.judge(relabelled, claims) == judged  # labels are for readers only
    renamed = [{**r, "arm_id": "n4-renamed"} if r["arm_id"] == hd_experiment.hd_cont_arm(4).id else r for r in rows]
    with pytest.raises(ValueError, match="n=4 beats n=1"):
        experiment.judge(renamed, claims)
    with pytest.raises(TypeError, match="an Arm"):  # a claim names arms by Arm, never by a label
        experiment.Claim("by label", hd_experiment.HD_N, hd_experiment.hd_cont_arm(2).label, baseline=hd_experiment.hd_cont_arm(1),
                     metric="loss", sign=-1)
    with pytest.raises(TypeError, match="an Effect and an Arm"):
        experiment.result_rows(hd_experiment.HD_N, "n=2 continued", 0, {"loss": 5.0})


def identifiers_and_labels_name_each_other_one_to_one(rows):
    """In a run's rows an (effect, arm) id names one (effect, arm) label and back; every claim's
    arms are written by its suite."""
    ids, labels = {}, {}
    for r in rows:
        ids.setdefault((r["effect_id"], r["arm_id"]), set()).add((r["effect"], r["arm"]))
        labels.setdefault((r["effect"], r["arm"]), set()).add((r["effect_id"], r["arm_id"]))
    assert all(len(v) == 1 for v in ids.values()) and all(len(v) == 1 for v in labels.values())
    effects = {e for e, _ in ids}
    for c in tt.claims(flags(["--smoke"])):  # every claim's arms are written by its suite
        assert c.effect.id in effects, c.name
        assert (c.effect.id, c.arm.id) in ids, c.name
        assert not isinstance(c.baseline, experiment.Arm) or (c.effect.id, c.baseline.id) in ids, c.name


def test_verdict_needs_the_papers_sign_in_every_seed_and_a_mean_beyond_twice_the_spread():
    assert experiment.verdict([-0.04, -0.05, -0.045], -1) == "shown"
    assert experiment.verdict([0.04, 0.05, 0.045], -1) == "not shown"  # the opposite sign
    assert experiment.verdict([-0.04, -0.05, +0.001], -1) == "not shown"  # one seed flips
    assert experiment.verdict([-0.01, -0.09, -0.002], -1) == "not shown"  # inside twice the spread
    assert experiment.verdict([-0.01, -0.01, -0.04], -1) == "not shown"  # mean 1.15 std from zero: beyond one, not two
    assert experiment.verdict([-0.015, -0.02, -0.035], -1) == "shown"  # mean 2.24 std from zero
    assert experiment.verdict([-0.04], -1) == "not shown"  # one seed cannot show anything
    assert experiment.verdict([0.2, 0.3, 0.25], +1) == "shown"
    assert experiment.verdict(np.array([-0.04, -0.05, -0.045]), -1) == "shown"


@pytest.mark.parametrize("deltas, sign, words", [
    ([-0.04, -0.05], 0, r"sign must be the int \+1 or -1"),
    ([-0.04, -0.05], 2, "sign must be"),
    ([-0.04, -0.05], "+", "sign must be"),
    ([-0.04, -0.05], None, "sign must be"),
    ([-0.04, -0.05], float("nan"), "sign must be"),
    ([-0.04, -0.05], True, "sign must be"),
    ([-0.04, -0.05], 1.0, "sign must be"),
    (["1", "2"], 1, "deltas must be finite real numbers in one dimension"),
    ([True, True], 1, "finite real numbers"),
    ([[0.1, 0.2], [0.3, 0.4]], 1, "in one dimension"),
    (np.array([[0.1, 0.2], [0.3, 0.4]]), 1, "in one dimension"),
    ([-0.04, float("nan"), -0.05], -1, "finite real numbers"),
    ([0.1, float("inf")], 1, "finite real numbers"),
    ("0.1", 1, "finite real numbers"),
    ([], 1, "empty"),
    ([1e308] * 3, 1, "overflow a float's range"),  # a mean that overflowed is no verdict (it was "not shown")
])
def test_the_verdict_rule_refuses_what_is_not_its_input(deltas, sign, words):
    with pytest.raises(ValueError, match=words):
        experiment.verdict(deltas, sign)


def test_non_finite_loss_stops_the_run_naming_the_arm_and_step(tmp_path):
    P = trainer.Stage(steps=5, lr=3e-3, warmup=2, batch=4, block=16)
    args = trainer.Context(tmp_path, log_every=100, ckpt_every=1)
    calls = []

    def blows_up(m, x, y):
        calls.append(1)
        loss = experiment.lm_loss(m, x, y)
        return loss * float("nan") if len(calls) == 3 else loss
    with pytest.raises(SystemExit, match=r"\[arm s0\] loss is nan at step 3"):
        trainer.train("arm", tiny_backbone(), blows_up, Arith(2), P, ctx=args, seed=0)


def test_non_finite_weights_after_a_finite_loss_are_refused_before_any_save(tmp_path):
    P = trainer.Stage(steps=2, lr=3e-3, warmup=1, batch=4, block=16)
    args = trainer.Context(tmp_path, log_every=100, ckpt_every=100, checkpoints=files.Checkpoints())

    steps = []

    def spoils_last_step(m, x, y):
        loss = experiment.lm_loss(m, x, y)
        steps.append(1)
        if len(steps) == 2:  # the last step: its loss is finite, the weights after it are not
            with torch.no_grad():
                next(m.parameters()).fill_(float("nan"))
        return loss
    with pytest.raises(SystemExit, match=r"\[arm s0\] the weights are not finite after step 2"):
        trainer.train("arm", tiny_backbone(), spoils_last_step, Arith(2), P, ctx=args, seed=0)
    assert not list(tmp_path.rglob("*.pt"))  # nothing saved


def test_muon_trains_every_model_class(tmp_path):
    """TaH's stage 2 trains only the decider, which has no matrix inside the blocks: Muon gets
    nothing there and AdamW takes the rest."""
    tt.main(["--preset", "smoke", "--suite", "hd,tah,moe", "--muon", "--out", str(tmp_path)])  # every model class
    assert json.loads((tmp_path / "results.json").read_text())["verdicts"]


def test_a_non_finite_evaluation_stops_the_run_and_leaves_no_results(tmp_path):
    tt.main(["--smoke", "--suite", "moe", "--out", str(tmp_path)])
    assert (tmp_path / "results.json").exists()
    with pytest.raises(SystemExit, match="held-out loss is nan"):
        tt.main(["--smoke", "--suite", "moe", "--lr=1e20", "--iters=1", "--out", str(tmp_path)])
    assert not (tmp_path / "results.json").exists()  # not the earlier run's, beside a failed one


def test_sample_prints_text_from_the_hd_model_and_a_problem_answered_by_tah(tmp_path, capsys):
    """python sample.py after a run that keeps its checkpoints: the HD n = 4 model's text (as many
    tokens as asked, past its 32-token block: the context slides) and each query of a new lookup
    problem with the TaH model's answer and its passes; without a run, one line."""
    import sample
    with pytest.raises(SystemExit, match="results.json is missing"):
        sample.main(["--out", str(tmp_path)])
    tt.main(["--preset", "smoke", "--suite", "hd,tah", "--jobs", "1", "--out", str(tmp_path)])
    capsys.readouterr()
    sample.main(["--out", str(tmp_path), "--tokens", "40", "--temperature", "0"])
    out = capsys.readouterr().out
    assert "HD n = 4 (run-" in out and "40 tokens after a held-out prompt of 16" in out
    answers = [line for line in out.splitlines() if " -> =" in line]
    assert len(answers) == tt.PRESETS["smoke"].queries and all("pass" in a for a in answers), out


def test_sample_refuses_a_folder_it_cannot_use_in_one_line_naming_the_file(tmp_path, monkeypatch):
    """After a run, each file spoiled in turn (and restored): a checkpoint of another preset (its
    checksum valid), one without the config that rebuilds its model or with one its checks refuse,
    a folder, unreadable, far larger than a run writes, another arm's (TaH's stage 1 in the
    decider's place), a FIFO (never opened: it would block); results.json too large or a
    FIFO; the --data file the run names gone. Each: one line naming the file, before any model runs."""
    import sample
    from lab.files import load_checkpoint, write_checkpoint
    tt.main(["--preset", "smoke", "--suite", "hd,tah", "--seeds", "1", "--jobs", "1", "--out", str(tmp_path)])
    run = next(tmp_path.glob("run-*"))
    hd, decider = run / "ckpt" / "hd_n_4_continued_s0.pt", run / "ckpt" / "tah_TaH_stage_2_decider_s0.pt"
    results = tmp_path / "results.json"

    def refused(words, target):
        with pytest.raises(SystemExit) as e:
            sample.main(["--out", str(tmp_path), "--tokens", "4"])
        said = str(e.value.code)
        assert words in said and str(target) in said and "\n" not in said, said

    for ckpt in (hd, decider):
        saved = ckpt.read_bytes()
        state = load_checkpoint(ckpt)
        k = next(iter(state["model"]))
        state["model"][k] = torch.zeros(*state["model"][k].shape[:-1], state["model"][k].shape[-1] + 1)
        write_checkpoint(ckpt, state)  # another preset's shapes, its checksum valid
        refused("does not fit the run's preset", ckpt)
        for config in (None, {**state["config"], "n_layer": 0}):  # a checkpoint of no config, or one its checks refuse
            write_checkpoint(ckpt, {k: v for k, v in state.items() if k != "config"} | ({"config": config} if config
                                                                                       else {}))
            refused("that rebuilds its model", ckpt)
        ckpt.unlink()
        ckpt.mkdir()
        refused("is a folder", ckpt)
        ckpt.rmdir()
        os.mkfifo(ckpt)
        refused("is not a regular file", ckpt)  # checked before any open: a FIFO would block
        ckpt.unlink()
        with open(ckpt, "wb") as f:
            f.truncate(10**10)  # sparse: 10 GB that no run writes for this model
        refused("more than any run writes", ckpt)
        ckpt.write_bytes(saved)
        real = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes", lambda p: (_ for _ in ()).throw(PermissionError(
            13, "Permission denied", str(p))) if p == ckpt else real(p))
        refused("cannot be read (Permission denied)", ckpt)
        monkeypatch.undo()
    saved = decider.read_bytes()
    decider.write_bytes((run / "ckpt" / "tah_TaH_stage_1_s0.pt").read_bytes())
    refused("is not 'tah/TaH stage 2 (decider)', seed 0", decider)
    decider.write_bytes(saved)
    doc = results.read_text()
    results.write_text(json.dumps({**json.loads(doc), "data": str(tmp_path / "gone.txt")}))
    refused("no --data file the run trained on", tmp_path / "gone.txt")
    results.unlink()
    with open(results, "wb") as f:
        f.truncate(sample.MAX_RESULTS_BYTES + 1)
    refused("more than any run writes", results)
    results.unlink()
    os.mkfifo(results)
    refused("is not a regular file", results)
    results.unlink()
    results.write_text(doc)
    sample.main(["--out", str(tmp_path), "--tokens", "4"])  # restored: it samples


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


@pytest.mark.parametrize("spoil", ["a list", "preset a list", "preset missing fields", "run null", "hd_ns a string",
                                   "a folder", "binary", "run elsewhere"])
def test_sample_refuses_what_is_no_results_of_a_trained_run_in_one_line(spoil, tmp_path):
    """sample.py reads a run's folder through one check: anything that is not a results.json of
    train_tiny.py naming a run folder beside it is refused in one line, before any model loads."""
    import sample
    from dataclasses import asdict
    (tmp_path / "run-0123456789").mkdir()
    doc = {"preset": asdict(tt.PRESETS["smoke"]), "run": "run-0123456789", "data": None}
    doc = {"a list": [], "preset a list": {**doc, "preset": []},
           "preset missing fields": {**doc, "preset": {k: v for k, v in doc["preset"].items() if k != "plays"}},
           "run null": {**doc, "run": None}, "hd_ns a string": {**doc, "preset": {**doc["preset"], "hd_ns": "1,2"}},
           "run elsewhere": {**doc, "run": "../run-0123456789"}}.get(spoil, doc)
    path = tmp_path / "results.json"
    if spoil == "a folder":
        path.mkdir()
    elif spoil == "binary":
        path.write_bytes(b"\x00\xff\xfe" * 30)
    else:
        path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as e:
        sample.read_run(tmp_path)
    assert str(e.value.code).startswith(f"error: {path} is missing or not the results of a train_tiny.py run")
    assert "\n" not in str(e.value.code)



# -----------------------------------------------------------------------------
# the probes (hd_experiment.py, tah_experiment.py), each on a model or pattern whose answer is
# known, or against a loop over the definition


def hd_model(n=2, layout="IFLI", **kw):
    cfg = tiny("hd", vocab_size=37, block_size=16, n_layer=len(layout), layout=layout, n_head=4, head_dim=8,
               ffn_hidden=32, n_streams=n, **kw)
    return HiddenDecoding(cfg).eval()

def identity_backbone(model):
    """Every block adds nothing to the residual: attention and FFN outputs zeroed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down.weight", "w_down")):
                p.zero_()
    return model

@pytest.mark.parametrize("n", [2, 4])
def test_identical_tables_and_identity_backbone_give_same_token_cosine_one(n):
    torch.manual_seed(n)
    model = identity_backbone(hd_model(n))
    with torch.no_grad():
        for t in model.tables[1:]:
            t.weight.copy_(model.tables[0].weight)
    idx = torch.randint(37, (2, 9))
    states, _ = stream_states(model, idx)
    assert states.shape == (model.cfg.n_layer + 1, 2, 9, n, 32)
    same, diff = stream_cosine(states)
    torch.testing.assert_close(same, torch.ones_like(same))
    assert (diff < 1 - 1e-3).all()  # different tokens' embeddings differ

@examples(20)
@given(st.integers(2, 4), st.integers(2, 7), st.integers(0, 2**31 - 1))
def test_stream_cosine_matches_a_loop(n, L, seed):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(3, 2, L, n, 5, generator=g)
    same, diff = stream_cosine(states)
    cos = lambda a, b: (a @ b / (a.norm() * b.norm())).item()
    for layer in range(3):
        s_vals, d_vals = [], []
        for b in range(2):
            for i in range(L):
                for a in range(n):
                    for c in range(a + 1, n):
                        s_vals.append(cos(states[layer, b, i, a], states[layer, b, i, c]))
                        d_vals.append(cos(states[layer, b, i, a], states[layer, b, (i - L // 2) % L, c]))
        assert same[layer].item() == pytest.approx(sum(s_vals) / len(s_vals), abs=1e-5)
        assert diff[layer].item() == pytest.approx(sum(d_vals) / len(d_vals), abs=1e-5)

@examples(20)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_stream_mass_gives_back_the_mass_that_was_set(n, L, seed):
    """Each final-stream query spreads a chosen mass m_k over stream k's keys (any split over
    tokens); stream_mass returns m."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(n, generator=g) + 0.01
    m = m / m.sum()
    w = torch.rand(2, 3, L * n, L * n, generator=g)  # other queries' rows: anything
    for q in range(n - 1, L * n, n):
        split = torch.rand(L, n, generator=g)
        split = split / split.sum(0)  # per stream, a split over the L tokens
        w[:, :, q] = (split * m).flatten()  # key t = i*n + k gets m_k * split[i, k]
    torch.testing.assert_close(stream_mass(w, n), m)

def test_recorded_attention_reproduces_each_layer_output():
    """The recorded weights times V give what attention returned, for every mask form attend
    takes (causal, boolean, GQA): the probe reads the attention the model ran."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    vv = v.repeat_interleave(2, dim=1)
    band = torch.ones(6, 6, dtype=torch.bool).tril() & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)
    for mask in ("causal", band, None):
        y, w = moe.attend(q, k, v, mask), attention_weights(q, k, mask)
        torch.testing.assert_close(w @ vv, y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6))

def test_recording_attention_reads_every_layers_call_and_stops_after_the_block():
    """recording_attention(model) gets one entry per layer's call, each a row-stochastic
    (B, H, T*n, T*n) weight map; after the block the layers record nothing."""
    torch.manual_seed(0)
    n, model = 2, hd_model(2, layout="IFL")
    idx = torch.randint(37, (2, 5))
    ref = reference_copy(model)
    with recording_attention(ref) as calls:
        ref(idx)
    assert len(calls) == ref.cfg.n_layer
    for w in calls:
        assert w.shape == (2, ref.cfg.n_head, 5 * n, 5 * n)
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
    layers = [m for m in ref.modules() if isinstance(m, moe.Attention)]
    assert all(a.record is None for a in layers)
    ref(idx)
    assert len(calls) == ref.cfg.n_layer  # nothing recorded outside the block

def test_hd_final_stream_mass_sums_to_one_and_intra_layers_read_their_own_stream():
    torch.manual_seed(1)
    n, model = 3, hd_model(3, layout="IFLI")
    _, weights = stream_states(model, torch.randint(37, (2, 7)))
    assert len(weights) == model.cfg.n_layer
    for w in weights:
        torch.testing.assert_close(stream_mass(w, n).sum(), torch.tensor(1.0))
    torch.testing.assert_close(stream_mass(weights[0], n), torch.tensor([0.0, 0.0, 1.0]))  # I: own stream only

def test_one_hot_head_gives_entropy_zero_and_every_stream_agrees():
    """Identity backbone, every embedding row the same vector e, LM head row 5 = 50 e: every
    stream's logits are one-hot at token 5 (entropy 0), so every stream's top-1 agrees."""
    torch.manual_seed(2)
    n, model = 4, identity_backbone(hd_model(4))
    e = torch.randn(32)
    with torch.no_grad():
        for t in model.tables:
            t.weight.copy_(e.expand_as(t.weight))
        model.backbone.lm_head.weight.zero_()
        model.backbone.lm_head.weight[5] = 50 * e / e.norm()
    states, _ = stream_states(model, torch.randint(37, (2, 6)))
    differs, ent, probs = head_probes(model, states[-1])
    torch.testing.assert_close(ent, torch.zeros(n), atol=1e-6, rtol=0)
    torch.testing.assert_close(differs, torch.zeros(n))
    assert (probs.argmax(-1) == 5).all()

@examples(20)
@given(st.integers(2, 50), st.integers(0, 2**31 - 1))
def test_entropy_matches_the_definition(V, seed):
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(seed)) * 3
    for row, h in zip(logits, entropy(logits)):
        p = [math.exp(x) for x in row.tolist()]
        p = [x / sum(p) for x in p]
        assert h.item() == pytest.approx(-sum(x * math.log(x) for x in p if x > 0), abs=1e-4)
    assert entropy(torch.tensor([0.0, 0.0, 0.0, 0.0])).item() == pytest.approx(math.log(4))

@examples(20)
@given(st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_iteration_outcomes_match_a_loop(T, seed):
    g = torch.Generator().manual_seed(seed)
    target, before, after = (torch.randint(3, (T,), generator=g) for _ in range(3))
    went, kind = torch.rand(T, generator=g) < 0.6, torch.randint(3, (T,), generator=g)
    got = iteration_outcomes(before, after, target, went, kind)
    want = {}
    for t in range(T):
        if went[t]:
            b, a = before[t] == target[t], after[t] == target[t]
            name = {(False, True): OUTCOMES[0], (True, False): OUTCOMES[1], (False, False): OUTCOMES[2],
                    (True, True): OUTCOMES[3]}[(bool(b), bool(a))]
            want.setdefault(int(kind[t]), dict.fromkeys(OUTCOMES, 0))[name] += 1
    assert got == want

@pytest.mark.parametrize("n_layer", [1, 3])
def test_tah_trace_reads_the_forward_it_draws_and_its_attention_obeys_the_duo_causal_mask(n_layer):
    """The trace's passes and top-1s are the decider-routed forward's; each second-pass query's
    weights sum to 1 over the keys and fall only on keys (j, k) with j <= i (TaH Eq. 5; k <= 1
    holds for every key of two passes)."""
    torch.manual_seed(n_layer)
    cfg = tiny("tah", vocab_size=29, block_size=16, n_layer=n_layer, n_head=4, head_dim=8, ffn_hidden=32,
               logit_topk=29, kv_mirror=n_layer >= 3)
    model = ThinkAtHard(cfg).eval()
    with torch.no_grad():
        model.decider.mlp[-1].bias.fill_(3.0)  # sigmoid(score) > 0.9 for most tokens: a second pass to read
    idx = torch.randint(29, (1, 11))
    trace = tah_trace(model, idx)
    out = model(idx, mode="decider")
    assert torch.equal(trace["passes"], out.depths[0])
    assert torch.equal(trace["final"], out.logits[0].argmax(-1))
    assert torch.equal(trace["first"], out.first_logits[0].argmax(-1))
    went = (out.depths[0] > 1).nonzero().squeeze(1)
    assert len(went) > 0 and torch.equal(trace["query_pos"], went)
    w = trace["weights"]
    torch.testing.assert_close(w.sum(-1), torch.ones(len(went)))
    visible = trace["key_pos"][None, :] <= trace["query_pos"][:, None]
    assert (w[~visible] == 0).all()
    assert set(trace["key_depth"].tolist()) == {0, 1}

def test_head_probes_count_disagreement_against_the_final_stream():
    """Streams that disagree: stream k's share of positions whose top-1 differs from the final
    stream's (k = n-1), against a loop over positions. A probe that compared with stream 0
    instead would give stream 0 a share of 0 and the final stream a nonzero one."""
    torch.manual_seed(5)
    n, model = 3, hd_model(3)
    last = torch.randn(2, 7, n, 32) * 5  # (B, L, n, C): random states, so the streams' top-1s differ
    differs, _, _ = head_probes(model, last)
    with torch.no_grad():
        top = [[[model.head(last[b, i, k]).argmax().item() for k in range(n)] for i in range(7)] for b in range(2)]
    want = [sum(top[b][i][k] != top[b][i][n - 1] for b in range(2) for i in range(7)) / 14 for k in range(n)]
    assert want[n - 1] == 0 and want[0] > 0  # the example separates final from stream 0
    torch.testing.assert_close(differs, torch.tensor(want, dtype=differs.dtype))


if __name__ == "__main__":
    from checks import not_a_script
    not_a_script("test_train_tiny.py", "python -m pytest test_train_tiny.py")
