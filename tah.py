"""
Think-at-Hard (TaH): selective latent iterations with duo-causal attention.

Follows "Think-at-Hard: Selective Latent Iterations to Improve Reasoning Language Models"
(Fu et al., arXiv 2511.08577, §4 and App. A), with details from the authors' released code
(github.com/thu-nics/TaH) where the paper leaves them open. Built on moe.py (dense or MoE
backbone): the blocks run unchanged.

Depths are 0-based here (the paper's d = 1 is depth 0). Token i runs D_i passes, depths
0 .. D_i - 1; its state at depth d is (i, d). What a reader is shown (figures, demos, the
README) counts passes from 1: pass p is depth p - 1, and "i.p" is token i in pass p.

- Duo-causal attention (§4.1, Eq. 5): query (i, d) sees key (j, k) iff j <= i and k <= d, and
  the key exists only if token j reached depth k (k < D_j). RoPE position of (i, d) is i. The
  K/V of all depths are concatenated, so depth d of every token runs in parallel.
- Depth-wise forward: depth 0 runs every token; depth d >= 1 runs only the tokens that go on,
  gathered (left-packed per row), with one LoRA adapter switched on (§4.2, Eq. 6). Each pass
  compiles whole (compile_passes); the loop between passes cannot, as its shapes are the decider's.
- Next-iteration input: softmax over the top-k (100) of the running summed logits, times the
  matching embedding rows (Eq. 4). Output logits: the sum over the depths a token ran.
- Iteration decider: an MLP on hidden states of a few layers and the top-k logit values;
  continue iff sigmoid > threshold and depth < max_depth.
- Oracle labels (Eq. 7, App. A.2.1) and the stage-1 and stage-2 losses (§4.3).

Decoding (the decider sets each token's depth as it is generated) lives in generate.py.

Run `python tah.py` for a small demo: the duo-causal mask drawn and the four routing modes.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from checks import check_length, check_oracle, check_routing, check_stage2, demo_args
from moe import LayerPlan, ModelConfig, Positions, Transformer, upcast

MODES = ("standard", "always", "oracle", "decider")

# -----------------------------------------------------------------------------
# Config


@dataclass
class TaHConfig(ModelConfig):
    """The backbone's fields (moe.ModelConfig) plus:

    max_depth:      most passes a token may run (the paper's d_max; 2 in all its recipes).
    lora_rank, lora_alpha: rank r and scale numerator of the LoRA adapter at depth >= 1 (alpha / r * B A x).
    logit_topk:     logits kept for the next-iteration input and the decider (paper: 100); not
                    the MoE's top_k (routed experts per token).
    threshold:      decider continues a token iff sigmoid(score) > threshold (paper: 0.9).
    decider_layers: hidden states that feed the decider, indexed as the authors' code does
                    (Hugging Face's output_hidden_states): 0 the pass's input (the embedding at
                    depth 0), l < n_layer block l - 1's output, n_layer the last block's after the
                    final norm; () = (0, n_layer // 2, n_layer), duplicates dropped.
    decider_hidden: width of the decider MLP.
    attention:      "duo" (Eq. 5), or the ablations "first_depth" (every depth reads depth-0
                    keys only, the paper's Table 2 alternative) and "depth_local" (each depth
                    reads keys of its own depth only, Eq. 3 of recurrent transformers).
    gather:         True runs depth d >= 1 on gathered tokens only; False computes every token
                    at every depth and masks (the reference the gathered path must equal).
    attn_impl:      "dense" (SDPA with a boolean mask, any device) or "flex" (a BlockMask from
                    the same mask_mod; on CPU forward only).
    """

    max_depth: int = 2
    lora_rank: int = 8
    lora_alpha: float = 16.0
    logit_topk: int = 100
    threshold: float = 0.9
    decider_layers: tuple = ()
    decider_hidden: int = 64
    attention: str = "duo"
    gather: bool = True
    attn_impl: str = "dense"

    @property
    def decider_states(self):
        """decider_layers, or its default (resolved here, not written back: the config replaces as any dataclass)."""
        return tuple(self.decider_layers) or tuple(dict.fromkeys((0, self.n_layer // 2, self.n_layer)))


# -----------------------------------------------------------------------------
# The mask: one mask_mod reading (position, depth) lookup tensors


def duo_causal(q_pos, q_depth, kv_pos, kv_depth, kv_valid, attention="duo"):
    """mask_mod over packed rows: query row q of batch b is state (q_pos[b,q], q_depth[b,q]),
    key row kv is (kv_pos[b,kv], kv_depth[b,kv]) and exists iff kv_valid[b,kv].

    The lookups are tensors, so flex_attention compiles once for every depth pattern.
    """
    def depth_rule(qd, kd):
        if attention == "duo":
            return kd <= qd  # Eq. 5: every shallower-or-equal depth
        if attention == "first_depth":
            return kd == 0
        return kd == qd  # depth_local

    def mask_mod(b, h, q_idx, kv_idx):
        return ((kv_pos[b, kv_idx] <= q_pos[b, q_idx])
                & depth_rule(q_depth[b, q_idx], kv_depth[b, kv_idx]) & kv_valid[b, kv_idx])
    return mask_mod


def dense_batch_mask(mask_mod, B, Tq, Tk, device):
    """(B, 1, Tq, Tk) boolean mask: the mask_mod evaluated on every (b, q, kv)."""
    b = torch.arange(B, device=device)[:, None, None]
    q = torch.arange(Tq, device=device)[None, :, None]
    kv = torch.arange(Tk, device=device)[None, None, :]
    return mask_mod(b, 0, q, kv)[:, None]


# -----------------------------------------------------------------------------
# LoRA (one adapter, shared by every depth >= 1)


class LoRALinear(nn.Module):
    """y = W x + (alpha / r) * B A x, the second term only while `active`. B starts at 0, so
    the adapter starts as a no-op (Hu et al. 2022)."""

    def __init__(self, base: nn.Linear, rank, alpha):
        super().__init__()
        self.base = base
        self.A = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.B = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank
        self.active = False
        self.merged = None  # W + (alpha / r) B A while decoding, one matmul (generate.lora_merged)

    def forward(self, x):
        if not self.active:
            return self.base(x)
        if self.merged is not None:
            return F.linear(x, self.merged, self.base.bias)
        return self.base(x) + self.scale * F.linear(F.linear(x, self.A), self.B)


def add_lora(module, rank, alpha):
    """Wrap every nn.Linear inside module (attention, gate, SwiGLU MLPs and the shared expert;
    the MoE router and the stacked routed experts stay as they are)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and name != "router":
            setattr(module, name, LoRALinear(child, rank, alpha))
        else:
            add_lora(child, rank, alpha)


# -----------------------------------------------------------------------------
# Iteration decider


@dataclass
class DeciderInput:
    """What the decider reads about each state (§4.2): the hidden states cfg.decider_states
    names (see TaHConfig.decider_layers), (..., C) each, and the top-k running summed logits."""
    states: list
    topk_values: torch.Tensor

    def rows(self, keep):
        """The same features for the rows selected by the boolean mask keep, detached."""
        return DeciderInput([s.detach()[keep] for s in self.states], self.topk_values.detach()[keep])


class Decider(nn.Module):
    """score = MLP([h_l for l in decider_states] ++ W topk_values), one per state (§4.2): a logit;
    the token goes on iff sigmoid(score) > threshold, and stage 2 trains it with a BCE on logits."""

    def __init__(self, cfg: TaHConfig):
        super().__init__()
        C = cfg.n_embd
        self.logit_proj = nn.Linear(cfg.logit_topk, C)
        self.mlp = nn.Sequential(
            nn.Linear(C * (len(cfg.decider_states) + 1), cfg.decider_hidden), nn.GELU(),
            nn.Linear(cfg.decider_hidden, cfg.decider_hidden), nn.GELU(),
            nn.Linear(cfg.decider_hidden, 1))

    def forward(self, f: DeciderInput):
        return self.mlp(torch.cat(f.states + [self.logit_proj(f.topk_values)], dim=-1)).squeeze(-1)


# -----------------------------------------------------------------------------
# The model


@dataclass
class DepthPass:
    """What one depth computed: the batch rows it ran, rows (B',) (deeper than 0, those with a token
    going on), query rows sel (B', Tq) token indices, valid (B', Tq), final hidden states (B', Tq,
    C), its logits (B', Tq, V), the decider's inputs and raw scores (B', Tq) where computed."""
    depth: int
    rows: torch.Tensor
    sel: torch.Tensor
    valid: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor
    features: DeciderInput = None
    score: torch.Tensor = None


@dataclass
class TaHOutput:
    logits: torch.Tensor  # (B, T, V) summed over the depths each token ran
    loss: torch.Tensor  # CE of the summed logits, or None
    depths: torch.Tensor  # (B, T) passes each token ran, in [1, max_depth]
    first_logits: torch.Tensor  # (B, T, V) logits of the first pass (depth 0) alone
    passes: list = field(default_factory=list)


def gather(t, sel, rows=None):
    """t[rows[b], sel[b, q]]: the tokens sel (B', Tq) of batch rows rows (B',) of t (B, T, ...),
    as (B', Tq, ...); rows None: every batch row (B' = B)."""
    rows = torch.arange(t.size(0), device=t.device) if rows is None else rows
    return t[rows[:, None], sel]


class ThinkAtHard(nn.Module):
    def __init__(self, cfg: TaHConfig):
        super().__init__()
        self.cfg = cfg
        self.backbone = Transformer(cfg)
        add_lora(self.backbone.blocks, cfg.lora_rank, cfg.lora_alpha)
        self.decider = Decider(cfg)
        self.loras = [m for m in self.backbone.modules() if isinstance(m, LoRALinear)]  # not a ModuleList: no new names
        self.passes_compiled = False  # compile_passes: run_pass under torch.compile

    def forward(self, idx, targets=None, mode="standard", depths=None, cache=None, features=False, threshold=None):
        """Depth-wise forward of idx (B, T) under a routing mode:
        standard (every token 1 pass), always (max_depth), oracle (the given depths (B, T)),
        decider (the decider decides after each pass, at `threshold`, None: cfg.threshold).
        With a cache, idx continues it. features=True keeps the decider's inputs for every
        pass (stage 2).
        """
        check_routing(self.cfg, MODES, idx, targets, mode, depths, cache, threshold)  # before unpacking
        cfg, (B, T) = self.cfg, idx.shape
        cache = DepthKV(cfg.n_layer, B, idx.device) if cache is None else cache
        start = cache.reserve(T, cfg.block_size)
        summed = None  # (B, T, V): logits summed over the depths run so far (zeros of the logits' dtype at first)
        ran = torch.zeros(B, T, dtype=torch.long, device=idx.device)  # passes each token ran
        # Depth 0 is the one pass every token runs: all of them, in order, on their embeddings.
        subset, rows = None, torch.arange(B, device=idx.device)  # subset None: every batch row
        sel, valid = torch.arange(T, device=idx.device).expand(B, T), torch.ones_like(idx, dtype=torch.bool)
        x = self.backbone.wte(idx)
        passes = []
        run = pass_runner(self, cache)
        for d in range(cfg.max_depth):
            h, kept = run(self, x, start + sel, d, valid, cache, subset)
            kept[cfg.n_layer] = self.backbone.norm_f(h)  # the last state after the final norm, as the authors'
            logits = self.backbone.lm_head(kept[cfg.n_layer])  # (B', Tq, V)
            summed, ran = self.accumulate(summed, ran, logits, rows, sel, valid, d)
            passes.append(DepthPass(d, rows, sel, valid, h, logits))
            if mode == "decider" or features:
                self.read_decider(passes[-1], kept, gather(summed, sel, rows), score=mode == "decider")
            if d + 1 == cfg.max_depth:
                break
            active = self.route(mode, depths, passes[-1], d, (B, T), threshold or cfg.threshold)
            subset, rows, sel, valid = select(cfg, active)  # the tokens going on, gathered (the fast paths)
            if rows.numel() == 0:
                break  # no token goes on
            x = self.next_input(gather(summed, sel, rows))  # Eq. 4: the pass so far's top-k, embedded
        loss = None if targets is None else F.cross_entropy(upcast(summed.flatten(0, 1)), targets.flatten(),
                                                            ignore_index=-1)
        return TaHOutput(summed, loss, ran, passes[0].logits, passes)

    def run_pass(self, x, q_pos, d, valid, cache, rows=None):
        """One pass of the backbone at depth d over the query rows x (B', Tq, C) at positions
        q_pos of batch rows `rows` (None: every row): their keys join the cache, the duo-causal
        mask reads all of those rows' cache (Eq. 5), and the LoRA adapter is on at depth >= 1
        (Eq. 6). Returns the final states and the outputs of the decider's layers."""
        cfg, B, Tq = self.cfg, x.size(0), x.size(1)
        q_depth = torch.full_like(q_pos, d)
        cache.add(q_pos, q_depth, valid, rows)
        lookups = [t[:, :cache.len] for t in cache.lookups]
        if rows is not None:
            lookups = [t.index_select(0, rows) for t in lookups]
        mask = pass_mask(cfg, duo_causal(q_pos, q_depth, *lookups, cfg.attention), B, Tq, cache.len, x.device)
        kept = [x]  # hidden states as the authors index them: 0 the input, i + 1 block i's output
        rope = Positions(q_pos)  # every depth at its token's position (§4.1); the table made once a pass
        plans = [LayerPlan(rope, mask, cache.layers[i]) for i in range(cfg.n_layer)]
        self.set_lora(d >= 1)  # Eq. 6: theta at depth 0, theta + Delta deeper
        try:
            return self.backbone.run_blocks(x, plans, kept), kept
        finally:  # an error mid-pass must not leave the adapter on for the next call
            self.set_lora(False)

    @staticmethod
    def accumulate(summed, ran, logits, rows, sel, valid, d):
        """Add depth d's logits into each token's running sum (the residual over depths, Eq. 4's
        input and the output) and record that the token ran d + 1 passes."""
        summed = logits.new_zeros(*ran.shape, logits.size(-1)) if summed is None else summed
        b_i, t_i = rows[:, None].expand_as(sel)[valid], sel[valid]
        summed = summed.index_put((b_i, t_i), logits[valid], accumulate=True)
        return summed, ran.index_put((b_i, t_i), torch.full_like(t_i, d + 1))

    def read_decider(self, p, kept, summed, score):
        """The decider's view of pass p (§4.2): the hidden states in cfg.decider_states and the
        top-k values of the running summed logits (B', Tq, V); its raw scores if `score`."""
        topv = torch.topk(upcast(summed), self.cfg.logit_topk, dim=-1).values
        p.features = DeciderInput([kept[l] for l in self.cfg.decider_states],
                                  topv.to(self.decider.logit_proj.weight.dtype))  # its weights' dtype
        p.score = self.decider(p.features) if score else None

    def route(self, mode, depths, p, d, shape, threshold):
        """Which tokens go on to depth d + 1: (B, T) bool."""
        if mode == "decider":  # go on iff sigmoid(score) > threshold
            b_i = p.rows[:, None].expand_as(p.sel)[p.valid]
            go = torch.zeros(shape, dtype=torch.bool, device=p.sel.device)
            return go.index_put((b_i, p.sel[p.valid]), torch.sigmoid(p.score[p.valid]) > threshold)
        want = {"standard": 1, "always": self.cfg.max_depth, "oracle": depths}[mode]
        return torch.as_tensor(want, device=p.sel.device).expand(shape) > d + 1

    def next_input(self, summed_logits):
        """Eq. 4 with the top-k only: softmax over the top-k logits, zero weight elsewhere, times
        the embedding table (topk_weights: the weights over the whole vocabulary)."""
        E = self.backbone.wte.weight
        return topk_weights(summed_logits, self.cfg.logit_topk).to(E.dtype) @ E

    def set_lora(self, active):
        for m in self.loras:
            m.active = active

    def compile_passes(self, on=True):
        """Each pass through COMPILED_PASS from now on (the fast paths, at the end of the file)."""
        self.passes_compiled = on
        return self


# -----------------------------------------------------------------------------
# The forward's cache: every (position, depth) state's K/V, the way training keeps it


class DepthKV:
    """The K/V of every (position, depth) state a forward has computed, per layer, and their
    lookups (position, depth, exists), (B, rows) each. Each pass appends its rows (the depths' K/V
    concatenated, §4.1) and attends to all under the duo-causal mask; a batch row it skips, or a
    padded query, leaves its slots marked absent, as the mask reads positions and depths.

    Why two caches: training needs every pass's K/V in the autograd graph, so this one grows
    by concatenation; decoding (generate.TaHCache) writes preallocated buffers in place. The
    forward reads either through these calls only: `batch`, `reserve(T, block_size)`, `add(pos,
    depth, valid, rows)` (a pass's row slots), `lookups`, `len`, and per layer moe's one call,
    `layers[i].update(k, v)`, which fills the slots of the pass add() opened, for its rows; a
    decoding cache may also run the passes itself (`graphed`: generate.StaticTaHCache's CUDA graphs)."""

    def __init__(self, n_layer, B, device):
        self.layers = [LayerKV(self) for _ in range(n_layer)]
        self.lookups = [torch.zeros(B, 0, dtype=dt, device=device) for dt in (torch.long, torch.long, torch.bool)]
        self.batch, self.len, self.next_pos, self.rows = B, 0, 0, None

    def reserve(self, T, block_size):
        """Claim positions for T new tokens; returns the first one."""
        start = self.next_pos
        check_length(start, T, block_size)
        self.next_pos += T
        return start

    def append(self, buf, new, dim):
        """buf with new appended along dim, for this pass's batch rows (the others get zeros)."""
        if self.rows is not None:
            new = new.new_zeros(self.batch, *new.shape[1:]).index_copy(0, self.rows, new)
        return new if buf is None else torch.cat([buf, new], dim)

    def add(self, pos, depth, valid, rows=None):
        """Row slots for one pass: the states (pos, depth, valid) (B', Tq) of batch rows `rows`
        (None: every row)."""
        self.rows = rows
        self.lookups = [self.append(buf, x, 1) for buf, x in zip(self.lookups, (pos, depth, valid))]
        self.len += pos.size(1)


class LayerKV:
    """One layer of a DepthKV: update(k, v) writes the pass's new K/V (B', Hkv, Tq, hd) and
    returns the K/V of every row so far, of the pass's batch rows."""

    def __init__(self, owner):
        self.owner, self.k, self.v = owner, None, None

    def update(self, k, v):
        o = self.owner
        self.k, self.v = o.append(self.k, k, 2), o.append(self.v, v, 2)
        return (self.k, self.v) if o.rows is None else (self.k.index_select(0, o.rows), self.v.index_select(0, o.rows))


# -----------------------------------------------------------------------------
# Training (§4.3): oracle labels (Eq. 7; App. A.2.1 for max_depth > 2), then the two stages' losses


def oracle_depths(ref_logits, targets, max_depth, response=None):
    """Passes per token from a reference model: 1 if its top-1 prediction is the target, else deeper.
    Only positions with a target (not -1) whose input token is in the response (response (B, T)
    bool; None: every position) can be hard: the authors label prompt tokens easy, the last one
    (which predicts the first response token) too. max_depth == 2: hard tokens get 2 (Eq. 7).
    max_depth > 2: within each sample, the hard tokens sorted by reference CE, highest first, are
    cut into max_depth - 1 equal bins, the first bins one larger when the count does not divide
    (the authors' quantile binning, App. A.2.1): bin k runs max_depth - k passes."""
    check_oracle(ref_logits, targets, max_depth, response)
    hard = (ref_logits.argmax(-1) != targets) & (targets >= 0)
    if response is not None:
        hard = hard & response
    depths = torch.ones_like(targets)
    if max_depth == 1 or not hard.any():
        return depths
    if max_depth == 2:
        return depths + hard.long()
    ce = F.cross_entropy(upcast(ref_logits.flatten(0, 1)), targets.flatten().clamp(min=0), reduction="none")
    ce = ce.view_as(targets).masked_fill(~hard, float("-inf"))
    rank = ce.argsort(dim=1, descending=True, stable=True).argsort(dim=1)  # 0 = the sample's highest CE
    bins = max_depth - 1
    size, rem = hard.sum(1, keepdim=True) // bins, hard.sum(1, keepdim=True) % bins  # bins 0..rem-1 hold size + 1
    big = rem * (size + 1)
    k = torch.where(rank < big, rank // (size + 1), rem + (rank - big) // size.clamp(min=1))
    return torch.where(hard, max_depth - k, depths)


def stage1_loss(model, idx, targets, depths):
    """CE of each token's output at its oracle depth; backbone and LoRA train."""
    return model(idx, targets, mode="oracle", depths=depths).loss


def stage2_loss(model, idx, depths, pos_weight=None):
    """Decider BCE (class-weighted) on the oracle's continuation labels, backbone frozen.

    The decision after pass d (0-based) of token i has label c = 1[D_i > d + 1]; decisions
    exist for d < min(max_depth - 1, D_i). The continue class is weighted by pos_weight:
    None (default) takes the paper's w^(d), #stop / #continue among the batch's decisions
    after pass d, one weight per depth (§4.3); a number fixes it for every depth and batch,
    as the authors' code does (about #stop / #continue of their data set: 4.8 and 5.4).
    Returns (mean loss over decisions, scores, labels).

    Where the defaults part from the authors' code (thu-nics/TaH): the class weight here is
    the paper's per-depth, per-batch w^(d) (§4.2-4.3), theirs a fixed pos_weight (5.4 or 4.8)
    or 1; on a batch mixing stops and continues the two differ by up to 9.6 in the loss. For
    max_depth 3 this is one mean over every decision of every depth; their code combines the
    depths otherwise, and its loss is 1.86-2.13 times this one.
    """
    check_stage2(model.cfg, idx, depths, pos_weight)
    with torch.no_grad():  # gradient reaches the decider only
        # the last pass makes no decision, and passes before it never read its keys (k <= d
        # in every attention variant), so it is not run
        out = model(idx, mode="oracle", depths=depths.clamp(max=model.cfg.max_depth - 1), features=True)
    scores, labels, weights = [], [], []
    for p in out.passes[:model.cfg.max_depth - 1]:
        s = model.decider(p.features.rows(p.valid))
        c = (gather(depths, p.sel, p.rows)[p.valid] > p.depth + 1).to(s.dtype)
        # w^(d) = #stop / #continue (0 when every decision continues), in the scores' dtype
        w = (c == 0).sum().to(s.dtype) / (c == 1).sum().clamp(min=1).to(s.dtype) if pos_weight is None \
            else torch.tensor(pos_weight, dtype=s.dtype, device=s.device)
        scores.append(s)
        labels.append(c)
        weights.append(torch.where(c == 1, w, torch.ones_like(s)))
    scores, labels, weights = torch.cat(scores), torch.cat(labels), torch.cat(weights)
    # BCE-with-logits where only the continue term carries the weight: w c log s + (1 - c) log(1 - s)
    loss = -(weights * labels * F.logsigmoid(scores) + (1 - labels) * F.logsigmoid(-scores)).mean()
    return loss, scores, labels


# -----------------------------------------------------------------------------
# The fast paths: how a pass runs (a CUDA graph, compiled, eager), its mask's form, the gathered
# tokens of a deeper pass, the next input's weights. Each equals the reference (test_tah.py).


def pass_runner(model, cache):
    """How a pass runs: replayed as a CUDA graph where the cache holds one (generate.py's
    StaticTaHCache), compiled after model.compile_passes(), else eagerly (run_pass)."""
    return getattr(cache, "graphed", None) or (COMPILED_PASS if model.passes_compiled else ThinkAtHard.run_pass)


# run_pass compiled, the cache's length a symbolic size; compiles at its first call. The loop between passes
# stays eager: the tokens that go on (route, select) and their logits' slots (accumulate) are shapes read
# off the decider's scores, a graph break each.
COMPILED_PASS = torch.compile(ThinkAtHard.run_pass, fullgraph=True, dynamic=True)


def pass_mask(cfg, mod, B, Tq, Tk, device):
    """A pass's duo-causal mask_mod in the form attention takes: "causal" for the first pass of a
    fresh cache (depth 0, every token in order: Eq. 5 is causal there), a flex BlockMask (attn_impl
    "flex"), else the dense boolean mask (the reference)."""
    if cfg.attn_impl == "dense" and Tk == Tq:
        return "causal"
    if cfg.attn_impl == "flex":
        return create_block_mask(mod, B, None, Tq, Tk, device=device)
    return dense_batch_mask(mod, B, Tq, Tk, device)


def select(cfg, active):
    """Which tokens run a deeper pass, from active (B, T): (subset, rows, sel, valid). subset: the
    batch rows it runs, None for every row; rows: those rows' indices (empty: no token goes on);
    sel (B', Tq) their query tokens, valid (B', Tq). gather=True: only the rows with a token
    going on (in batched decoding the second pass runs only those), each row's active tokens
    left-packed in position order; gather=False (the reference): every token, the inactive masked."""
    B, T = active.shape
    every = torch.arange(B, device=active.device)
    if not cfg.gather:
        return (None, every, torch.arange(T, device=active.device).expand_as(active), active) if active.any() \
            else (None, every[:0], None, None)
    subset = active.any(1).nonzero().squeeze(1)  # one wait for the device, as the dynamic shape needs
    if subset.numel() == 0:
        return subset, subset, None, None
    rows, subset = subset, None if subset.numel() == B else subset
    active = active if subset is None else active[subset]
    n_act = active.sum(1)
    sel = torch.argsort((~active).int(), dim=1, stable=True)[:, :int(n_act.max())]
    return subset, rows, sel, torch.arange(sel.size(1), device=sel.device) < n_act[:, None]


def topk_weights(logits, k):
    """Eq. 4's weights: softmax over the top-k of logits (.., V), zero elsewhere, as a dense
    (.., V) row: multiplied by the embedding table, the same sum as gathering the k rows, and
    cheaper than the (.., k, C) gather and its backward when k is near V; at k = V, no sort."""
    logits = upcast(logits)
    if k >= logits.size(-1):
        return F.softmax(logits, dim=-1)
    vals, ids = torch.topk(logits, k, dim=-1)
    return torch.zeros_like(logits).scatter(-1, ids, F.softmax(vals, dim=-1))


# -----------------------------------------------------------------------------


def draw(depths):
    """ASCII picture of the duo-causal mask for one row of per-token depths."""
    D = torch.as_tensor(depths)
    T = D.numel()
    pos = torch.cat([torch.arange(T)[D > d] for d in range(int(D.max()))])
    dep = torch.cat([torch.full((int((D > d).sum()),), d) for d in range(int(D.max()))])
    mod = duo_causal(pos[None], dep[None], pos[None], dep[None], torch.ones(1, pos.numel(), dtype=torch.bool))
    m = dense_batch_mask(mod, 1, pos.numel(), pos.numel(), "cpu")[0, 0]
    names = [f"{p}.{d + 1}" for p, d in zip(pos.tolist(), dep.tolist())]  # token.pass
    lines = ["       " + " ".join(f"{n:>3}" for n in names)]
    for q, n in enumerate(names):
        lines.append(f"  {n:>4} " + " ".join("  #" if m[q, k] else "  ." for k in range(len(names))))
    return "\n".join(lines)


if __name__ == "__main__":
    demo_args(__doc__)
    print("Duo-causal mask, passes per token [1, 2, 1, 2] (row i.p = token i in pass p; # = may attend):")
    print(draw([1, 2, 1, 2]))
    torch.manual_seed(0)
    cfg = TaHConfig(vocab_size=128, n_experts=0, logit_topk=16)
    model = ThinkAtHard(cfg).eval()
    idx = torch.randint(cfg.vocab_size, (2, 24))
    x, y = idx[:, :-1], idx[:, 1:]
    with torch.no_grad():
        ref = model(x, mode="standard")
        oracle = oracle_depths(ref.logits, y, cfg.max_depth)
        for mode in MODES:
            out = model(x, y, mode=mode, depths=oracle)
            print(f"mode {mode:>8}, untrained: loss {out.loss.item():.4f} (ln V {math.log(cfg.vocab_size):.2f}), "
                  f"tokens iterated {(out.depths > 1).float().mean().item():.0%}")
    print("(an untrained decider scores about 0.5, below the 0.9 threshold, so it iterates nothing; "
          "train_tiny.py trains one)")
