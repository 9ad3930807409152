"""
The trainer of train_tiny.py: one loop for every arm of every suite.

torchrun's process setup (read once, at import), the batch stream (the batch of step `it` depends
only on (seed, it, split), so resuming and any world size see the same tokens), AdamW or Muon
with warmup and cosine decay, gradient accumulation, DDP by hand (routing lets ranks touch
different parameters), checkpoints that carry their arm and a checksum and resume exactly, the
progress line, and held-out evaluation.
"""

import contextlib
import datetime
import hashlib
import io
import math
import os
import socket
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moe import Transformer
from tasks import atomic


# -----------------------------------------------------------------------------
# Process setup (torchrun): read once, before anything else


def dist_env(env):
    """(ddp, rank, world) from torchrun's variables, with one clear error when they do not fit."""
    if env.get("RANK") is None:
        return False, 0, 1
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise SystemExit(f"error: RANK={env.get('RANK')!r} needs an integer WORLD_SIZE (got "
                         f"{env.get('WORLD_SIZE')!r}); launch with torchrun, or unset RANK")
    if not 0 <= rank < world:
        raise SystemExit(f"error: RANK={rank} is not in [0, WORLD_SIZE={world})")
    missing = [k for k in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise SystemExit(f"error: RANK is set but {', '.join(missing)} not: launch with torchrun, or unset RANK")
    if not env["MASTER_PORT"].isdigit() or not env["LOCAL_RANK"].isdigit():
        raise SystemExit(f"error: MASTER_PORT and LOCAL_RANK must be integers, got {env['MASTER_PORT']!r} and "
                         f"{env['LOCAL_RANK']!r}")
    if not 0 < int(env["MASTER_PORT"]) < 65536:
        raise SystemExit(f"error: MASTER_PORT must be a port in 1..65535, got {env['MASTER_PORT']}")
    return True, rank, world


DDP, RANK, WORLD = dist_env(os.environ)
MASTER = RANK == 0


def start_ddp(args, timeout=60):
    """torchrun's process group (nccl on CUDA, gloo on CPU), or one line saying why not: an
    address that does not resolve, a port in use, no rendezvous within `timeout` seconds."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        socket.getaddrinfo(addr, port)
    except OSError as e:
        raise SystemExit(f"error: MASTER_ADDR={addr!r} does not resolve ({e.strerror or e}); launch with torchrun")
    try:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, ValueError) as e:  # c10d's DistNetworkError and friends
        raise SystemExit(f"error: the DDP process group did not start at {addr}:{port} "
                         f"({str(e).splitlines()[0][:200]}); is the port free, and did every rank start?")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"


def log(*a):
    if MASTER:
        print(*a, flush=True)


# -----------------------------------------------------------------------------
# The trainer: the same loop for every arm


def batch_gen(seed, it, split):
    """The global batch of iteration `it` depends only on (seed, it, split): resuming and any
    world size see the same tokens."""
    return torch.Generator().manual_seed(seed * 1_000_003 + it * 2 + (split != "train"))


class Progress:
    """The whole invocation's progress: the stages it plans to train, in order, as [arm, steps
    left], and the time left, from each arm's own seconds per step (the planning probe's at
    first, then its real steps'), scaled by how much of the time so far went to anything but
    training steps (evaluation, building models). A --jobs process trains one (suite, seed) of
    the run; `run` = (when it started, the parent's prediction of the run's seconds left then,
    the parent's real-over-predicted scale or None) then adds the whole run's time left: that
    prediction counted down, at least this process's own time left. Before anything has
    finished the parent knows no scale, and this process's own pace so far gives it."""

    def __init__(self):
        self.plan, self.rate, self.arm, self.stepping, self.t0, self.run = [], {}, 0, 0.0, time.time(), None

    def start(self, plan, rates, run=None):
        self.planned, self.plan, self.rate = list(plan), [[arm, steps] for arm, steps in plan], dict(rates)
        self.total, self.arm, self.stepping, self.t0 = sum(s for _, s in plan), 0, 0.0, time.time()
        self.probed, self.run = dict(rates), run

    def advance(self, arm, steps=1, seconds=None):
        """`steps` steps of arm done (one, in `seconds`, when timed; a resumed arm's, untimed)."""
        entry = next((p for p in self.plan if p[0] == arm and p[1] > 0), None)
        if entry is not None:
            entry[1] -= steps
        if seconds is not None:
            self.stepping += seconds
            r = self.rate.get(arm)
            self.rate[arm] = seconds if r is None else 0.8 * r + 0.2 * seconds

    def line(self):
        el = time.time() - self.t0
        left_steps = sum(max(s, 0) for _, s in self.plan)
        known = list(self.rate.values()) or [0.0]
        train_left = sum(max(s, 0) * self.rate.get(a, sum(known) / len(known)) for a, s in self.plan)
        left = train_left * (el / self.stepping if self.stepping > 5.0 else 1.0)  # the first seconds: start-up, not pace
        return (f"arm {self.arm}/{len(self.plan)} | {getattr(self, 'total', 0) - left_steps}/{getattr(self, 'total', 0)} "
                f"steps | elapsed {el / 60:.1f} min" + (f" | ~{left / 60:.1f} min left" if self.rate and self.run else "")
                + self.run_left(el, left))

    def run_left(self, el, left):
        """' | run ~M min left': in one process its own time left (the process is the run); in a
        --jobs process (after its own) the run's prediction, scaled as said."""
        if self.run is None:
            return f" | run ~{left / 60:.1f} min left" if self.rate else ""
        start, predicted, scale = self.run
        if scale is None:  # nothing has finished yet: this process's own pace so far scales the prediction
            done = sum((steps - max(s, 0)) * self.probed.get(a, 0.0) for (a, steps), (_, s) in zip(self.planned, self.plan))
            predicted *= el / done if done > 0 else 1.0
        return f" | run ~{max(left, start + predicted - time.time()) / 60:.1f} min left"


PROGRESS = Progress()
PROBE_STEPS = 4  # steps each stage runs in the planning probe (the first one, a warm-up, is not timed)


def backbone_of(model):
    return model if isinstance(model, Transformer) else model.backbone


def make_optimizer(model, lr, muon):
    params = [p for p in model.parameters() if p.requires_grad]
    if muon:  # Muon for 2-D weight matrices inside the blocks; AdamW for the rest (either may have none:
        # TaH's stage 2 trains only the decider, outside the blocks)
        mats = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2 and ".blocks." in f".{n}"]
        ids = {id(p) for p in mats}
        rest = [p for p in params if id(p) not in ids]
        return ([torch.optim.Muon(mats, lr=lr, adjust_lr_fn="match_rms_adamw")] if mats else []) + \
            ([torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)] if rest else [])
    decay = [p for p in params if p.ndim >= 2]
    other = [p for p in params if p.ndim < 2]
    return [torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                              lr=lr, betas=(0.9, 0.95), fused=True)]  # fused: one kernel per step


