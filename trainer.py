"""
The trainer of train_tiny.py: one loop for every arm of every suite.

A stage's budget (Stage), the batch stream (step `it`'s batch depends only on (seed, it, split):
resuming and any world size see the same tokens), AdamW or Muon with warmup and cosine decay,
gradient accumulation and torchrun's ranks, a checkpoint every few steps (lab/files.py: a killed
run resumes exactly), held-out evaluation. Context is what every protocol and the loop read of
the run around them; the processes, the folder and the command line are lab/runner.py's.
"""

import contextlib
import math
import os
import time
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from moe import Transformer


@dataclass(frozen=True)
class Context:
    """What the experiments and the loop read of the run around them (made once, by lab/runner.py)."""
    run_dir: Path  # <out>/run-<key>: checkpoints, finished rows, the analyses kept with the run
    run_key: Optional[str] = None  # the configuration's key, carried by every checkpoint
    device: str = "cpu"
    seeds: range = range(1)
    eval_split: str = "val"  # "dev" with --dev: the split the results are evaluated on
    eval_seed: int = 7919  # the seed of the synthetic tasks' held-out batches (--dev: another)
    ablations: bool = False  # each suite's extra arms too (--suite all, --smoke: lab/ablations.py)
    muon: bool = False
    accum: int = 1  # gradient accumulation micro-steps
    compile: bool = False
    log_every: int = 50
    ckpt_every: int = 50
    checkpoints: object = None  # a stage's save and resume (lab/files.py, given by lab/runner.py); None: none kept
    keep: object = None  # keep(ctx, name, text, picture): a first seed's analysis kept with the run (lab/files.py)
    flops: object = None  # flops(model, T, stage2=False): a step's FLOPs per token (lab/flops.py's per_token), CUDA's MFU


@dataclass(frozen=True)
class Stage:
    """One stage: steps, peak learning rate, warm-up steps (then cosine to a tenth), and the global
    batch of `batch` sequences of `block` tokens. `scaled`: the names of parameters that train at
    `scale` x the rate (the ones an arm adds to the model it grows from; none by default)."""
    steps: int
    lr: float
    _: KW_ONLY
    warmup: int
    batch: int
    block: int
    scaled: tuple = ()
    scale: float = 1.0


def rank_world():
    """(this process's rank, the world size): torchrun's, once its process group is up."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def log(*a):
    """A line of the run's log, printed once: by rank 0 under torchrun (before its process group
    is up, the RANK torchrun gives)."""
    if (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK") or 0)) == 0:
        print(*a, flush=True)


# -----------------------------------------------------------------------------
# The trainer: the same loop for every arm


def batch_gen(seed, it, split):
    """The global batch of iteration `it` depends only on (seed, it, split): resuming and any
    world size see the same tokens."""
    return torch.Generator().manual_seed(seed * 1_000_003 + it * 2 + (split != "train"))


def backbone_of(model):
    return model if isinstance(model, Transformer) else model.backbone


def make_optimizer(model, lr, muon, scaled=(), scale=1.0):
    """AdamW (weight decay on the matrices), or with `muon` Muon for the blocks' matrices and AdamW
    for the rest; the parameters named in `scaled` in AdamW groups of their own at `scale` x lr
    (a group's "scale", which lr_at's rate is multiplied by every step)."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if missing := [n for n in scaled if n not in named]:
        raise ValueError(f"a stage scales parameters the model does not train: {missing[:3]}")
    fast = set(scaled)
    if muon:  # Muon for 2-D weight matrices inside the blocks; AdamW for the rest (either may have none:
        # TaH's stage 2 trains only the decider, outside the blocks)
        mats = [p for n, p in named.items() if p.ndim == 2 and ".blocks." in f".{n}" and n not in fast]
        ids = {id(p) for p in mats}
        rest = [{"params": [p for n, p in named.items() if id(p) not in ids and (n in fast) == f],
                 "scale": scale if f else 1.0} for f in (False, True)]
        rest = [g for g in rest if g["params"]]
        return ([torch.optim.Muon(mats, lr=lr, adjust_lr_fn="match_rms_adamw")] if mats else []) + \
            ([torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)] if rest else [])
    groups = [{"params": [p for n, p in named.items() if (n in fast) == f and (p.ndim >= 2) == d],
               "weight_decay": 0.1 if d else 0.0, "scale": scale if f else 1.0} for f in (False, True) for d in (True, False)]
    return [torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95), fused=True)]  # fused: one kernel


