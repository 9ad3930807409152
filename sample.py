"""
Sample from what the main job trained (nanoGPT's sample.py, for both papers):

- text from the largest HD model (n = 4) continued on Shakespeare, decoded with its KV caches
  (generate.generate: each new token enters as its 4 stream rows);
- one held-out lookup problem answered by the TaH model under its decider, each token's
  passes shown: a query the decider sent on to a second pass is marked *.

    python train_tiny.py && python sample.py         # the default run's seed 0, from out/
    python sample.py --seed 2 --tokens 300 --temperature 0.8 --top_k 50

It reads the run's results.json (the run's folder, its text and task) and the checkpoints kept
there, each carrying the config that rebuilds its model, as nanoGPT's carry their model_args
(`--smoke` removes its own: run `--preset smoke` to keep them).
"""

from lab import startup  # first, before torch imports: Ctrl-C in these first seconds ends the process at once

startup.guard(__name__)

import argparse  # noqa: E402
import json
import os
import re
from pathlib import Path

import torch

import tasks
from checks import is_int, is_num
from generate import generate
from hd import HDConfig, HiddenDecoding
from lab.files import load_checkpoint
from lab.tokens import TokenCaches
from tah import TaHConfig, ThinkAtHard

MAX_TOKENS, MAX_SEED = 100_000, 10**6
MAX_RESULTS_BYTES = 2**28  # results.json: --suite all's is ~1 MB


def readable(path, what, most):
    """`path` is a regular file of at most `most` bytes (never opened otherwise: a FIFO would block
    the reading), or one line naming it and what is wrong."""
    if not path.exists():
        return f"no {what} {path}"
    if not path.is_file():
        return f"the {what} {path} is " + ("a folder" if path.is_dir() else "not a regular file")
    if path.stat().st_size > most:
        return f"the {what} {path} holds {path.stat().st_size:,} bytes, more than any run writes ({most:,})"
    if not os.access(path, os.R_OK):
        return f"the {what} {path} cannot be read (permission denied)"
    return None


MAX_CHECKPOINT_BYTES = 2**32  # far more than any preset's run writes (the default's: a few MB)


def load(kind, ckpt, arm, seed, run_dir):
    """The model `arm` trained for `seed` in run_dir, rebuilt from its checkpoint's own config
    (`kind`: HDConfig or TaHConfig): a regular file of a size a run writes, intact, written for that
    arm, seed and run, its weights the shapes of the model its config builds."""
    if problem := readable(ckpt, "checkpoint", MAX_CHECKPOINT_BYTES):
        raise SystemExit(f"error: {problem}: train first (python train_tiny.py; --smoke keeps none)")
    try:
        state = load_checkpoint(ckpt)
    except OSError as e:
        raise SystemExit(f"error: the checkpoint {ckpt} cannot be read ({e.strerror or e})")
    meta = state.get("meta") if isinstance(state, dict) else None
    want = dict(arm=arm, seed=seed, run=run_dir.name.removeprefix("run-"))
    if not isinstance(meta, dict) or {k: meta.get(k) for k in want} != want or not isinstance(state.get("model"), dict):
        raise SystemExit(f"error: the checkpoint {ckpt} is not {arm!r}, seed {seed}, of {run_dir.name}: it holds "
                         f"{meta if isinstance(meta, dict) else 'no record of its arm'}"[:400])
    try:
        model = {HDConfig: HiddenDecoding, TaHConfig: ThinkAtHard}[kind](kind(**state["config"]))
    except (KeyError, TypeError, ValueError) as e:  # none, another kind's fields, or values its checks refuse
        raise SystemExit(f"error: the checkpoint {ckpt} holds no {kind.__name__} that rebuilds its model "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__}): train anew"[:400])
    have, need = state["model"], model.state_dict()
    wrong = [k for k in need if k not in have or getattr(have[k], "shape", None) != need[k].shape] + \
        [k for k in have if k not in need]
    if wrong:
        k = wrong[0]
        raise SystemExit(f"error: the checkpoint {ckpt} does not fit the run's preset: {k} is "
                         f"{tuple(have[k].shape) if k in have and hasattr(have[k], 'shape') else 'missing'} there, "
                         f"{tuple(need[k].shape) if k in need else 'no weight'} in the model its config builds "
                         f"({len(wrong)} weight(s) differ)")
    model.load_state_dict(have)
    return model.eval()