def lr_at(it, P):
    if it < P.warmup:
        return P.lr * (it + 1) / P.warmup
    frac = (it - P.warmup) / max(1, P.iters - P.warmup)
    return P.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train(name, model, loss_fn, data, P, args, seed, on_step=None, first_batch=0):
    """Train `model` for P.iters steps with loss_fn(model, x, y) on the batches of steps
    first_batch, first_batch + 1, ... of the seed's stream (a later stage passes the steps
    run before it, so it sees new batches); checkpoint every args.ckpt_every steps
    (atomically) and resume from the checkpoint if one exists. Returns the list of training
    losses (one per step). In the planning probe (args.probe) it runs PROBE_STEPS steps, saves
    nothing, and records the stage's planned steps and its seconds per step."""
    probe = getattr(args, "probe", None)
    ckpt = Path(args.run_dir) / "ckpt" / f"{name.replace('/', '_')}_s{seed}.pt"
    opts = make_optimizer(model, P.lr, args.muon)
    meta = dict(arm=name, seed=seed, iters=P.iters, run=getattr(args, "run_key", None))
    start, losses = (0, []) if probe is not None else resume(ckpt, model, opts, args.device, meta)
    step = Step(name, model, loss_fn, data, P, args, seed, opts)
    if probe is None:
        announce(name, seed, P, start)
    t0, times = time.perf_counter(), []
    for it in range(start, min(P.iters, PROBE_STEPS) if probe is not None else P.iters):
        t = time.perf_counter()
        losses.append(step(first_batch + it, it, rehearsing=it == start))
        times.append(time.perf_counter() - t)
        if probe is not None:
            continue
        PROGRESS.advance(name, 1, times[-1] if it > start else None)  # a stage's first step warms up: untimed
        done = it + 1
        if done % args.log_every == 0 or done == P.iters:
            log_step(name, seed, done, P, losses[-1], (time.perf_counter() - t0) / (done - start), model, args.device)
        if done % args.ckpt_every == 0 or done == P.iters:
            checkpoint(ckpt, name, seed, done, model, opts, losses, meta)
        if on_step is not None:
            on_step(done)
    if probe is not None:  # the planning probe: this stage's planned steps and its time per step
        probe.append((name, P.iters, float(np.median(times[1:])) if len(times) > 1 else None))
    return losses


