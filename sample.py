"""
Sample from what the main job trained (nanoGPT's sample.py, for both papers):

- text from the largest HD model (n = 4) continued on Shakespeare, decoded with its KV caches
  (generate.generate: each new token enters as its 4 stream rows);
- one held-out lookup problem answered by the TaH model under its decider, each token's
  passes shown: a query the decider sent on to a second pass is marked *.

    python train_tiny.py && python sample.py         # the default run's seed 0, from out/
    python sample.py --seed 2 --tokens 300 --temperature 0.8 --top_k 50

It reads the run's results.json (the preset and the run's folder) and the checkpoints kept there
(`--smoke` removes its own: run `--preset smoke` to keep them).
"""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch

import headline
import tasks
import trainer
from generate import generate
from hd import HDConfig, HiddenDecoding
from tah import ThinkAtHard


def load(cls, cfg, ckpt):
    if not ckpt.exists():
        raise SystemExit(f"error: no checkpoint {ckpt}: train first (python train_tiny.py; --smoke keeps none)")
    model = cls(cfg)
    model.load_state_dict(trainer.load_checkpoint(ckpt)["model"])
    return model.eval()


def hd_text(P, data, run_dir, out, seed, tokens, temperature, top_k):
    """`tokens` new tokens after the held-out text's first 16 (Shakespeare, or the run's --data), the
    context cropped to the model's block (nanoGPT's generate crops it the same way), half a block
    at a time."""
    text = tasks.load_text(data, tuple(P.plays), P.block, out)
    n = max(P.hd_ns)
    cfg = HDConfig(**headline.backbone_cfg(P, text.vocab_size, layout=P.layout, window=P.window, n_streams=n))
    model = load(HiddenDecoding, cfg, run_dir / "ckpt" / f"hd_n_{n}_continued_s{seed}.pt")
    ids, g = text.split["val"][None, :16], torch.Generator().manual_seed(seed)
    prompt = len(ids[0])
    while ids.size(1) < prompt + tokens:
        new = min(P.block // 2, prompt + tokens - ids.size(1))
        ctx = ids[:, -(P.block - new):]
        more = generate(model, ctx, new, temperature, min(top_k, text.vocab_size), g)[:, ctx.size(1):]
        ids = torch.cat([ids, more], 1)
    return text.decode(ids[0, :prompt]), text.decode(ids[0, prompt:])


@torch.no_grad()
def tah_problem(P, run_dir, seed):
    """A lookup problem the model has not seen, through the decider-routed model: each query's
    answer (its prediction after the query token) and how many passes each token took."""
    task = tasks.Lookups(P.symbols, P.queries, P.two_hop)
    model = load(ThinkAtHard, headline.tah_config(P, task, P.tah_layers),
                 run_dir / "ckpt" / f"tah_TaH_stage_2_decider_s{seed}.pt")
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out", help="the run's folder (train_tiny.py's --out)")
    ap.add_argument("--seed", type=int, default=0, help="whose models: the seed of the run's arms")
    ap.add_argument("--tokens", type=int, default=200, help="text tokens to sample")
    ap.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    ap.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest tokens")
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.temperature < 0 or a.top_k < 1 or a.seed < 0:
        ap.error("--tokens and --top_k must be >= 1, --temperature and --seed >= 0")
    out = Path(a.out)
    try:
        results = json.loads((out / "results.json").read_text())
        P, run_dir = SimpleNamespace(**results["preset"]), out / results["run"]
    except (OSError, ValueError, KeyError):
        raise SystemExit(f"error: {out / 'results.json'} is missing or not a run's results: run python "
                         f"train_tiny.py --out {out} first")
    torch.manual_seed(a.seed)
    prompt, text = hd_text(P, results.get("data"), run_dir, out, a.seed, a.tokens, a.temperature, a.top_k)
    print(f"HD n = {max(P.hd_ns)} ({run_dir.name}, seed {a.seed}): {a.tokens} tokens after a held-out prompt of 16 (up to |):"
          f"\n\n{prompt}|{text}\n")
    pairs, lines = tah_problem(P, run_dir, a.seed)
    print(f"TaH under its decider, a new lookup problem: the pairs {pairs}, then each query's answer "
          f"(* = sent on to a second pass):")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