def hd_text(preset, data, run_dir, out, seed, *, tokens, temperature, top_k):
    """`tokens` new tokens after the held-out text's first 16 (Shakespeare, or the run's --data), the
    context cropped to the model's block (nanoGPT's generate crops it the same way), half a block
    at a time."""
    text = tasks.load_text(data, tuple(preset["plays"]), preset["block"], TokenCaches(out))
    n = max(preset["hd_ns"])
    model = load(HDConfig, run_dir / "ckpt" / f"hd_n_{n}_continued_s{seed}.pt", f"hd/n={n} continued", seed, run_dir)
    if model.cfg.vocab_size != text.vocab_size:
        raise SystemExit(f"error: the HD model's vocabulary ({model.cfg.vocab_size:,}) is not its text's "
                         f"({text.vocab_size:,}): was the run's --data file changed?")
    block = model.cfg.block_size
    ids, g = text.split["val"][None, :16], torch.Generator().manual_seed(seed)
    prompt = len(ids[0])
    while ids.size(1) < prompt + tokens:
        new = min(block // 2, prompt + tokens - ids.size(1))
        ctx = ids[:, -(block - new):]
        more = generate(model, ctx, new, temperature, min(top_k, text.vocab_size), g)[:, ctx.size(1):]
        ids = torch.cat([ids, more], 1)
    return text.decode(ids[0, :prompt]), text.decode(ids[0, prompt:])


@torch.no_grad()
def tah_problem(preset, run_dir, seed):
    """A lookup problem the model has not seen, through the decider-routed model: each query's
    answer (its prediction after the query token) and how many passes each token took."""
    task = tasks.Lookups(preset["symbols"], preset["queries"], preset["two_hop"])
    model = load(TaHConfig, run_dir / "ckpt" / f"tah_TaH_stage_2_decider_s{seed}.pt", "tah/TaH stage 2 (decider)",
                 seed, run_dir)
    idx = task.problems(1, torch.Generator().manual_seed(10**6 + seed))
    out = model(idx, mode="decider")
    lines, names = [], [task.describe(t) for t in idx[0].tolist()]
    for i, (name, passes) in enumerate(zip(names, out.depths[0].tolist())):
        if task.is_query(idx[0, i]):
            said, truth = task.describe(out.logits[0, i].argmax().item()), names[i + 1]
            verdict = "right" if said == truth else f"wrong: {truth}"
            lines.append(f"  {name + '*' * (passes > 1):<6} -> {said}  ({verdict}, {passes} pass{'es' * (passes > 1)})")
    pairs = " ".join(n for n in names if ">" in n)
    return pairs, lines


NEEDS = {  # what sample.py reads of a run's preset: field -> (test, what it must be)
    "block": (lambda v: is_int(v) and v >= 1, "an int >= 1"),
    "hd_ns": (lambda v: isinstance(v, list) and v and all(is_int(n) and n >= 1 for n in v), "a list of ints >= 1"),
    "plays": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of play names"),
    "symbols": (is_int, "an int"), "queries": (is_int, "an int"),
    "two_hop": (lambda v: is_num(v) and 0 <= v <= 1, "a probability")}


def read_run(out):
    """What sample.py reads of a run, from <out>/results.json: the preset's text and task fields
    (NEEDS), the run's folder and its --data; or one line saying why that is no trained run of
    train_tiny.py's to sample from. The models' shapes come from their checkpoints."""
    path = out / "results.json"
    why = f"error: {path} is missing or not the results of a train_tiny.py run: run python train_tiny.py --out {out}"
    if problem := readable(path, "results", MAX_RESULTS_BYTES):
        raise SystemExit(f"{why} ({problem})")
    try:
        results = json.loads(path.read_bytes().decode("utf-8"))
        preset, run, data = results["preset"], results["run"], results["data"]
        if not isinstance(preset, dict):
            raise TypeError("the preset")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise SystemExit(why)
    for k, (test, says) in NEEDS.items():
        if not test(preset.get(k)):
            raise SystemExit(f"{why} (its preset's {k} is {preset.get(k)!r}, not {says})"[:400])
    try:
        tasks.Lookups(preset["symbols"], preset["queries"], preset["two_hop"])
    except ValueError as e:
        raise SystemExit(f"{why} (its lookups: {e})")
    if not (isinstance(run, str) and re.fullmatch(r"run-[0-9a-f]{10}", run) and (out / run).is_dir()):
        raise SystemExit(f"{why} (it names no run folder beside it: {run!r})")
    if data is not None and not isinstance(data, str):
        raise SystemExit(f"{why} (its data is {data!r})")
    if data is not None and (problem := readable(Path(data), "--data file the run trained on", tasks.MAX_DATA_BYTES)):
        raise SystemExit(f"error: {problem}: sample.py reads it again for the vocabulary (put it back, or train anew)")
    return preset, out / run, data


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out", help="the run's folder (train_tiny.py's --out)")
    ap.add_argument("--seed", type=int, default=0, help="whose models: the seed of the run's arms")
    ap.add_argument("--tokens", type=int, default=200, help=f"text tokens to sample, at most {MAX_TOKENS:,}")
    ap.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    ap.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest tokens")
    a = ap.parse_args(argv)
    if not (1 <= a.tokens <= MAX_TOKENS and 0 <= a.seed <= MAX_SEED and a.top_k >= 1 and 0 <= a.temperature < 1e6):
        ap.error(f"--tokens must be in [1, {MAX_TOKENS:,}], --seed in [0, {MAX_SEED:,}], --top_k >= 1 and "
                 "--temperature a number in [0, 1e6)")
    out = Path(a.out)
    preset, run_dir, data = read_run(out)
    torch.manual_seed(a.seed)
    prompt, text = hd_text(preset, data, run_dir, out, a.seed, tokens=a.tokens, temperature=a.temperature, top_k=a.top_k)
    print(f"HD n = {max(preset['hd_ns'])} ({run_dir.name}, seed {a.seed}): {a.tokens} tokens after a held-out prompt of "
          f"16 (up to |):\n\n{prompt}|{text}\n")
    pairs, lines = tah_problem(preset, run_dir, a.seed)
    print(f"TaH under its decider, a new lookup problem: the pairs {pairs}, then each query's answer "
          f"(* = sent on to a second pass):")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
