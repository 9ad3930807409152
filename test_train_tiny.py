"""Tests of train_tiny.py (and its tasks.py, report.py): data round-trips, exact resume, DDP
equivalence, every suite's smoke run."""

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import ablations
import headline as hl
import report
import runner
import tasks
import train_tiny as tt
import trainer
from moe import ModelConfig, Transformer

HERE = Path(__file__).parent


def session(argv):
    """train_tiny's Session (the command line parsed and checked; nothing opened until entered)."""
    return runner.Session(argv, tt.__doc__, tt.PRESETS, tt.SUITES, tt.HEADLINE, tt.TEXT, tt.check_preset)


# -----------------------------------------------------------------------------
# data


def test_text_round_trips_through_bpe_and_compact_ids(tmp_path):
    text = "When shall we three meet again\nIn thunder, lightning, or in rain?\n" * 3
    data = tasks.TextData(text, tmp_path / "t.npz")
    ids = tasks.load_bpe().encode_ordinary(text)
    assert data.vocab[data.tokens].tolist() == ids  # compact id -> BPE id
    assert data.vocab_size == len(set(ids)) == data.tokens.max() + 1
    assert data.decode(data.tokens) == text
    assert data.decode(data.encode("When shall we three meet again")) == "When shall we three meet again"
    cached = tasks.TextData(text, tmp_path / "t.npz")  # read back from the token file
    assert np.array_equal(cached.tokens, data.tokens) and np.array_equal(cached.vocab, data.vocab)
    raw = (tmp_path / "t.npz").read_bytes()
    at = raw.index(data.tokens.tobytes()) + 4  # one bit of one token flipped in the file
    for damaged in (raw[:len(raw) // 2], raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:]):
        (tmp_path / "t.npz").write_bytes(damaged)
        again = tasks.TextData(text, tmp_path / "t.npz")  # rebuilt, not used as is
        assert np.array_equal(again.tokens, data.tokens) and np.array_equal(again.vocab, data.vocab)
        assert tasks.read_token_cache(tmp_path / "t.npz") is not None  # and the cache rewritten
    with pytest.raises(ValueError, match="vocabulary"):
        data.encode("zebra")
    other = "Now is the winter of our discontent\n" * 3  # another text's valid cache at this path
    tasks.TextData(other, tmp_path / "o.npz")
    (tmp_path / "t.npz").write_bytes((tmp_path / "o.npz").read_bytes())
    again = tasks.TextData(text, tmp_path / "t.npz")  # refused and rebuilt
    assert np.array_equal(again.tokens, data.tokens) and again.decode(again.tokens) == text
    assert tasks.read_token_cache(tmp_path / "t.npz", text) is not None


@given(N=st.integers(2, 300), T=st.integers(1, 40))
@settings(max_examples=40, deadline=None)
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
    data = tasks.shakespeare(tmp_path, ("macbeth",))
    assert 20_000 < len(data.tokens) < 40_000
    assert "Fair is foul, and foul is fair" in data.decode(data.tokens[:2000])


@settings(max_examples=25, deadline=None)
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


@settings(max_examples=25, deadline=None)
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


@settings(max_examples=10, deadline=None)
@given(per_problem=st.booleans(), seed=st.integers(0, 10_000), T=st.integers(4, 70))
def test_the_token_type_router_iterates_exactly_its_token_kind(per_problem, seed, T):
    """TokenRouter: 2 passes at every position whose token is a query that can need two hops (per
    problem: every query; on the query: the "x?2" tokens), 1 elsewhere; scanned token by token."""
    task = tasks.Lookups(5, 3, 0.4, per_problem=per_problem)
    x, _ = task.batch("train", 3, T, torch.Generator().manual_seed(seed))
    got = hl.TokenRouter(task)(x)
    for b in range(3):
        for t in range(T):
            name = task.describe(x[b, t].item())
            kind = name.endswith("?") if per_problem else name.endswith("?2")
            assert got[b, t].item() == (2 if kind else 1)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_iterated_labels_give_a_third_pass_to_the_tah2_models_depth2_mistakes(seed):
    """TaH-3's iterated labels, brute force over one row at a time: 1 where the reference is right
    (or there is no target, or the input is in the prompt), else 2 if the TaH-2 model under the
    two-pass labels gets the target after its second pass, else 3."""
    torch.manual_seed(seed)
    task = tasks.Lookups(6, 4, 0.3, 0.3)
    x, y = task.batch("train", 3, 3 * task.problem_len, torch.Generator().manual_seed(seed))
    cfg = hl.tah_config(tt.PRESETS["default"], task, 1)
    ref, tah2 = hl.ThinkAtHard(cfg).eval(), hl.ThinkAtHard(cfg).eval()
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


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_tah3_oracle_bins_each_problems_hard_answers_by_reference_ce(seed):
    """The TaH-3 suite's oracle on its own task: per sample (a row of whole problems), the
    reference's wrong answers sorted by its CE, the higher half 3 passes, the rest 2 (the larger
    bin first); every other position 1 pass. Brute force over the rows."""
    torch.manual_seed(seed)
    task = tasks.Lookups(6, 4, 0.3, 0.3)
    x, y = task.batch("train", 3, 3 * task.problem_len, torch.Generator().manual_seed(seed))
    ref = hl.ThinkAtHard(hl.tah_config(tt.PRESETS["default"], task, 1)).eval()
    got = hl.Oracle(ref, 3, task)(x, y)
    logits = ref(x, mode="standard").logits.detach()
    for b in range(3):
        hard = [t for t in range(x.size(1)) if y[b, t] >= 0 and logits[b, t].argmax() != y[b, t]]
        ce = {t: -torch.log_softmax(logits[b, t], -1)[y[b, t]].item() for t in hard}
        order = sorted(hard, key=lambda t: -ce[t])
        deep = (len(order) + 1) // 2
        want = [3 if t in order[:deep] else 2 if t in order[deep:] else 1 for t in range(x.size(1))]
        assert got[b].tolist() == want


@settings(max_examples=25, deadline=None)
@given(digits=st.integers(1, 5), seed=st.integers(0, 10_000), T=st.integers(8, 80))
def test_arith_answers_are_correct_by_construction(digits, seed, T):
    task = tasks.Arith(digits)
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


# -----------------------------------------------------------------------------
# trainer


def small(seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=13, block_size=16, n_layer=3, n_embd=32, n_head=6, n_kv_head=2,
                                   head_dim=8, n_experts=4, expert_hidden=16))


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
    x, y = tasks.Arith(2).batch("train", 8, 16, torch.Generator().manual_seed(0))
    grads = []
    for a in (1, accum):
        model = small()
        total = trainer.MicroSteps("arm", model, hl.lm_loss, P, trainer.Run(tmp_path, accum=a), 0)(x, y)
        grads.append((total, [p.grad for p in model.parameters()]))
    (one, g1), (cut, g2) = grads
    assert cut == pytest.approx(one, rel=1e-6)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("world", range(1, 9))
def test_the_smoke_preset_has_a_row_for_every_rank_of_up_to_8(world, monkeypatch, capsys):
    """torchrun --nproc_per_node=8 train_tiny.py --smoke is taken: every suite's batch has a row per rank."""
    monkeypatch.setattr(runner, "WORLD", world)
    assert session(["--smoke"]).P == tt.PRESETS["smoke"]  # parsed and checked
    monkeypatch.setattr(runner, "WORLD", 9)
    with pytest.raises(SystemExit):
        session(["--smoke"])
    assert "--batch 8 has fewer rows than 9 rank(s) x 1 micro-step(s)" in capsys.readouterr().err


def test_resume_after_interruption_reproduces_the_uninterrupted_losses(tmp_path):
    P = trainer.Stage(steps=6, lr=3e-3, warmup=2, batch=4, block=16)
    data = tasks.Arith(2)
    args = lambda d: trainer.Run(d, accum=2, log_every=100, ckpt_every=1)
    straight = trainer.train("arm", small(), hl.lm_loss, data, P, args(tmp_path / "a"), seed=3)

    class Killed(Exception):
        pass

    def kill(step):
        if step == 3:
            raise Killed
    with pytest.raises(Killed):
        trainer.train("arm", small(), hl.lm_loss, data, P, args(tmp_path / "b"), seed=3, on_step=kill)
    resumed = trainer.train("arm", small(seed=99), hl.lm_loss, data, P, args(tmp_path / "b"), seed=3)
    assert len(resumed) == 6
    assert resumed == straight  # bit for bit on CPU


def test_ddp_over_three_ranks_has_its_own_run_and_equals_one_process(tmp_path):
    """The same flags under torchrun (gloo, 3 ranks: batches of 8 cut 2, 3, 3 rows) into the same
    --out: a run of its own (the world size is in the key; nothing of the one-process run is
    reused) that trains the same numbers up to float summation order (parameters no rank has a
    gradient for stay untouched, as in one process). Rounding differs (a rank's matmuls see 2 or 3
    rows, not 8) and TaH stage 2's class weight is counted over each rank's decisions, not the
    global batch's: ~1e-4 apart."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    common = ["train_tiny.py", "--preset", "smoke", "--suite", "moe,tah", "--device", "cpu", "--out", str(tmp_path)]
    one = subprocess.run([sys.executable, *common], cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", *common],
                         cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    assert "already done" not in two.stdout
    runs = sorted(tmp_path.glob("run-*"), key=lambda p: p.stat().st_mtime)
    assert len(runs) == 2
    ck1, ck2 = (sorted(r.glob("ckpt/*.pt")) for r in runs)
    assert [p.name for p in ck1] == [p.name for p in ck2] and ck1
    for a, b in zip(ck1, ck2):
        np.testing.assert_allclose(trainer.load_checkpoint(a)["losses"], trainer.load_checkpoint(b)["losses"], rtol=1e-3, atol=1e-5)
    rows1, rows2 = (json.loads((r / "rows.json").read_text())["rows"] for r in runs)
    assert [(r["arm"], r["metric"]) for r in rows1] == [(r["arm"], r["metric"]) for r in rows2]
    # losses only: a count or a share can move by one token where a score sits at a threshold
    losses = [(a["value"], b["value"]) for a, b in zip(rows1, rows2) if a["metric"] == "loss"]
    assert losses
    np.testing.assert_allclose(*zip(*losses), rtol=1e-3, atol=1e-4)


def test_jobs_train_the_same_rows_as_one_process_in_any_order(tmp_path, capsys):
    """--jobs 2 spreads the (suite, seed)s over two processes (which finish in another order
    than one process's): every row, and the report under its header, equals a one-process run's,
    and both runs share one key (the numbers do not depend on --jobs). A resumed run that
    finishes the seeds in another order writes the same report too. In either, each (suite,
    seed)'s "finished" line says the run's time left; a step line, its stage's."""
    argv = ["--preset", "smoke", "--suite", "hd,tah", "--seeds", "2", "--log_every", "1"]  # the headline arms
    for jobs in ("1", "2"):
        tt.main(argv + ["--jobs", jobs, "--out", str(tmp_path / {"1": "one", "2": "two"}[jobs])])
        lines = capsys.readouterr().out.splitlines()
        finished = [l for l in lines if " finished (" in l]
        assert len(finished) == 4 and "(4 of 4)" in finished[-1]
        assert all(re.search(r"\| run ~\d+\.\d min left$", l) for l in finished), finished
        steps = [l for l in lines if "] step " in l]  # one process: its step lines are this process's
        assert all(re.search(r"\| stage ~\d+\.\d min left$", l) for l in steps) and (steps or jobs == "2"), steps
    (one,), (two,) = (list((tmp_path / d).glob("run-*")) for d in ("one", "two"))
    assert one.name == two.name
    rows = [json.loads((r / "rows.json").read_text())["rows"] for r in (one, two)]
    assert rows[0] == rows[1] and {(r["suite"], r["seed"]) for r in rows[0]} == {(s, k) for s in ("hd", "tah")
                                                                                   for k in (0, 1)}
    md = [(tmp_path / d / "results.md").read_text().split("\n", 1)[1] for d in ("one", "two")]
    assert md[0] == md[1]
    doc = json.loads((one / "rows.json").read_text())  # keep only hd seed 1: the rest finishes after it
    runner.save_rows(one / "rows.json", [r for r in doc["rows"] if (r["suite"], r["seed"]) == ("hd", 1)], doc["run"])
    tt.main(argv + ["--jobs", "1", "--out", str(tmp_path / "one")])
    assert json.loads((one / "rows.json").read_text())["rows"] == rows[1]
    assert (tmp_path / "one" / "results.md").read_text().split("\n", 1)[1] == md[1]


def stops(suite, P, run, seed, data):  # a (suite, seed) stopped by an error, as a NaN loss stops one
    raise SystemExit(f"error: [moe/arm s{seed}] loss is nan at step 2")


def test_a_worker_stopped_by_an_error_hands_its_one_line_to_the_parent():
    """A SystemExit in a --jobs process (a NaN loss, a damaged checkpoint) comes back as its
    line, which the parent raises (next test); any other error ends the process, which the
    parent reports as died."""
    import queue
    results, threads, handler = queue.Queue(), torch.get_num_threads(), signal.getsignal(signal.SIGINT)
    try:
        runner.in_process(results, (stops, "moe", tt.PRESETS["smoke"], trainer.Run(Path(".")), 3, None, 1, 1))
        runner.in_process(results, (compile_workers, "moe", tt.PRESETS["smoke"], trainer.Run(Path(".")), 4, None, 1, 3))
    finally:
        torch.set_num_threads(threads)  # in_process sets the process up as a worker's
        signal.signal(signal.SIGINT, handler)
    assert results.get_nowait() == ("moe", 3, "error: [moe/arm s3] loss is nan at step 2")
    assert results.get_nowait() == ("moe", 4, 3)  # inductor's compile workers: the process's share of the cores


def compile_workers(suite, P, run, seed, data):
    import torch._inductor.config as inductor
    return inductor.compile_threads


def dies_or_stops(suite, P, run, seed, data):  # a --jobs process's work (module level: a spawned process imports it)
    if seed == 1:
        if run.run_dir.parent.name.endswith("dies"):
            os._exit(3)  # as the OOM killer would end it: no exception, no result
        raise SystemExit("error: [moe/arm s1] loss is nan at step 2")
    time.sleep(120)  # seed 0 would run on: the error must stop it
    return []


def train_all(argv, work, data=None):
    """A Session over argv training every (suite, seed) with `work`, as train_tiny.main does."""
    with session(argv) as run:
        for suite in run.suites:
            for seed in run.seeds:
                run.train(work, suite, seed, data)
    return run


@pytest.mark.parametrize("how, words", [("dies", "seed 1 died (exit code 3"), ("stops", "loss is nan")])
def test_an_error_in_one_jobs_process_stops_them_all_with_one_line(how, words, tmp_path):
    t0 = time.time()
    with pytest.raises(SystemExit, match=re.escape(words)):
        train_all(["--smoke", "--suite", "moe", "--seeds", "2", "--jobs", "2", "--out", str(tmp_path / how)],
                  dies_or_stops)
    assert time.time() - t0 < 60  # not after seed 0's two minutes


def sleeps(suite, P, run, seed, data):  # a (suite, seed) that trains for long (module level, for a spawned process)
    (run.run_dir.parent / f"pid{seed}").write_text(str(os.getpid()))
    time.sleep(120)
    return []


def running(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def pids_written(files):
    """The pids a test's processes wrote into files, once every file holds one (120 s at most)."""
    for _ in range(1200):
        if all(f.exists() and f.read_text() for f in files):
            break
        time.sleep(0.1)
    return [int(f.read_text()) for f in files]


def all_ended(pids):
    """Whether every process has ended within 10 s."""
    for _ in range(100):
        if not any(running(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def sessions_script(argv, data="None"):
    return (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_train_tiny as t\n"
            f"t.train_all({argv!r}, t.sleeps, {data})\n")


def test_a_run_with_every_suite_seed_at_once_says_when_its_time_left_comes(tmp_path, capsys):
    """Nothing finishes before the end when every (suite, seed) runs at once: the first line says
    so, and only then."""
    for jobs, seeds, at_once in (("2", "2", True), ("2", "3", False)):
        with session(["--smoke", "--suite", "moe", "--seeds", seeds, "--jobs", jobs, "--out", str(tmp_path / seeds)]):
            pass
        said = capsys.readouterr().out
        assert f"{seeds} (suite, seed)s in 2 processes at a time" in said
        assert ("all at once, so the run's time left comes with the first to finish" in said) == at_once, said


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_jobs_processes_end_when_their_parent_is_killed(tmp_path):
    """kill -9 of the parent leaves no process training on unseen (each watches its parent)."""
    argv = ["--smoke", "--suite", "moe", "--seeds", "2", "--jobs", "2", "--out", str(tmp_path)]
    parent = subprocess.Popen([sys.executable, "-c", sessions_script(argv)], cwd=HERE)
    pids = pids_written([tmp_path / "pid0", tmp_path / "pid1"])
    assert all(running(p) for p in pids)
    parent.kill()
    parent.wait()
    assert all_ended(pids)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("jobs", [1, 2])
def test_ctrl_c_stops_the_run_with_one_line_and_leaves_no_process(jobs, tmp_path):
    """Ctrl-C (SIGINT to the run's whole process group, as a terminal sends it): exit code 130,
    one line, no traceback from the parent or a --jobs process, and no process left. The run starts
    with Python's own SIGINT handler, as from a terminal (a shell's background job, such as a test
    run started with &, would pass SIGINT ignored on to it)."""
    argv = ["--smoke", "--suite", "moe", "--seeds", str(jobs), "--jobs", str(jobs), "--out", str(tmp_path)]
    script = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n" + sessions_script(argv)
    run = subprocess.Popen([sys.executable, "-c", script], cwd=HERE, start_new_session=True, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pids = pids_written([tmp_path / f"pid{s}" for s in range(jobs)])
    time.sleep(0.5)
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.count("interrupted: what finished is saved") == 1, err
    assert all_ended(pids)


@pytest.mark.parametrize("after", [0.2, 0.6])  # torch alone takes ~1.5 s to import here
def test_ctrl_c_during_start_up_prints_one_line_and_exits_130(after, tmp_path):
    """While torch and the project import (the first seconds): exit 130 and one line, no traceback,
    nothing written."""
    run = subprocess.Popen([sys.executable, "train_tiny.py", "--smoke", "--out", str(tmp_path / "out")], cwd=HERE,
                           start_new_session=True, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(after)
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert err.strip().splitlines() == ["interrupted during start-up: nothing was run or written"], err
    assert not (tmp_path / "out").exists()


STARTUP_INTERRUPT = """
import runpy, signal, sys
module = sys.argv.pop(1)
class Interrupt:  # a meta-path finder: Ctrl-C the moment the named module is looked for
    def find_spec(self, name, path=None, target=None):
        if name == module:
            signal.raise_signal(signal.SIGINT)
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv[0] = "train_tiny.py"
runpy.run_path("train_tiny.py", run_name="__main__")
print("ran on past", module)
"""


@pytest.mark.parametrize("module", ["numpy._core._exceptions", "numpy.exceptions", "numpy._core._multiarray_umath",
                                    "torch._C", "torch.nn.functional", "hd"])
def test_ctrl_c_inside_an_import_during_start_up_ends_the_process(module, tmp_path):
    """SIGINT while torch, numpy or the project is being imported, at named moments (torch imports
    numpy from C and drops the error an exception would be there; numpy cannot import its
    extension twice): exit 130, the one line, nothing run or written."""
    run = subprocess.run([sys.executable, "-c", STARTUP_INTERRUPT, module, "--smoke", "--out", str(tmp_path / "out")],
                         cwd=HERE, capture_output=True, text=True, timeout=120)
    assert run.returncode == 130, run.stderr[-2000:]
    assert run.stderr.strip().splitlines() == ["interrupted during start-up: nothing was run or written"], run.stderr
    assert "ran on past" not in run.stdout and not (tmp_path / "out").exists()


def test_jobs_default_to_the_cores_per_thread_and_refuse_torchrun(monkeypatch, capsys):
    monkeypatch.setattr(runner, "usable_cores", lambda: 4)
    assert session(["--smoke"]).jobs == 4
    assert session(["--smoke", "--threads", "2"]).jobs == 2
    assert session(["--smoke", "--threads", "8"]).jobs == 1
    assert session(["--smoke", "--jobs", "3"]).jobs == 3
    monkeypatch.setattr(runner, "DDP", True)
    assert session(["--smoke"]).jobs == 1
    with pytest.raises(SystemExit):
        session(["--smoke", "--jobs", "2"])
    assert "under torchrun give --jobs 1" in capsys.readouterr().err


SMOKE = ["--smoke", "--ckpt_every", "1", "--jobs", "1"]  # one process: a patched train is the one used


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One `--smoke` run (every suite with every arm), shared by the tests that read it: its
    out folder and the stages it trained."""
    out, stages, real = tmp_path_factory.mktemp("smoke"), [], trainer.train

    def counting(name, model, loss_fn, data, stage, args, seed, on_step=None, **kw):
        stages.append((name, stage.steps))
        return real(name, model, loss_fn, data, stage, args, seed, on_step, **kw)
    with pytest.MonkeyPatch.context() as mp:
        patch_train(mp, counting)
        tt.main(SMOKE + ["--out", str(out)])
    return out, stages


def test_smoke_runs_every_suite_and_writes_results(smoke_run):
    tmp_path, stages = smoke_run
    assert {s.split("/")[0] for s, _ in stages} == set(tt.SUITES)
    md = (tmp_path / "results.md").read_text()
    effects = all_effects()
    assert len(effects) == 28  # 8 HD and MoE, TaH-3, 4 for each TaH lookups task, 3 for addition, 2 attention, 3 HD inside per n
    assert len({e.id for e in effects}) == len(effects)
    for effect in effects:  # every effect reported, with the paper's figure in its caption
        assert f"**{effect.name}** (paper: {effect.paper})" in md, effect
    identifiers_and_labels_name_each_other_one_to_one(json.loads(next(tmp_path.glob("run-*/rows.json")).read_text())["rows"])
    result = json.loads((tmp_path / "results.json").read_text())
    assert [v["claim"] for v in result["verdicts"]] == [c.name for c in tt.claims(tt.PRESETS["smoke"])]  # every claim
    assert all(v["verdict"] == "not shown" for v in result["verdicts"])  # one seed can never show an effect
    assert "With one seed the rule cannot say shown" in md and "(one seed)" in md
    assert not list(tmp_path.glob("run-*/ckpt"))  # --smoke removes its checkpoints once reported
    tt.main(SMOKE + ["--out", str(tmp_path)])  # a second run finds every suite done
    assert (tmp_path / "results.md").read_text().split("\n", 1)[1] == md.split("\n", 1)[1]


# -----------------------------------------------------------------------------
# the demonstrations' protocols


def all_effects():
    """Every Effect the two suite files define: alone, in a tuple (a TaH task's), or in a dict, and
    the HD probes' effects of each n > 1."""
    found = []
    for module in (hl, ablations):
        for v in vars(module).values():
            for group in (v.values() if isinstance(v, dict) else [v]):
                found += [e for e in (group if isinstance(group, tuple) else [group]) if isinstance(e, hl.Effect)]
    found += [e for n in tt.PRESETS["smoke"].hd_ns if n > 1 for e in hl.hd_inside_effects(n)]  # made per n
    return list(dict.fromkeys(found))


def patch_train(monkeypatch, fn):
    """Every suite trains through `fn`: headline's and ablations' own name for trainer.train."""
    for module in (hl, ablations):
        monkeypatch.setattr(module, "train", fn)


def suite_run(name, P, args, seed, data, every_arm):
    """One (suite, seed), as train_tiny runs it."""
    return tt.train_seed(name, P, replace(args, every_arm=every_arm), seed, data)


def suite_args(tmp_path):
    return trainer.Run(tmp_path, log_every=100, ckpt_every=100)


def test_hd_continuations_start_from_one_checkpoint_and_see_the_same_batches(tmp_path, monkeypatch):
    seen, real = {}, trainer.train

    def spy(name, model, loss_fn, data, stage, args, seed, on_step=None, **kw):
        if "continued" not in name:
            return real(name, model, loss_fn, data, stage, args, seed, on_step, **kw)
        start = (copy.deepcopy(model.backbone.state_dict()), [t.weight.detach().clone() for t in model.tables])
        batches = []
        assert (stage.lr, stage.steps) == (P.hd_cont_lr, P.hd_cont_iters)  # the continuation's own budget

        def recording(m, x, y):
            batches.append((x.clone(), y.clone()))
            return loss_fn(m, x, y)
        seen[model.cfg.n_streams] = start, batches
        return real(name, model, recording, data, stage, args, seed, on_step, **kw)
    patch_train(monkeypatch, spy)
    P = replace(tt.PRESETS["smoke"], hd_cont_lr=1e-3)
    text = tasks.TextData("Is this a dagger which I see before me, the handle toward my hand? " * 60, tmp_path / "t.npz")
    suite_run("hd", P, suite_args(tmp_path), 0, text, every_arm=False)
    assert sorted(seen) == [1, 2, 4]
    (body1, (e0,)), batches1 = seen[1]
    for n in (2, 4):
        (body, tables), batches = seen[n]
        assert body.keys() == body1.keys()
        assert all(torch.equal(body[k], body1[k]) for k in body)  # bit-identical backbone
        assert len(tables) == n and all(torch.equal(t, e0) for t in tables)  # E_k <- E_{k mod 1} = E_0
        assert len(batches) == len(batches1) == P.hd_cont_iters
        assert all(torch.equal(x, x1) and torch.equal(y, y1) for (x, y), (x1, y1) in zip(batches, batches1))


def test_hd_ablations_continue_the_n1_checkpoint_on_the_headline_batches(tmp_path, monkeypatch):
    seen, real = {}, trainer.train  # name -> (config, backbone at the start, batches)

    def spy(name, model, loss_fn, data, P, args, seed, on_step=None, **kw):
        if "continued" not in name:
            return real(name, model, loss_fn, data, P, args, seed, on_step, **kw)
        batches = []

        def recording(m, x, y):
            batches.append((x.clone(), y.clone()))
            return loss_fn(m, x, y)
        seen[name] = model.cfg, copy.deepcopy(model.backbone.state_dict()), batches
        return real(name, model, recording, data, P, args, seed, on_step, **kw)
    patch_train(monkeypatch, spy)
    P = tt.PRESETS["smoke"]
    text = tasks.TextData("Out, out, brief candle! Life's but a walking shadow, a poor player " * 60, tmp_path / "t.npz")
    rows = suite_run("hd", P, suite_args(tmp_path), 0, text, every_arm=True)
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
            trained[(effect.id, arm.id)] = hl.hd_cont_arm(how).id
    assert len(seen) == 3 + sum(isinstance(h, dict) for _, _, h in ablations.hd_continued_ablation_arms(P))
    value = {(r["effect_id"], r["arm_id"], r["metric"]): r["value"] for r in rows}
    for (effect, arm), source in trained.items():
        assert value[(effect, arm, "loss")] == value[(hl.HD_N.id, source, "loss")]
    arms = {e.id: {a for (f, a, _) in value if f == e.id} for e in (ablations.HD_LAYOUTS_CONT, ablations.HD_OBJECTIVE_CONT,
                                                                    ablations.HD_KV_CONT, ablations.HD_SCRATCH)}
    for c in ablations.HD_ABLATION_CLAIMS:  # every claim names arms the suite writes
        assert {c.arm.id, c.baseline.id} <= arms[c.effect.id], c.name
    assert arms[ablations.HD_SCRATCH.id] == {arm.id for arm, _ in ablations.hd_scratch_arms(P)}


@pytest.mark.parametrize("suite", ["tah", "tah-hidden", "tah-add"])
def test_tah_oracle_labels_are_the_standard_models_top1_mistakes_in_the_response(suite, tmp_path, monkeypatch):
    trained, labelled, real, training = {}, [], trainer.train, [None]

    def spy(name, model, loss_fn, data, P, args, seed, on_step=None, **kw):
        training[0] = name
        out = real(name, model, loss_fn, data, P, args, seed, on_step, **kw)
        trained[name] = model
        return out
    real_stage1 = hl.ThinkAtHard.stage1_loss

    def stage1(self, idx, targets, depths):
        if training[0] == f"{suite}/TaH stage 1":  # not the token-type router's stage 1
            labelled.append((idx.clone(), targets.clone(), depths.clone()))
        return real_stage1(self, idx, targets, depths)
    patch_train(monkeypatch, spy)
    monkeypatch.setattr(hl.ThinkAtHard, "stage1_loss", stage1)
    P = tt.PRESETS["smoke"]
    task = {"tah": tasks.Lookups(P.symbols, P.queries, P.two_hop), "tah-add": tasks.Arith(P.digits),
            "tah-hidden": tasks.Lookups(P.symbols, P.queries, P.two_hop, per_problem=True)}[suite]
    suite_run(suite, P, suite_args(tmp_path), 0, task, every_arm=False)
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


@settings(max_examples=30, deadline=None)
@given(digits=st.integers(1, 4), seed=st.integers(0, 10_000), T=st.integers(6, 60), p_wrong=st.floats(0, 0.5))
def test_exact_match_counts_the_problems_whose_every_answer_digit_is_right(digits, seed, T, p_wrong):
    task = tasks.Arith(digits)
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
            for r in report.result_rows(hl.HD_N, hl.hd_cont_arm(n), s, {"loss": 5.0 - 0.01 * n - 0.001 * s})]
    claims = tt.claims(tt.PRESETS["default"])
    judged = report.judge(rows, claims)
    assert [v["claim"] for v in judged] == [c.name for c in claims if c.effect == hl.HD_N]  # other suites did not run
    assert len(judged) == 3
    relabelled = [{**r, "effect": r["effect"] + " (renamed)", "arm": r["arm"] + " (renamed)"} for r in rows]
    assert report.judge(relabelled, claims) == judged  # labels are for readers only
    renamed = [{**r, "arm_id": "n4-renamed"} if r["arm_id"] == hl.hd_cont_arm(4).id else r for r in rows]
    with pytest.raises(ValueError, match="n=4 beats n=1"):
        report.judge(renamed, claims)
    with pytest.raises(TypeError, match="an Arm"):  # a claim names arms by Arm, never by a label
        report.Claim("by label", hl.HD_N, hl.hd_cont_arm(2).label, hl.hd_cont_arm(1), "loss", -1)
    with pytest.raises(TypeError, match="an Effect and an Arm"):
        report.result_rows(hl.HD_N, "n=2 continued", 0, {"loss": 5.0})


def identifiers_and_labels_name_each_other_one_to_one(rows):
    """In a run's rows an (effect, arm) id names one (effect, arm) label and back; every claim's
    arms are written by its suite."""
    ids, labels = {}, {}
    for r in rows:
        ids.setdefault((r["effect_id"], r["arm_id"]), set()).add((r["effect"], r["arm"]))
        labels.setdefault((r["effect"], r["arm"]), set()).add((r["effect_id"], r["arm_id"]))
    assert all(len(v) == 1 for v in ids.values()) and all(len(v) == 1 for v in labels.values())
    effects = {e for e, _ in ids}
    for c in tt.claims(tt.PRESETS["smoke"]):  # every claim's arms are written by its suite
        assert c.effect.id in effects, c.name
        assert (c.effect.id, c.arm.id) in ids, c.name
        assert not isinstance(c.baseline, report.Arm) or (c.effect.id, c.baseline.id) in ids, c.name


def test_verdict_needs_the_papers_sign_in_every_seed_and_a_mean_beyond_twice_the_spread():
    assert report.verdict([-0.04, -0.05, -0.045], -1) == "shown"
    assert report.verdict([0.04, 0.05, 0.045], -1) == "not shown"  # the opposite sign
    assert report.verdict([-0.04, -0.05, +0.001], -1) == "not shown"  # one seed flips
    assert report.verdict([-0.01, -0.09, -0.002], -1) == "not shown"  # inside twice the spread
    assert report.verdict([-0.01, -0.01, -0.04], -1) == "not shown"  # mean 1.15 std from zero: beyond one, not two
    assert report.verdict([-0.015, -0.02, -0.035], -1) == "shown"  # mean 2.24 std from zero
    assert report.verdict([-0.04], -1) == "not shown"  # one seed cannot show anything
    assert report.verdict([0.2, 0.3, 0.25], +1) == "shown"
    assert report.verdict(np.array([-0.04, -0.05, -0.045]), -1) == "shown"


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
])
def test_the_verdict_rule_refuses_what_is_not_its_input(deltas, sign, words):
    with pytest.raises(ValueError, match=words):
        report.verdict(deltas, sign)


def test_pooling_refuses_an_empty_pool_and_a_delta_that_is_not_a_finite_number():
    with pytest.raises(ValueError, match="the pool is empty"):
        report.pooled([])
    with pytest.raises(ValueError, match="finite real numbers"):
        report.pooled([("A", 0, 0.1), ("A", 1, float("nan"))])
    assert report.pooled([("A", 0, 0.1), ("A", 1, 0.3)])["mean"] == pytest.approx(0.2)
    # the 95% interval beside the rule: mean ± t(0.975, n-1) * std / sqrt(n); 1..5 by hand: 3 ± 2.776 * 0.7071
    assert report.interval95([1, 2, 3, 4, 5]) == pytest.approx((3 - 1.9629, 3 + 1.9629), abs=1e-3)
    assert report.interval95([2.0, 4.0]) == pytest.approx((3 - 12.706, 3 + 12.706), abs=1e-3)
    assert report.interval95([1.0]) is None and report.interval95([1.0, float("nan")]) is None


def test_a_metric_without_a_value_in_some_seeds_is_summarized_over_the_others():
    # the decider's "share of AlwaysThink's gain" is nan in a seed where AlwaysThink gains nothing
    fx, rr = hl.TAH_FX[0], report.result_rows
    rows = [r for s in range(3) for r in rr(fx, hl.STANDARD, s, {"acc": 0.5})]
    rows += [r for s, v in enumerate([0.5, float("nan"), 1.5]) for r in rr(fx, hl.TAH_DECIDER, s, {"share": v})]
    rows += [r for s in range(3) for r in rr(fx, hl.TAH_DECIDER, s, {"none": float("nan")})]
    rows += [r for s, v in enumerate([0.6, float("nan"), 0.8]) for r in rr(fx, hl.TAH_DECIDER, s, {"acc": v})]
    summary = report.summarize(rows)
    s = {x["metric"]: x for x in summary}
    acc = next(x for x in summary if x["arm"] == hl.TAH_DECIDER.label and x["metric"] == "acc")
    assert (acc["delta_mean"], acc["delta_std"]) == pytest.approx((0.2, np.sqrt(0.02)))  # (0.1, 0.3) by hand
    assert (s["share"]["mean"], s["share"]["std"], s["share"]["n"], s["share"]["seeds"]) == (1.0, np.sqrt(0.5), 2, 3)
    md = report.table(summary, [], "")
    assert "1.0000 ± 0.7071 (2 of 3 seeds)" in md and "no value" in md and "nan" not in md


# -----------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("argv, words", [
    (["--suite", "nope"], "unknown suite"),
    (["--seeds", "0"], "--seeds"),
    (["--iters", "-3"], "--iters"),
    (["--frobnicate"], "unrecognized"),
    (["--data", "/no/such/file.txt"], "no such file"),
    (["--device", "foo"], "--device must be"),
    (["--device", "meta"], "--device must be"),
    (["--suite", "moe,moe"], "twice"),
    (["--smoke", "--preset", "default"], "not both"),
    (["--seed0", "-1"], "--seed0 must be >= 0"),
    (["--suite", "tah,moe", "--accum", "3", "--batch", "2"], "--batch 2 has fewer rows than 1 rank(s) x 3"),
    (["--hd_ns", "2,4"], "--hd_ns must start at 1"),
    (["--hd_ns", "1,4,2"], "and rise"),
    (["--hd_ns", "1"], "two values or more"),
    (["--hd_ns", "1,x"], "invalid"),
    (["--suite", "tah", "--accum", "8", "--tah_batch", "7", "--batch", "9"], "--tah_batch 7 has fewer rows"),
    (["--out", ""], "--out must name a folder"),
    (["--threads", "0"], "--threads"),
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--lr=nan"], "--lr must be a finite number"),
    (["--n_layer=0"], "--n_layer must be an int in [1, "),
    *[([f"--{f}", str(10**30)], f"--{f} must be an int in [1, 9,007,199,254,740,992], got 1{'0' * 30}")
      for f in ("n_embd", "n_head", "head_dim", "n_experts", "expert_hidden", "batch", "tah_batch", "window")],
    (["--iters", str(10**30)], "--iters must be an int in [1, 1,000,000]"),
    (["--seeds", str(10**30)], "--seeds must be an int in [1, 1,000]"),
    (["--warmup", str(10**7)], "--warmup must be an int in [1, 1,000,000]"),
    (["--batch", str(10**8)], "and the cpu has"),  # the size rule: the estimate and the machine's memory
    (["--n_embd", str(2**20)], "needs ~"),
    (["--layout=IIF"], "builds no valid model: layout"),
    (["--n_layer=2.5"], "invalid int value"),
    (["--smoke", "--suite", "tah", "--digits=16"], "holds no whole Arith problem"),
    (["--block=1"], "holds no whole Lookups problem"),
    (["--digits=19"], "--digits must be <= 18"),
    (["--plays=macbeth,macbeth"], "names a play twice"),
    (["--seed0", "100000000000000"], "--seed0 must be >= 0 and at most"),
    (["--seed0", str(2**64)], "--seed0 must be >= 0 and at most"),
    (["--seed0", "1e30"], "invalid int value"),
])
def test_bad_arguments_exit_with_one_clear_message(argv, words, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        session(argv + ([] if "--out" in argv else ["--out", str(tmp_path / "out")]))
    assert e.value.code != 0
    assert words in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_missing_package_fails_clearly():
    with pytest.raises(SystemExit, match="not installed"):
        tasks.package_dir("no_such_package_here")


def block_path(path, as_folder):
    """Put a folder (or a file) where the run expects a file (or a folder)."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.mkdir() if as_folder else path.write_text("x")


@pytest.mark.parametrize("case", ["out under a file", "rows.json a folder", "run folder a file", "ckpt a file",
                                  "token cache a folder", "data unreadable", "disk full"])
def test_file_system_errors_stop_with_one_line(case, tmp_path, monkeypatch):
    """Each file-system error gets one line (no traceback) from the one boundary in main."""
    argv = ["--preset", "smoke", "--suite", "moe", "--out", str(tmp_path)]  # keeps its checkpoints, unlike --smoke
    tt.main(argv)  # a finished run to spoil
    run = next(tmp_path.glob("run-*"))
    if case == "out under a file":
        block_path(tmp_path / "blocker", as_folder=False)
        argv[-1] = str(tmp_path / "blocker" / "sub")
    elif case == "rows.json a folder":
        block_path(run / "rows.json", as_folder=True)
    elif case == "run folder a file":
        block_path(run, as_folder=False)
    elif case == "ckpt a file":
        (run / "rows.json").unlink()
        block_path(run / "ckpt", as_folder=False)
    elif case == "token cache a folder":
        block_path(next(tmp_path.glob("shakespeare_*.npz")), as_folder=True)
    elif case == "data unreadable":
        data = tmp_path / "text.txt"
        data.write_text("some words " * 2000)
        argv += ["--data", str(data)]
        real = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes", lambda p: (_ for _ in ()).throw(PermissionError(
            13, "Permission denied", str(p))) if p == data else real(p))
    else:  # the checkpoint writer meets a full disk
        (run / "rows.json").unlink()
        shutil.rmtree(run / "ckpt")
        monkeypatch.setattr(trainer, "atomic", lambda path, write: (_ for _ in ()).throw(OSError(
            28, "No space left on device", str(path))))
    with pytest.raises(SystemExit, match="^error: ") as e:
        tt.main(argv)
    assert "\n" not in str(e.value.code)


def test_non_utf8_paths_and_a_non_numeric_port_are_refused(capsys):
    with pytest.raises(SystemExit):
        session(["--out", "out-\udcff"])  # a byte that is not UTF-8, as Python passes it on
    assert "UTF-8 paths" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="MASTER_PORT"):
        runner.dist_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "x"})


def test_data_that_no_suite_reads_or_that_is_a_folder_is_refused(tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("some text " * 100)
    with pytest.raises(SystemExit):
        session(["--data", str(f), "--suite", "tah"])
    with pytest.raises(SystemExit):
        session(["--data", str(tmp_path)])
    err = capsys.readouterr().err
    assert "suites that train on text (hd, moe, hd-progressive)" in err and "it is a folder" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused(capsys):
    with pytest.raises(SystemExit):
        session(["--device", "cuda:0"])
    assert "CUDA is not available" in capsys.readouterr().err


def test_rank_without_world_size_is_one_clear_error():
    assert runner.dist_env({}) == (False, 0, 1)
    launched = {"LOCAL_RANK": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}  # what torchrun sets
    assert runner.dist_env({"RANK": "1", "WORLD_SIZE": "2", **launched}) == (True, 1, 2)
    with pytest.raises(SystemExit, match="WORLD_SIZE"):
        runner.dist_env({"RANK": "0"})
    with pytest.raises(SystemExit, match="not in"):
        runner.dist_env({"RANK": "3", "WORLD_SIZE": "2", **launched})
    with pytest.raises(SystemExit, match="MASTER_ADDR, MASTER_PORT not: launch with torchrun"):
        runner.dist_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})


@pytest.mark.parametrize("content, words", [(b"", "empty"), (b"\x00\x01\x02binary\x00" * 50, "binary"),
                                            (b"\xff\xfe\xfa" * 50, "not UTF-8"), (b"Too short.", "too short")])
def test_bad_data_files_fail_before_any_training(tmp_path, content, words):
    f = tmp_path / "d.txt"
    f.write_bytes(content)
    with pytest.raises(SystemExit, match=words):
        tt.main(["--smoke", "--suite", "moe", "--data", str(f), "--out", str(tmp_path / "out")])
    assert not list((tmp_path / "out").glob("run-*/ckpt/*.pt"))  # nothing trained


def test_non_finite_loss_stops_the_run_naming_the_arm_and_step(tmp_path):
    P = trainer.Stage(steps=5, lr=3e-3, warmup=2, batch=4, block=16)
    args = trainer.Run(tmp_path, log_every=100, ckpt_every=1)
    calls = []

    def blows_up(m, x, y):
        calls.append(1)
        loss = hl.lm_loss(m, x, y)
        return loss * float("nan") if len(calls) == 3 else loss
    with pytest.raises(SystemExit, match=r"\[arm s0\] loss is nan at step 3"):
        trainer.train("arm", small(), blows_up, tasks.Arith(2), P, args, seed=0)


def test_non_finite_weights_after_a_finite_loss_are_refused_before_any_save(tmp_path):
    P = trainer.Stage(steps=2, lr=3e-3, warmup=1, batch=4, block=16)
    args = trainer.Run(tmp_path, log_every=100, ckpt_every=100)

    steps = []

    def spoils_last_step(m, x, y):
        loss = hl.lm_loss(m, x, y)
        steps.append(1)
        if len(steps) == 2:  # the last step: its loss is finite, the weights after it are not
            with torch.no_grad():
                next(m.parameters()).fill_(float("nan"))
        return loss
    with pytest.raises(SystemExit, match=r"\[arm s0\] the weights are not finite after step 2"):
        trainer.train("arm", small(), spoils_last_step, tasks.Arith(2), P, args, seed=0)
    assert not list(tmp_path.rglob("*.pt"))  # nothing saved


def test_a_damaged_or_foreign_checkpoint_gives_one_line_naming_the_file(tmp_path):
    P = trainer.Stage(steps=3, lr=3e-3, warmup=1, batch=4, block=16)
    key = ["k1"]  # the configuration the next train call belongs to
    train = lambda name, seed=0: trainer.train(name, small(), hl.lm_loss, tasks.Arith(2), P,
                                               trainer.Run(tmp_path, key[0], log_every=100, ckpt_every=1), seed=seed)
    train("arm")
    train("other", seed=1)
    ckpt, other = tmp_path / "ckpt" / "arm_s0.pt", tmp_path / "ckpt" / "other_s1.pt"
    good = ckpt.read_bytes()
    state = trainer.load_checkpoint(ckpt)
    assert state["meta"] == dict(arm="arm", seed=0, iters=3, run="k1") and state["iter"] == 3
    key[0] = "k2"  # the same arm's checkpoint, of another configuration
    with pytest.raises(SystemExit, match=f"{ckpt.name} holds .*'k1'.* not .*'k2'"):
        train("arm")
    key[0] = "k1"
    at = len(good) // 2  # one changed byte anywhere: the checksum no longer matches
    ckpt.write_bytes(good[:at] + bytes([good[at] ^ 1]) + good[at + 1:])
    with pytest.raises(SystemExit, match=f"{ckpt.name} is damaged.*--fresh"):
        train("arm")
    ckpt.write_bytes(good[:100])  # truncated
    with pytest.raises(SystemExit, match=f"{ckpt.name} is damaged"):
        train("arm")
    ckpt.write_bytes(other.read_bytes())  # another arm's finished checkpoint copied in place
    with pytest.raises(SystemExit, match=f"{ckpt.name} holds .*'other'.* not .*'arm'"):
        train("arm")
    nan_model = small()
    with torch.no_grad():
        for p in nan_model.parameters():
            p.fill_(float("nan"))
    trainer.save(ckpt, nan_model, [], 3, state["losses"], state["meta"])  # intact, this arm's, non-finite
    with pytest.raises(SystemExit, match="non-finite weights"):
        train("arm")
    ckpt.write_bytes(good)
    assert train("arm") == state["losses"]  # the intact file is used as it is


def test_damaged_rows_file_orphaned_temporaries_and_fresh(tmp_path):
    argv = ["--preset", "smoke", "--suite", "tah", "--out", str(tmp_path)]  # keeps its checkpoints
    tt.main(argv)
    (run,) = tmp_path.glob("run-*")
    orphan = run / "ckpt" / "x.pt.123.tmp"
    orphan.write_bytes(b"half")
    tt.main(argv)
    assert not orphan.exists()
    good = (run / "rows.json").read_text()
    doc = json.loads(good)
    v = repr(doc["rows"][0]["value"])  # as json wrote it
    i = good.index(f": {v}") + len(v) + 1  # its last digit
    one_digit = good[:i] + ("1" if good[i] != "1" else "2") + good[i + 1:]
    for damaged in ('[{"suite": "tah", ', "{}", "[1]", '[{"suite": "tah"}]', one_digit,
                    json.dumps({"sha256": doc["sha256"], "rows": [{"suite": "tah"}]})):
        assert damaged != good
        (run / "rows.json").write_text(damaged)
        with pytest.raises(SystemExit, match="rows.json is damaged"):
            tt.main(argv)
    (run / "rows.json").write_text(good)
    other = tmp_path / "other"
    tt.main(argv[:-1] + [str(other), "--tah_sft_lr=0.003"])  # another configuration's finished rows, copied in
    (run / "rows.json").write_text(next(other.glob("run-*/rows.json")).read_text())
    with pytest.raises(SystemExit, match="holds the rows of run .*, not of this run"):
        tt.main(argv)
    tt.main(argv + ["--fresh"])
    assert json.loads((run / "rows.json").read_text())["rows"]


def test_the_run_key_covers_every_source_file_a_run_imports():
    """SOURCES = train_tiny.py and every module beside it that it imports, directly or not
    (read from their import statements): a new module a run imports must join the run key."""
    import ast
    seen, todo = set(), ["train_tiny.py"]
    while todo:
        name = todo.pop()
        seen.add(name)
        for node in ast.walk(ast.parse((HERE / name).read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            todo += [f"{m}.py" for m in mods if (HERE / f"{m}.py").exists() and f"{m}.py" not in seen]
    assert set(runner.SOURCES) == seen


def test_the_run_key_changes_with_the_data_content(tmp_path):
    f = tmp_path / "d.txt"
    f.write_text("When shall we three meet again\nIn thunder, lightning, or in rain?\n" * 60)
    argv = ["--smoke", "--suite", "moe", "--data", str(f), "--out", str(tmp_path / "out")]
    tt.main(argv)
    f.write_text("When the hurlyburly's done,\nWhen the battle's lost and won.\n" * 60)
    tt.main(argv)
    assert len(list((tmp_path / "out").glob("run-*"))) == 2  # the edited file was not taken as done


KILLS = [("moe/bias update on", 2), ("moe/bias update off", 1), ("tah/TaH stage 1", 2), ("hd/n=2 continued", 1),
         ("tah-hidden/token-type router", 2), ("tah3/TaH-3, iterated labels (max 3 passes) stage 1", 1),
         ("hd/n=2 continued, objective sum", 1)]  # one kill per suite family, and an ablation arm


def test_every_reported_number_is_the_same_after_a_kill_and_resume(tmp_path, monkeypatch, smoke_run):
    """One run of every suite and arm, killed at each of KILLS in turn and resumed after each,
    reports what the run never killed (smoke_run) reports."""
    real, killed = trainer.train, []

    class Killed(Exception):
        pass

    def dies_once_at_each(name, model, loss_fn, data, P, args, seed, on_step=None, **kw):
        def kill(done):
            if (name, done) in KILLS and (name, done) not in killed:
                killed.append((name, done))
                raise Killed
        return real(name, model, loss_fn, data, P, args, seed, on_step=kill, **kw)
    patch_train(monkeypatch, dies_once_at_each)
    for _ in range(len(KILLS)):
        with pytest.raises(Killed):
            tt.main(SMOKE + ["--out", str(tmp_path)])
    tt.main(SMOKE + ["--out", str(tmp_path)])
    a, b = (json.loads((d / "results.json").read_text()) for d in (smoke_run[0], tmp_path))
    assert sorted(killed) == sorted(KILLS) and a["summary"] == b["summary"] and a["verdicts"] == b["verdicts"]


def test_compile_trains_through_the_compiled_models_and_matches_eager(tmp_path, monkeypatch):
    """--compile trains through torch.compile(model, fullgraph=True) for the backbone and HD, and
    gives the eager numbers up to float reordering; without the flag nothing is compiled on the
    CPU. Compiled with aot_eager (dynamo's and autograd's tracing, in seconds): test_compile.py
    compiles with inductor, as a GPU run does."""
    real, calls = torch.compile, []

    def compile_traced(model, **kw):
        calls.append((type(model).__name__, kw.get("fullgraph")))
        return real(model, **{**kw, "backend": "aot_eager"})

    monkeypatch.setattr(torch, "compile", compile_traced)
    common = ["--preset", "smoke", "--suite", "moe", "--device", "cpu", "--jobs", "1"]  # headline arms only
    for flag, out in (([], "eager"), (["--compile"], "compiled")):
        tt.main(common + flag + ["--out", str(tmp_path / out)])
        if not flag:
            assert calls == []
    assert calls and all(c == ("Transformer", True) for c in calls), calls
    eager, compiled = (json.loads((tmp_path / d / "results.json").read_text())["summary"] for d in ("eager", "compiled"))
    assert [(s["arm"], s["metric"]) for s in eager] == [(s["arm"], s["metric"]) for s in compiled]
    for a, b in zip(eager, compiled):
        assert b["mean"] == pytest.approx(a["mean"], rel=1e-3, abs=1e-3), (a["arm"], a["metric"])


def test_flops_per_token_counts_active_experts_and_expanded_rows():
    """The MFU line's model FLOPs, against a count by hand: 6 per weight a row passes through
    (only top_k of the routed experts; no embedding lookups), attention 12 * L * H * hd * T/2,
    times the n rows of each token under HD."""
    base = dict(vocab_size=50, block_size=16, n_layer=3, n_embd=16, n_head=6, n_kv_head=2, head_dim=8,
                n_experts=4, expert_hidden=8)
    T = 16
    m1 = Transformer(ModelConfig(**base, top_k=1))
    m2 = Transformer(ModelConfig(**base, top_k=2))
    routed = sum(p.numel() for n, p in m1.named_parameters() if n.endswith(("w_gate_up", "w_down")))
    assert trainer.flops_per_token(m2, T) - trainer.flops_per_token(m1, T) == pytest.approx(6 * routed / 4)
    dense = sum(p.numel() for n, p in m1.named_parameters()
                if p.ndim >= 2 and "wte" not in n and not n.endswith(("w_gate_up", "w_down")))
    attention = 12 * 3 * 6 * 8 * T / 2
    assert trainer.flops_per_token(m1, T) == pytest.approx(6 * (dense + routed / 4) + attention)
    hd = hl.HiddenDecoding(hl.HDConfig(**base, top_k=1, n_streams=2, layout="IFL"))
    assert trainer.flops_per_token(hd, T) == pytest.approx(2 * (6 * (dense + routed / 4) + 2 * attention))


def test_preset_fields_are_flags_the_nanogpt_way():
    args = session(["--n_layer=4", "--layout=IIFL", "--plays=macbeth,hamlet", "--lr", "0.01", "--seeds=1",
                    "--hd_ns=1,2,8"])
    assert (args.P.n_layer, args.P.layout, args.P.plays, args.P.lr, args.P.seeds, args.P.hd_ns) == (
        4, "IIFL", ("macbeth", "hamlet"), 0.01, 1, (1, 2, 8))
    assert args.P.n_embd == tt.PRESETS["default"].n_embd  # the rest from the preset
    other = session(["--n_layer=4", "--layout=IIFL", "--log_every=7", "--ckpt_every", "9", "--seed0=3"])
    assert (other.P.n_layer, other.run.log_every, other.run.ckpt_every, list(other.seeds)) == (4, 7, 9, [3, 4, 5, 6, 7])
    assert session([]).preset_name == "default"  # on any device: the measured protocol
    assert session(["--smoke", "--iters=7"]).P == replace(tt.PRESETS["smoke"], iters=7)


def test_summing_over_ranks_leaves_a_parameter_no_rank_has_a_gradient_for_untouched(tmp_path):
    """In one process the optimizer skips a parameter without a gradient (TaH's LoRA and decider
    while the Standard model trains); filling it with zeros under DDP would let AdamW's weight
    decay move it, and the runs would part. One rank of a real process group."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        used, unused = torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.ones(3, 3))
        (used * 2).sum().backward()
        assert trainer.sum_over_ranks([used, unused], 1.5, "cpu") == 1.5
        assert unused.grad is None and torch.equal(used.grad, torch.full((3, 3), 2.0))
        before = unused.detach().clone()
        opt = torch.optim.AdamW([used, unused], lr=0.1, weight_decay=0.1)
        opt.step()
        assert torch.equal(unused, before)
    finally:
        dist.destroy_process_group()


def test_muon_trains_every_model_class(tmp_path):
    """TaH's stage 2 trains only the decider, which has no matrix inside the blocks: Muon gets
    nothing there and AdamW takes the rest."""
    tt.main(["--preset", "smoke", "--suite", "hd,tah,moe", "--muon", "--out", str(tmp_path)])  # every model class
    assert json.loads((tmp_path / "results.json").read_text())["verdicts"]


def test_progressive_expansion_chain_keeps_the_function_at_each_stage():
    """1 -> 2 -> 4 (HD §2.3): where expansion is exactly function-preserving (intra-stream layers,
    every stream of a token at its position), each stage starts with its predecessor's logits."""
    torch.manual_seed(0)
    cfg = hl.HDConfig(vocab_size=61, block_size=16, n_layer=3, n_embd=32, n_head=6, n_kv_head=2, head_dim=8,
                      n_experts=4, expert_hidden=16, layout="III", positions="token", n_streams=1)
    one = hl.HiddenDecoding(cfg).eval()
    two = hl.expand_streams(one, 2)
    with torch.no_grad():
        for p in two.parameters():  # stage 1 trains: the next expansion starts from other weights
            p.add_(0.01 * torch.randn_like(p))
    four = hl.expand_streams(two, 4)
    idx = torch.randint(61, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hl.expand_streams(one, 2)(idx)[0], one(idx)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(four(idx)[0], two(idx)[0], atol=1e-5, rtol=1e-5)
    assert four.cfg.n_streams == 4 and torch.equal(four.tables[3].weight, two.tables[1].weight)


def test_the_progressive_suites_control_sees_the_batches_of_the_expanded_arms(tmp_path, monkeypatch):
    seen, real = [], trainer.train

    def recording(name, model, loss_fn, data, stage, args, seed, on_step=None, first_batch=0):
        seen.append((name, first_batch, stage.steps, getattr(model.cfg, "n_streams", 1)))
        return real(name, model, loss_fn, data, stage, args, seed, on_step, first_batch=first_batch)
    patch_train(monkeypatch, recording)
    tt.main(["--smoke", "--suite", "hd-progressive", "--out", str(tmp_path)])
    P = tt.PRESETS["smoke"]
    by_stage = {}
    for name, first, iters, n in seen[1:]:
        by_stage.setdefault(name.rsplit(" ", 1)[1], set()).add((first, iters))
        assert name.startswith(f"hd-progressive/n={n} stage")
    assert by_stage == {"1": {(P.hd_base_iters, P.hd_cont_iters)}, "2": {(P.hd_base_iters + P.hd_cont_iters, P.hd_cont_iters)}}
    assert [n for *_, n in seen] == [1, 1, 2, 1, 2, 4]


def test_a_non_finite_evaluation_stops_the_run_and_leaves_no_results(tmp_path):
    tt.main(["--smoke", "--suite", "moe", "--out", str(tmp_path)])
    assert (tmp_path / "results.json").exists()
    with pytest.raises(SystemExit, match="held-out loss is nan"):
        tt.main(["--smoke", "--suite", "moe", "--lr=1e20", "--iters=1", "--out", str(tmp_path)])
    assert not (tmp_path / "results.json").exists()  # not the earlier run's, beside a failed one


class SlowToPickle:
    """Task data whose pickling (in the parent, inside Process.start) takes 3 s: a wide start-up
    window. It marks the window's start in a file; unpickled in the process, it records its pid."""

    def __init__(self, folder):
        self.folder = folder

    def __reduce__(self):
        (Path(self.folder) / "starting").write_text("")
        time.sleep(3)
        return record_pid, (self.folder,)


def record_pid(folder):
    (Path(folder) / "pid0").write_text(str(os.getpid()))
    return None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_while_a_jobs_process_starts_is_not_lost(tmp_path):
    """SIGINT to the run's process group while the parent is inside a --jobs process's start
    (its task takes 3 s to pickle): the run stops with exit code 130 and one line, no traceback
    from either process, and no process left. (Before: SIGINT was ignored there, and lost.)"""
    argv = ["--smoke", "--suite", "moe", "--seeds", "2", "--jobs", "2", "--out", str(tmp_path)]
    script = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              + sessions_script(argv, f"t.SlowToPickle({str(tmp_path)!r})"))
    run = subprocess.Popen([sys.executable, "-c", script], cwd=HERE, start_new_session=True, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for _ in range(1200):
        if (tmp_path / "starting").exists():
            break
        time.sleep(0.1)
    time.sleep(1.0)  # inside the 3-second start
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.count("interrupted: what finished is saved") == 1, err
    assert all_ended(pids_written([tmp_path / "pid0"]) if (tmp_path / "pid0").exists() else [])


def test_a_master_port_out_of_range_is_refused_at_start():
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="99999")
    with pytest.raises(SystemExit, match="MASTER_PORT must be a port in 1..65535, got 99999"):
        runner.dist_env(env)


@pytest.mark.parametrize("case", ["unresolvable address", "port in use"])
def test_a_ddp_set_up_that_cannot_start_stops_with_one_line(case, monkeypatch):
    """The process group's set-up sits inside main's error boundary: an address that does not
    resolve is refused before c10d's retries; a port another process listens on gives one line."""
    import socket
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    addr = "no.such.host.invalid" if case == "unresolvable address" else "127.0.0.1"
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR=addr,
                     MASTER_PORT=str(busy.getsockname()[1])).items():
        monkeypatch.setenv(k, v)
    try:
        with pytest.raises(SystemExit) as e:
            runner.start_ddp("cpu", timeout=20)
    finally:
        busy.close()
    line = str(e.value.code)
    assert line.startswith("error: ") and "\n" not in line
    assert ("does not resolve" if case == "unresolvable address" else "did not start") in line


def test_a_token_cache_that_is_a_folder_stops_with_one_line_naming_it(tmp_path, capsys):
    tt.main(["--smoke", "--suite", "moe", "--out", str(tmp_path)])
    (cache,) = tmp_path.glob("*.npz")
    cache.unlink()
    cache.mkdir()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        tt.main(["--smoke", "--suite", "moe", "--out", str(tmp_path)])
    assert str(e.value.code) == f"error: the token cache {cache} is a folder; remove it, or choose another --out"
    assert "tokenizing" not in capsys.readouterr().err


def test_a_full_disk_names_the_file_being_written(tmp_path):
    def full(f):
        raise OSError(28, "No space left on device")  # as a write() raises it: no file name
    with pytest.raises(OSError) as e:
        tasks.atomic(tmp_path / "results.md", full)
    assert e.value.filename == str(tmp_path / "results.md") and e.value.strerror == "No space left on device"
    assert not list(tmp_path.iterdir())  # no .tmp left


def test_temporaries_of_a_run_killed_mid_write_are_swept_from_out(tmp_path):
    tt.main(["--smoke", "--suite", "moe", "--out", str(tmp_path)])
    left = [tmp_path / f"results.md.{os.getpid()}.tmp", tmp_path / "results.json.7.tmp", tmp_path / "x.npz.7.tmp"]
    for f in left:
        f.write_text("half")
    tt.main(["--smoke", "--suite", "moe", "--out", str(tmp_path)])
    assert not any(f.exists() for f in left)


@pytest.mark.parametrize("durations, jobs", [((110, 90), 2), ((110, 90), 1), ((110, 30), 2), ((60, 60, 20, 200), 4)])
def test_the_time_left_is_within_30_percent_once_each_suite_has_finished_a_seed(durations, jobs):
    """time_left against the truth of a simulated run (5 seeds of suites that take these seconds,
    scheduled as Session.train schedules them: in order, on the first of `jobs` processes free,
    each seed of a suite within 10% of the others): after every finish once each suite has
    finished a seed, the estimate is within 30% of the time that is really left."""
    import random
    rng = random.Random(0)
    units = [(s, k) for k in range(5) for s in range(len(durations))]  # seed by seed, as --suite order x seeds
    units = sorted(units)  # train_tiny's loop: suite by suite, then seed
    took = {u: durations[u[0]] * rng.uniform(0.95, 1.05) for u in units}
    free, ends, starts = [0.0] * jobs, {}, {}
    for u in units:
        i = free.index(min(free))
        starts[u], ends[u] = free[i], free[i] + took[u]
        free[i] = ends[u]
    finish = max(ends.values())
    for now in sorted(ends.values()):
        done = [u for u in units if ends[u] <= now]
        seen = {}
        for u in done:
            seen.setdefault(u[0], []).append(took[u])
        if len(seen) < len(durations):
            continue
        running = {u: starts[u] for u in units if starts[u] <= now < ends[u]}
        todo = [u for u in units if ends[u] > now]
        left = runner.time_left(todo, seen, running, jobs, now)
        assert abs(left - (finish - now)) <= 0.3 * (finish - now) + 1e-9, (now, left, finish - now)


def test_help_gives_each_default_once_in_the_form_the_flag_takes(capsys):
    """--help: no flag shows two defaults or "(default: None)"; --device says its default depends
    on the machine; a preset override lists every preset's value as the flag takes it."""
    with pytest.raises(SystemExit):
        tt.main(["--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    flags = re.split(r" (?=--[a-z_]+[ ,])", text.split("options:")[1])
    assert len(flags) > 40
    for f in flags:
        assert f.count("(default:") + f.count("; default:") <= 1, f
        assert "(default: None)" not in f and "(default: False)" not in f, f
    assert "cuda where torch sees a GPU, else cpu" in text
    assert "--threads THREADS CPU threads per process" in text and "(default: 1)" in text
    assert "preset default macbeth,hamlet,othello,king-lear, large '', smoke macbeth" in text
    assert "('macbeth'" not in text


def test_the_t_quantiles_hold_95_percent_of_students_t():
    """report.T975 against the t density integrated numerically (a brute-force reference)."""
    from math import gamma, pi, sqrt
    for dof, t in report.T975.items():
        x = np.linspace(-t, t, 400_001)
        pdf = gamma((dof + 1) / 2) / (sqrt(dof * pi) * gamma(dof / 2)) * (1 + x ** 2 / dof) ** (-(dof + 1) / 2)
        assert abs(np.trapezoid(pdf, x) - 0.95) < 2e-4, dof


@settings(max_examples=30, deadline=None)
@given(a=st.lists(st.floats(-1, 1), min_size=2, max_size=6), b=st.lists(st.floats(-1, 1), min_size=2, max_size=6),
       noise=st.floats(0.01, 0.5))
def test_pooled_counts_a_repeated_run_once_and_averages_a_seeds_runs(a, b, noise):
    """The grid's pooled interval, by brute force: machine A's cell given twice (1 and 2 threads,
    equal to every digit) counts once; machine B's two thread counts differ, and each seed is
    their mean; N is the (machine, seed)s and the interval is t with N - 1 degrees of freedom."""
    b2 = [x + noise for x in b]
    runs = ([("A", s, x) for s, x in enumerate(a)] * 2 + [("B", s, x) for s, x in enumerate(b)]
            + [("B", s, x) for s, x in enumerate(b2)])
    units = a + [(x + y) / 2 for x, y in zip(b, b2)]
    got = report.pooled(runs)
    n, m, sd = len(units), float(np.mean(units)), float(np.std(units, ddof=1))
    assert got["n"] == len(a) + len(b)
    assert got["mean"] == pytest.approx(m, abs=1e-12) and got["std"] == pytest.approx(sd, abs=1e-12)
    half = report.T975[n - 1] * sd / np.sqrt(n)
    assert got["interval95"] == pytest.approx((m - half, m + half), abs=1e-12)
    cells = report.pooled_cells([(len(a), np.mean(a), np.std(a, ddof=1)),
                                 (len(b), np.mean(units[len(a):]), np.std(units[len(a):], ddof=1))])
    assert all(np.allclose(cells[k], got[k], atol=1e-12) for k in got)  # the same numbers from the cells' summaries


@given(st.lists(st.floats(1, 100), min_size=0, max_size=6), st.lists(st.floats(1, 100), min_size=1, max_size=3),
       st.integers(1, 3), st.floats(0, 50))
@settings(deadline=None)
def test_the_jobs_time_left_is_when_the_last_process_is_free(waiting, running, jobs, ran):
    """runner.time_left: the running units finish, each waiting one goes (in order) to the first
    process free, every unit its suite's mean time so far. Against a step-by-step simulation of
    that schedule: the time left is the moment the last process is done, not the first."""
    running = running[:jobs]
    took = {f"w{i}": [s] for i, s in enumerate(waiting)} | {f"r{i}": [s] for i, s in enumerate(running)}
    now = 1000.0
    got = runner.time_left([(f"r{i}", 0) for i in range(len(running))] + [(f"w{i}", 0) for i in range(len(waiting))],
                           took, {(f"r{i}", 0): now - ran for i in range(len(running))}, jobs, now)
    busy = [max(0.0, s - ran) for s in running] + [0.0] * (jobs - len(running))  # each process: when it is free
    for s in waiting:
        first = busy.index(min(busy))
        busy[first] += s
    assert got == pytest.approx(max(busy), abs=1e-6)


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