def announce(name, seed, P, start):
    """The stage's first line; a resumed stage's steps count as done in the progress."""
    if 0 < start < P.iters:
        log(f"[{name} s{seed}] resuming at step {start}")
    PROGRESS.arm += 1
    PROGRESS.advance(name, start)
    log(f"[{name} s{seed}] {P.iters} steps, lr {P.lr:g}, batch {P.batch} | {PROGRESS.line()}")


class Step:
    """One optimizer step of a stage: the learning rate of step `it`, the global batch of stream
    step `batch_it` split into this rank's micro-batches, gradients averaged over ranks and
    clipped, the optimizers' step, loss-free balancing's bias update. Returns the step's loss."""

    def __init__(self, name, model, loss_fn, data, P, args, seed, opts):
        self.name, self.model, self.loss_fn, self.data, self.P, self.args = name, model, loss_fn, data, P, args
        self.seed, self.opts = seed, opts
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.micro = P.batch // (WORLD * args.accum)
        if self.micro < 1 or P.batch % (WORLD * args.accum):
            raise SystemExit(f"error: batch {P.batch} does not split into {WORLD} ranks x {args.accum} micro-steps")
        self.rehearse = getattr(args, "rehearse", False)
        dev = args.device
        self.autocast = (torch.autocast("cuda", torch.bfloat16) if dev.startswith("cuda") else
                         torch.autocast("cpu", torch.bfloat16) if self.rehearse else contextlib.nullcontext())
        self.fwd_model = torch.compile(model) if getattr(args, "compile", False) else model  # shares the weights

    def __call__(self, batch_it, it, rehearsing):
        P, args = self.P, self.args
        for o in self.opts:
            for g in o.param_groups:
                g["lr"] = lr_at(it, P)
        x, y = self.data.batch("train", P.batch, P.block, batch_gen(self.seed, batch_it, "train"))
        total = sum(self.micro_step(x, y, m, rehearsing and m == 0) for m in range(args.accum))
        if DDP:
            total = average_over_ranks(self.params, total, args.device)
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        for o in self.opts:
            o.step()
            o.zero_grad(set_to_none=True)
        if any(p.requires_grad for p in backbone_of(self.model).parameters()):
            backbone_of(self.model).update_router_bias()  # loss-free balancing, after the step
        if not math.isfinite(total):
            raise SystemExit(f"error: [{self.name} s{self.seed}] loss is {total} at step {it + 1}; nothing after it "
                             f"is reported (try a lower lr)")
        return total

    def micro_step(self, x, y, m, measure):
        """Forward and backward of this rank's rows of micro-step m; a rehearsal measures the
        first one's activation memory."""
        lo, dev = (m * WORLD + RANK) * self.micro, self.args.device  # this rank's rows of the global batch
        saved = {}  # storage -> bytes of what autograd keeps for backward (measured in a rehearsal)
        with self.autocast, counting_saved(saved) if self.rehearse and measure else contextlib.nullcontext():
            loss = self.loss_fn(self.fwd_model, x[lo:lo + self.micro].to(dev), y[lo:lo + self.micro].to(dev))
            loss = loss / self.args.accum
        if saved:
            n_all, n_trained = (sum(p.numel() for p in ps) / 1e6 for ps in (self.model.parameters(), self.params))
            log(f"[{self.name} s{self.seed}] rehearsal: {n_all:.2f}M parameters ({n_trained:.2f}M trained); "
                f"~{sum(saved.values()) / 2**20:.0f} MiB of activations kept for backward per micro-batch of "
                f"{self.micro} x {self.P.block} tokens (bf16)")
        loss.backward()
        return loss.item()


def checkpoint(ckpt, name, seed, done, model, opts, losses, meta):
    """Save after step `done`, refusing non-finite weights (a finite loss can still leave them)."""
    if not all(torch.isfinite(p).all() for p in model.parameters() if p.requires_grad):
        raise SystemExit(f"error: [{name} s{seed}] the weights are not finite after step {done}; nothing "
                         f"of this arm is saved or reported (try a lower lr)")
    if MASTER:
        save(ckpt, model, opts, done, losses, meta)


@contextlib.contextmanager
def counting_saved(saved):
    """Record the storages autograd keeps for backward (parameters excluded): the activation
    memory of a step, as a rehearsal reports it."""
    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def loss_curves(run_dir):
    """(suite, arm) -> per-seed training losses, from the checkpoints' own record."""
    curves = {}
    for f in sorted((run_dir / "ckpt").glob("*.pt")):
        state = load_checkpoint(f)
        suite, arm = state["meta"]["arm"].split("/", 1)
        curves.setdefault((suite, arm), []).append(state["losses"])
    return curves