def lr_at(it, stage):
    if it < stage.warmup:
        return stage.lr * (it + 1) / stage.warmup
    frac = (it - stage.warmup) / max(1, stage.steps - stage.warmup)
    return stage.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train(name, model, loss_fn, data, stage, *, ctx, seed, on_step=None, first_batch=0):
    """Train `model` for stage.steps steps of loss_fn(model, x, y) on the seed's batches from step
    first_batch on (a later stage passes the steps before it), checkpointing every
    ctx.ckpt_every steps and resuming from a checkpoint. Returns the losses, one per step."""
    keep = ctx.checkpoints
    ckpt = keep and keep.checkpoint_path(ctx, name, seed)
    opts = make_optimizer(model, stage.lr, ctx.muon, stage.scaled, stage.scale)
    meta = dict(arm=name, seed=seed, iters=stage.steps, run=ctx.run_key)
    start, losses = keep.resume(ckpt, model, opts, ctx.device, meta) if keep else (0, [])
    step = MicroSteps(model, loss_fn, ctx, stage=stage, label=f"{name} s{seed}")
    if 0 < start < stage.steps:
        log(f"[{name} s{seed}] resuming at step {start}")
    log(f"[{name} s{seed}] {stage.steps} steps, lr {stage.lr:g}, batch {stage.batch}")
    if ctx.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(ctx.device)  # each stage's line gives its own peak
    t0 = time.perf_counter()
    for it in range(start, stage.steps):
        for o in opts:  # the learning rate of step it
            for g in o.param_groups:
                g["lr"] = lr_at(it, stage) * g.get("scale", 1.0)
        if keep and it > start and it % ctx.ckpt_every == 0:  # the state after `it` steps
            finite_weights(model, meta, it)
            keep.save_checkpoint(ckpt, model, opts, it, losses, meta)
        x, y = data.batch("train", stage.batch, stage.block, batch_gen(seed, first_batch + it, "train"))
        losses.append(step(x, y))  # forward and backward, summed over ranks
        torch.nn.utils.clip_grad_norm_(step.params, 1.0)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        if step.trains_backbone:
            backbone_of(model).update_router_bias()  # loss-free balancing, after the step
        step.check_finite(losses[-1], it)
        if (it + 1) % ctx.log_every == 0 or it + 1 == stage.steps:
            log_step(step.label, it + 1, stage, losses[-1], (time.perf_counter() - t0) / (it + 1 - start), model, ctx)
        if on_step is not None:
            on_step(it + 1)
    if start < stage.steps:
        finite_weights(model, meta, stage.steps)
        if keep:
            keep.save_checkpoint(ckpt, model, opts, stage.steps, losses, meta)
    return losses


def finite_weights(model, meta, done):
    """The weights after step `done` are finite, or one line and the run stops (a finite loss can
    still leave them otherwise): a stage's result, like its checkpoints, holds finite weights only."""
    if not all(torch.isfinite(p).all() for p in model.parameters() if p.requires_grad):
        raise SystemExit(f"error: [{meta['arm']} s{meta['seed']}] the weights are not finite after step {done}; "
                         f"nothing of this arm is saved or reported (try a lower lr)")


class MicroSteps:
    """One step's forward and backward: the global batch cut into world x accum pieces, each
    piece's mean loss weighted by its share of the rows, gradients summed over ranks: the global
    batch's mean loss at any world size. Returns the step's loss."""

    def __init__(self, model, loss_fn, ctx, *, stage, label):
        self.loss_fn, self.ctx, self.stage, self.label = loss_fn, ctx, stage, label
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.trains_backbone = any(p.requires_grad for p in backbone_of(model).parameters())
        self.rank, self.world = rank_world()
        if stage.batch < self.world * ctx.accum:
            raise SystemExit(f"error: batch {stage.batch} has fewer rows than {self.world} ranks x {ctx.accum} "
                             f"micro-steps")
        self.autocast = (torch.autocast("cuda", torch.bfloat16) if ctx.device.startswith("cuda") else
                         contextlib.nullcontext())
        self.fwd_model = compiled(model) if ctx.compile else model  # shares the weights

    def __call__(self, x, y):
        total = sum(self.micro_step(x, y, m) for m in range(self.ctx.accum))
        return sum_over_ranks(self.params, total, self.ctx.device) if self.world > 1 else total

    def check_finite(self, loss, it):
        if not math.isfinite(loss):
            raise SystemExit(f"error: [{self.label}] loss is {loss} at step {it + 1}; nothing after it "
                             f"is reported (try a lower lr)")

    def micro_step(self, x, y, m):
        """Forward and backward of this rank's rows of micro-step m."""
        B, dev, pieces = self.stage.batch, self.ctx.device, self.world * self.ctx.accum
        lo, hi = batch_piece(m * self.world + self.rank, pieces, B)  # this rank's rows of the global batch
        x, y = x[lo:hi], y[lo:hi]
        if dev.startswith("cuda"):  # from pinned memory, so the copy does not wait on the host
            x, y = x.pin_memory(), y.pin_memory()
        with self.autocast:
            loss = self.loss_fn(self.fwd_model, x.to(dev, non_blocking=True), y.to(dev, non_blocking=True))
            loss = loss / (B / (hi - lo))  # its share of the batch: / accum x world for an even cut
        loss.backward()
        return loss.item()