def load_checkpoint(ckpt, dev="cpu"):
    """A checkpoint's state, after checking the sha256 of its bytes (written by save)."""
    raw = ckpt.read_bytes()
    digest, payload = raw[:64], raw[65:]
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise SystemExit(f"error: checkpoint {ckpt} is damaged (its checksum does not match its contents); "
                         f"delete it to train this arm again, or run with --fresh")
    try:
        return torch.load(io.BytesIO(payload), map_location=dev, weights_only=False)
    except Exception as e:
        raise SystemExit(f"error: checkpoint {ckpt} cannot be read ({type(e).__name__}); delete it to train "
                         f"this arm again, or run with --fresh")


def resume(ckpt, model, opts, dev, meta):
    """Load a checkpoint into model and optimizers if one exists: (first step, losses so far).
    It must be this arm's (meta: arm, seed, planned steps), intact and finite."""
    if not ckpt.exists():
        return 0, []
    state = load_checkpoint(ckpt, dev)
    fix = "delete it to train this arm again, or run with --fresh"
    if state.get("meta") != meta or not 0 < state.get("iter", 0) <= meta["iters"]:
        raise SystemExit(f"error: checkpoint {ckpt} holds {state.get('meta')} at step {state.get('iter')}, "
                         f"not {meta}; {fix}")
    try:
        model.load_state_dict(state["model"])
        for o, s in zip(opts, state["opts"]):
            o.load_state_dict(s)
    except Exception as e:
        raise SystemExit(f"error: checkpoint {ckpt} cannot be resumed ({type(e).__name__}); {fix}")
    if not all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point()):
        raise SystemExit(f"error: checkpoint {ckpt} holds non-finite weights; {fix}")
    return state["iter"], state["losses"]


def save(ckpt, model, opts, done, losses, meta):
    """Atomically: the state and what it belongs to (meta), after the sha256 of its bytes."""
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opts": [o.state_dict() for o in opts], "iter": done,
                "losses": losses, "meta": meta}, buf)
    payload = buf.getvalue()
    atomic(ckpt, lambda f: f.write(hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload))


def average_over_ranks(params, total, dev):
    """Average gradients and the loss over DDP ranks by hand: with routing (MoE, TaH depths) the
    set of parameters that receive a gradient can differ between ranks, which DDP's hooks do
    not allow. A parameter no rank has a gradient for keeps none, as in one process: the
    optimizer then skips it (a zero gradient would still move it through weight decay)."""
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=dev)
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    for p, any_rank in zip(params, has.tolist()):
        if not any_rank:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    t = torch.tensor(total, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t.item()


def log_step(name, seed, done, P, loss, dt, model, dev):
    tok = P.batch * P.block / dt
    mfu = ""
    if dev.startswith("cuda"):  # model FLOPs per token (as nanoGPT's estimate_mfu), vs 989 TFLOP/s bf16 (H100/H200)
        mfu = f" | mfu {flops_per_token(model, P.block) * tok / 989e12:.2%}"
    log(f"[{name} s{seed}] step {done}/{P.iters} | loss {loss:.4f} | {dt * 1e3:.0f} ms/step | "
        f"{tok / 1e3:.1f}k tok/s{mfu} | {PROGRESS.line()}")


def flops_per_token(model, T):
    """Training FLOPs per input token (forward + backward = 3x forward), counting what runs:
    6 per weight a row passes through (only top_k of the routed experts, not the embedding
    lookups), plus attention's 12 * layers * heads * head_dim * (keys seen ~ rows / 2), times
    the rows a token becomes (HD: n streams; TaH: one pass, depth >= 1 not counted)."""
    body = backbone_of(model)
    cfg = body.cfg
    n = getattr(cfg, "n_streams", 1)
    per_row = 0
    for name, p in body.named_parameters():
        if "wte" in name or p.ndim < 2:
            continue
        share = cfg.top_k / cfg.n_experts if name.endswith(("w_gate_up", "w_down")) else 1.0
        per_row += share * p.numel()
    attention = 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * (n * T) / 2
    return n * (6 * per_row + attention)


def probing(args):
    """Whether this is the planning probe (train_tiny.planned): every evaluation one batch."""
    return getattr(args, "probe", None) is not None


@torch.no_grad()
def evaluate(model, data, P, args, fwd=None):
    """Held-out loss and accuracy of the next-token prediction over the whole split (the dev set
    with --dev) in non-overlapping windows of P.block tokens: every target exactly once, the
    same for every arm and seed. fwd(model, x, y) -> (logits, loss)."""
    model.eval()
    fwd = fwd or (lambda m, x, y: m(x, y)[:2])
    xs, ys = data.windows(args.eval_split, P.block)
    total, hits, count = 0.0, 0, 0
    starts = range(0, len(xs), P.batch)
    for i in starts[:1] if probing(args) else starts:
        x, y = xs[i:i + P.batch].to(args.device), ys[i:i + P.batch].to(args.device)
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