def batch_piece(j, pieces, batch):
    """Rows [lo, hi) of piece j when `batch` rows are cut into `pieces` as evenly as it goes."""
    return j * batch // pieces, (j + 1) * batch // pieces


def sum_over_ranks(params, total, dev):
    """Gradients and the loss summed over ranks by hand: with routing (MoE, TaH) the parameters
    that get a gradient can differ between ranks, which DDP's hooks do not allow. A parameter no
    rank has a gradient for keeps none, as in one process (a zero would still move it through
    weight decay)."""
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=dev)
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    for p, any_rank in zip(params, has.tolist()):
        if not any_rank:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    t = torch.tensor(total, device=dev)
    dist.all_reduce(t)
    return t.item()


def compiled(model):
    """--compile: a model whole (fullgraph, static shapes: the backbone, HD, a loop of it); TaH per
    pass (compile_passes), since the loop between its passes reads the decider's choices."""
    if not hasattr(model, "compile_passes"):
        return torch.compile(model, fullgraph=True, dynamic=False)
    return model.compile_passes(True)


def log_step(label, done, stage, loss, dt, model, ctx):
    """A step's line: loss, time and tokens per step, on CUDA MFU (with ctx.flops) and peak memory,
    the stage's time left."""
    tok, dev = stage.batch * stage.block / dt, ctx.device
    mfu = ""
    if dev.startswith("cuda") and ctx.flops is not None:  # model FLOPs (as nanoGPT's estimate_mfu), vs 989 TFLOP/s bf16
        tah = hasattr(model.cfg, "max_depth")  # TaH: its passes vary by token; stage 2 trains the decider alone
        stage2 = tah and not any(p.requires_grad for p in backbone_of(model).parameters())
        per_token = ctx.flops(model, stage.block, stage2=True) if stage2 else ctx.flops(model, stage.block)
        mfu = f" | mfu {per_token * tok / 989e12:.2%}" + (" (stage 2: the decider)" if stage2 else " (pass 1 alone)"
                                                          if tah else "")
    if dev.startswith("cuda"):
        mfu += f" | peak memory {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB"
    log(f"[{label}] step {done}/{stage.steps} | loss {loss:.4f} | {dt * 1e3:.0f} ms/step | "
        f"{tok / 1e3:.1f}k tok/s{mfu} | stage ~{(stage.steps - done) * dt / 60:.1f} min left")


@torch.no_grad()
def evaluate(model, data, preset, ctx, fwd=None):
    """Held-out loss and accuracy over the whole split (dev with --dev) in windows of preset.block
    tokens, preset.batch at a time: every target once, the same for every arm. fwd(model, x, y) ->
    (logits, loss)."""
    model.eval()
    fwd = fwd or (lambda m, x, y: m(x, y)[:2])
    xs, ys = data.windows(ctx.eval_split, preset.block)
    total, hits, count = 0.0, 0, 0
    starts = range(0, len(xs), preset.batch)
    for i in starts:
        x, y = xs[i:i + preset.batch].to(ctx.device), ys[i:i + preset.batch].to(ctx.device)
        logits, loss = fwd(model, x, y)
        keep = y != -1
        n = keep.sum().item()
        total += loss.item() * n  # the batch's mean over its targets, back to a sum
        hits += (logits.argmax(-1)[keep] == y[keep]).sum().item()
        count += n
    model.train()
    return finite_loss({"loss": total / count, "acc": hits / count})


def finite_loss(r):
    """An evaluation whose loss is not finite stops the run, as non-finite weights do."""
    if not math.isfinite(r["loss"]):
        raise SystemExit(f"error: a held-out loss is {r['loss']}: the model's outputs are not finite; nothing of "
                         "this arm is reported (try a lower lr)")
    return r


if __name__ == "__main__":
    from checks import not_a_script
    not_a_script("trainer.py", "python train_tiny.py")
