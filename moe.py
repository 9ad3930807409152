"""
The backbone: a small WeLM-style Mixture-of-Experts transformer with KV-Mirror, after WeLM's blog
post "Building effective sparse MoE models with moderate resources" (WeChat AI) and its public
inference code:

- attention: grouped-query attention with many query heads, a head-wise sigmoid output gate
  (Qiu et al. 2025), KNorm (RMSNorm over head_dim on keys only) and partial RoPE;
- FFN: sigmoid router, top-k by score + bias, outputs weighted by the plain scores, one shared
  expert, loss-free balancing of the bias (DeepSeek-V3 §2.1.2); `n_experts=0`: a dense SwiGLU;
- KV-Mirror (U-shape): the last third of the layers compute their keys and values from the
  normalized attention input saved by the first third, with their own projections.

hd.py and tah.py reuse `Block`, `attend`, `LayerPlan` and `Transformer.run_blocks`. A forward reads
a KV cache (generate.py) through `len(cache)` and `cache.update(k, v)`; checks.py checks inputs.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from checks import check_attend, check_caches, check_config, check_length, check_tokens, demo_args, static_step

# -----------------------------------------------------------------------------
# Config


@dataclass
class ModelConfig:
    """Every field of the backbone.

    vocab_size:     number of token ids.
    block_size:     the longest sequence `forward` and `generate` accept (in positions).
    n_layer:        number of transformer blocks.
    n_embd:         width of the residual stream.
    n_head:         query heads. WeLM uses 3x the usual count (n_head * head_dim = 3 * n_embd).
    n_kv_head:      key/value heads (grouped-query attention); must divide n_head.
    head_dim:       width of one head; independent of n_embd, as in WeLM.
    rope_fraction:  fraction of each head's dims rotated by RoPE, in (0, 1] (WeLM: 64 of 256).
    rope_base:      RoPE frequency base.
    n_experts:      routed experts per FFN; 0 replaces the MoE with a dense SwiGLU MLP.
    top_k:          routed experts chosen per token (1 <= top_k <= n_experts).
    expert_hidden:  hidden width of each routed expert and of the shared expert.
    ffn_hidden:     hidden width of the dense SwiGLU MLP (used only when n_experts == 0).
    balance_gamma:  step size of the loss-free balancing update of the router bias.
    moe_dispatch:   how rows reach their experts: "gather", "masked" (static shapes, which
                    torch.compile takes whole), "grouped_mm", "loop" (sorted by expert), or
                    "auto" (dispatch, with the fast paths).
    kv_mirror:      KV-Mirror: layer n_layer-1-j takes K/V inputs from layer j < n_layer // 3.
    norm_eps:       epsilon of every RMSNorm.
    """

    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 6
    n_embd: int = 64
    n_head: int = 12
    n_kv_head: int = 2
    head_dim: int = 16
    rope_fraction: float = 0.25
    rope_base: float = 10000.0
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 64
    ffn_hidden: int = 256
    balance_gamma: float = 1e-3
    moe_dispatch: str = "auto"
    kv_mirror: bool = True
    norm_eps: float = 1e-6

    def __post_init__(self):
        check_config(self)  # the table of every field's rules: checks.MODEL

    @property
    def rope_dim(self) -> int:
        return int(round(self.head_dim * self.rope_fraction))

    @property
    def mirrored(self):
        """KV-Mirror's consumers, the last n_layer // 3 layers (hd.py's final-stream skip's start)."""
        return range(self.n_layer - self.n_layer // 3 if self.kv_mirror else self.n_layer, self.n_layer)

    def mirror_source(self, layer: int):
        """KV-Mirror pairing (U-shape): consumer n_layer-1-j reads source j, for j < n_layer // 3."""
        return self.n_layer - 1 - layer if layer in self.mirrored else None


# -----------------------------------------------------------------------------
# Attention: GQA, partial RoPE, KNorm, head-wise gate, KV-Mirror input


def upcast(t):
    """Half precision -> float32 for numerically sensitive steps; float32 and float64 stay."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def rope_angles(pos, rope_dim, base, dtype):
    """cos and sin of RoPE's angles at positions pos, (T,) or (B, T): (T, rope_dim/2), or (B, 1, T,
    rope_dim/2) to broadcast over heads."""
    half = rope_dim // 2
    inv_freq = base ** (-torch.arange(half, device=pos.device, dtype=dtype) / half)
    ang = pos.to(dtype)[..., None] * inv_freq
    if ang.dim() == 3:
        ang = ang[:, None]
    return ang.cos(), ang.sin()


class Positions:
    """Query or key positions, (T,) or (B, T), with the cos and sin of their RoPE angles computed at
    the first layer that asks and read by the rest: one forward's layers share one object, so the
    table is made once per forward, not twice per layer."""

    def __init__(self, t):
        self.t, self.tables = t, {}

    def rotation(self, rope_dim, base, dtype):
        if (rope_dim, base, dtype) not in self.tables:
            self.tables[rope_dim, base, dtype] = rope_angles(self.t, rope_dim, base, dtype)
        return self.tables[rope_dim, base, dtype]


def apply_rope(x, pos, rope_dim, base):
    """Rotate the first rope_dim dims of x (..., T, hd) by pos, a tensor (T,) or (B, T), or a
    Positions; pass the rest. NeoX layout: dim i pairs with i + rope_dim/2 (WeLM rotates the
    trailing dims: a fixed permutation)."""
    half = rope_dim // 2
    dt = upcast(x).dtype  # the angles in float32 at least, in float64 for a float64 model
    cos, sin = pos.rotation(rope_dim, base, dt) if isinstance(pos, Positions) else rope_angles(pos, rope_dim, base, dt)
    x1, x2, rest = upcast(x[..., :half]), upcast(x[..., half:rope_dim]), x[..., rope_dim:]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)
    return torch.cat([rot, rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * hd, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * hd, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * hd, bias=False)
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.n_head, bias=False)  # WeLM: one gate per head
        self.o_proj = nn.Linear(cfg.n_head * hd, cfg.n_embd, bias=False)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.norm_eps)  # KNorm: keys only, shared over heads
        self.record = None  # a function of (q, k, mask), called before attend (experiment.recording_attention)

    def project_kv(self, u, pos):
        """K, V (B, Hkv, T, hd) of normalized inputs u (B, T, C): projection -> KNorm -> RoPE."""
        B, T, _ = u.shape
        k = self.k_proj(u).view(B, T, self.cfg.n_kv_head, -1).transpose(1, 2)
        v = self.v_proj(u).view(B, T, self.cfg.n_kv_head, -1).transpose(1, 2)
        norm = self.k_norm  # its weight in the keys' dtype: under autocast a float32 weight unfuses rms_norm
        k = F.rms_norm(k, norm.normalized_shape, norm.weight.to(k.dtype), norm.eps)
        k = apply_rope(k, pos, self.cfg.rope_dim, self.cfg.rope_base)
        return k, v

    def forward(self, u, pos, mask, kv_u=None, kv_pos=None, cache=None):
        """u: normalized input (B, T, C) at positions pos -> (B, T, C). kv_u/kv_pos: where K and V
        come from instead (KV-Mirror's source input; in hd.py's final-stream skip, more rows than u).
        cache: update(k, v) appends and returns every row's K and V so far (generate.KVCache)."""
        B, T, _ = u.shape
        q = self.q_proj(u).view(B, T, self.cfg.n_head, -1).transpose(1, 2)  # (B, H, T, hd)
        q = apply_rope(q, pos, self.cfg.rope_dim, self.cfg.rope_base)
        k, v = self.project_kv(u if kv_u is None else kv_u, pos if kv_pos is None else kv_pos)
        if cache is not None:
            k, v = cache.update(k, v)
        if self.record is not None:
            self.record(q, k, mask)
        y = attend(q, k, v, mask)  # (B, H, T, hd)
        y = y * torch.sigmoid(self.gate_proj(u)).transpose(1, 2)[..., None]  # head-wise gate
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


# -----------------------------------------------------------------------------
# Masks and the one attention call


def causal(b, h, q_idx, kv_idx):
    """The plain causal mask as a flex-style mask_mod: a query sees itself and earlier keys."""
    return kv_idx <= q_idx


def causal_after(start, T, device, keys=None):
    """The causal mask of T new rows after `start` cached ones (cached decoding). keys: the rows a
    cache returns when it returns all it has room for (generate.StaticCache, whose `start` is a
    tensor on the device): the mask then hides the rows not yet written."""
    if keys is None and start == 0:
        return "causal"
    if keys is None and T == 1:
        return None  # one new row sees every cached row
    new = start + torch.arange(T, device=device)
    return dense_mask(causal, new, torch.arange(start + T if keys is None else keys, device=device))


def dense_mask(mask_mod, q_idx, kv_idx):
    """The reference form of any mask_mod: a (Tq, Tk) boolean tensor, True = may attend."""
    return mask_mod(0, 0, q_idx[:, None], kv_idx[None, :])


def attend(q, k, v, mask):
    """Scaled dot-product attention, q (B, H, Tq, hd), k/v (B, Hkv, Tk, hd) -> (B, H, Tq, hd). The
    mask, one form per path: "causal" (Tq == Tk: SDPA's causal kernel, FlashAttention on CUDA);
    the dense path's boolean tensor broadcastable to (B, H, Tq, Tk), or None (every key: a decode
    step); the flex path's BlockMask. A row that sees no key gives 0 on every path."""
    check_attend(q, k, v, mask)
    if isinstance(mask, (BlockMask, str)) or folds(q, k, mask):
        return attend_fast(q, k, v, mask)  # the same attention by a faster route (the fast paths, at the end)
    return sdpa(q, k, v, mask)  # the reference: SDPA under a dense mask (None: every key)


# -----------------------------------------------------------------------------
# Feed-forward: dense SwiGLU, and the MoE with loss-free balancing


class SwiGLU(nn.Module):
    def __init__(self, n_embd, hidden):
        super().__init__()
        self.gate = nn.Linear(n_embd, hidden, bias=False)
        self.up = nn.Linear(n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Sigmoid-routed experts plus one shared expert (DeepSeek-V3 / WeLM).

    y(x) = shared(x) + sum_{e in TopK(s + b)} s_e * expert_e(x),   s = sigmoid(W_r x)

    The bias b only decides *which* experts run; the weights are the plain scores s, not
    renormalized (WeLM). b is a buffer moved by `update_bias`, never by the optimizer.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        E, C, I = cfg.n_experts, cfg.n_embd, cfg.expert_hidden
        self.router = nn.Linear(C, E, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(E, C, 2 * I))  # routed experts, stacked
        self.w_down = nn.Parameter(torch.empty(E, I, C))
        self.shared = SwiGLU(C, I)
        self.register_buffer("bias", torch.zeros(E))
        self.register_buffer("step_load", torch.zeros(E))  # selections since the last update
        self.last_load = torch.zeros(E)  # selections in the latest forward (for statistics)

    def route(self, x):
        """x (N, C) -> expert ids (N, k) chosen by score + bias, and their weights = scores."""
        with torch.autocast(x.device.type, enabled=False):  # routing in fp32 (fp64 for a fp64 model)
            scores = torch.sigmoid(F.linear(upcast(x), upcast(self.router.weight).to(upcast(x).dtype)))  # (N, E)
        idx = torch.topk(scores + self.bias, self.cfg.top_k, dim=-1).indices
        return idx, scores.gather(-1, idx)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, C)
        idx, weights = self.route(x)  # (N, k) each
        counts = idx.new_zeros(self.cfg.n_experts).index_add_(0, idx.flatten(), torch.ones_like(idx.flatten()))
        self.last_load = counts.detach().float()
        if self.training and torch.is_grad_enabled():  # evaluation and sampling don't count
            self.step_load += self.last_load
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        mode = dispatch(self, x.size(0), dt, dev)
        if mode != "loop":  # the same sum by a faster route (the fast paths, at the end of the file)
            y = fast_experts(self, x, idx, weights, counts, mode, dt)
        else:  # the reference: the (token, k) pairs sorted by expert, each expert on its run of rows
            order = idx.flatten().argsort(stable=True)
            token = order // self.cfg.top_k
            runs = x[token].to(dt).split(counts.tolist())
            ys = torch.cat([self.expert(e, xe) for e, xe in enumerate(runs)]) * weights.flatten()[order, None]
            y = torch.zeros_like(x).index_add_(0, token, ys.to(x.dtype))
        return (y.to(x.dtype) + self.shared(x)).view(shape)

    def expert(self, e, x):
        """Routed expert e, a SwiGLU, on rows x: down(silu(gate x) * up x)."""
        g, u = (x @ self.w_gate_up[e]).chunk(2, dim=-1)
        return (F.silu(g) * u) @ self.w_down[e]

    @torch.no_grad()
    def update_bias(self, gamma):
        """Loss-free balancing (DeepSeek-V3 §2.1.2): b += gamma * sign(mean_load - load), load the
        step's selections (every micro-step since the last call) summed over DDP ranks."""
        load = self.step_load.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(load)
        self.bias += gamma * torch.sign(load.mean() - load)
        self.step_load.zero_()
        return load


# -----------------------------------------------------------------------------
# Block and model


class Block(nn.Module):
    """Pre-norm block -> the new residual x and u, the normalized attention input (for KV-Mirror)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.mirror_source = cfg.mirror_source(layer)  # None, or the layer whose u feeds K/V
        self.attn_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.ffn = MoE(cfg) if cfg.n_experts > 0 else SwiGLU(cfg.n_embd, cfg.ffn_hidden)

    def forward(self, x, pos, mask, kv_u=None, kv_pos=None, cache=None):
        u = self.attn_norm(x)
        x = x + self.attn(u, pos, mask, kv_u, kv_pos, cache)
        x = x + self.ffn(self.ffn_norm(x))
        return x, u


@dataclass
class LayerPlan:
    """How one block runs, fixed before the loop: query positions, mask (one form per attention
    path, see attend) and cache. hd.py's plan adds the stream fold and the final-stream skip."""
    pos: torch.Tensor
    mask: object
    cache: object = None

    def run(self, block, x, kv_u):
        return block(x, self.pos, self.mask, kv_u=kv_u, cache=self.cache)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm_f = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.sources = {b.mirror_source for b in self.blocks} - {None}
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual-branch outputs down
            if name.endswith(("o_proj.weight", "down.weight", "w_down")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, MoE):
            nn.init.normal_(module.w_gate_up, std=0.02)

    def run_blocks(self, x, plans, states=None):
        """The blocks in a plain loop, block i as plans[i] (a LayerPlan) says; `states`, a list,
        gets each block's output. KV-Mirror's bookkeeping, once: a source layer's u is kept (not
        detached: gradients reach the source) and handed to its consumer as kv_u."""
        if len(plans) != len(self.blocks):
            raise ValueError(f"run_blocks takes one plan per block: {len(self.blocks)} blocks, {len(plans)} plans")
        saved = {}
        for i, (block, plan) in enumerate(zip(self.blocks, plans)):
            kv_u = saved.pop(block.mirror_source) if block.mirror_source is not None else None
            x, u = plan.run(block, x, kv_u)
            if i in self.sources:
                saved[i] = u
            if states is not None:
                states.append(x)
        return x

    def forward(self, idx, targets=None, caches=None):
        """idx (B, T) -> (logits (B, T, V), loss or None). With caches (one per layer, see
        generate.py), idx continues the rows they hold."""
        check_tokens(idx, targets, self.cfg.vocab_size)
        T = idx.size(1)
        start = 0 if caches is None else check_caches(caches, self.cfg.n_layer, self.cfg.block_size)
        check_length(start, T, self.cfg.block_size, "positions")
        start, keys = cache_start(caches, start)
        pos = Positions(start + torch.arange(T, device=idx.device))
        mask = causal_after(start, T, idx.device, keys)
        x = self.run_blocks(self.wte(idx), [LayerPlan(pos, mask, None if caches is None else caches[i])
                                            for i in range(self.cfg.n_layer)])
        logits = self.lm_head(self.norm_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(upcast(logits.flatten(0, 1)), targets.flatten(), ignore_index=-1)
        return logits, loss

    def moe_layers(self):
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoE)]

    def expert_load(self):
        """(n_moe_layers, n_experts): how often each expert was chosen in the latest forward."""
        layers = self.moe_layers()
        return torch.stack([m.last_load for m in layers]) if layers else torch.zeros(0, 0)

    def update_router_bias(self, gamma=None):
        """Call after each optimizer step; returns the step's loads (n_moe_layers, n_experts)."""
        gamma = self.cfg.balance_gamma if gamma is None else gamma
        loads = [m.update_bias(gamma) for m in self.moe_layers()]
        return torch.stack(loads) if loads else torch.zeros(0, 0)


# -----------------------------------------------------------------------------
# Fast paths: what a GPU, a compiled graph or cached decoding needs beside the paper's path above


GATHER_ROWS = 4  # auto, eager: (token, k) pairs up to which gather beats sorting by expert (bench.py 4h)
COMPILED_GATHER_ROWS = 128  # auto, compiled on the CPU: up to a batch-16 n = 4 decode step's pairs (bench.py 4g)


def dispatch(m, N, dt, dev):
    """The moe_dispatch that runs N rows of the MoE layer m (its forward's expert sum). "auto":
    compiled or recorded for a CUDA graph, gather for a decode step's few rows (on CUDA while it
    moves fewer bytes than masked), else masked; eagerly gather for a decode step's few rows, else
    grouped_mm where torch has it for these inputs, else loop (bench.py 4h)."""
    mode = m.cfg.moe_dispatch
    if mode != "auto":
        return mode
    if static_step(torch.device(dev)):  # compiled or a CUDA graph: static shapes, no host read
        pairs = N * m.cfg.top_k  # on CUDA gather copies each pair's expert weights (written, then read)
        # where masked reads every expert's once: gather while that moves fewer bytes; on the CPU the
        # weights stay in cache and gather pays up to COMPILED_GATHER_ROWS pairs (bench.py 4g)
        few = 2 * pairs < m.cfg.n_experts if dev == "cuda" else pairs <= COMPILED_GATHER_ROWS
        return "gather" if few else "masked"
    if N * m.cfg.top_k <= GATHER_ROWS:
        return "gather"
    aligned = all(n * dt.itemsize % 16 == 0 for n in (m.cfg.n_embd, m.cfg.expert_hidden))
    ok = hasattr(F, "grouped_mm") and (dt != torch.float64 if dev == "cpu" else dt == torch.bfloat16)
    return "grouped_mm" if aligned and ok else "loop"


def gathered(m, x, idx):
    """Static shapes: row n runs its k chosen experts as one batched matmul over their
    gathered weights, (N, k, 1, C) @ (N, k, C, 2I). Returns (N, k, C), in float32 at least
    (autocast off): each pair's weight gradient is an outer product of its own, summed into
    the expert's after the gather, which float16 cannot hold where the loop's matmul can."""
    with torch.autocast(x.device.type, enabled=False):
        x = upcast(x)
        w_gate_up, w_down = m.w_gate_up.to(x.dtype), m.w_down.to(x.dtype)  # cast whole, then gathered
        g, u = (x[:, None, None] @ w_gate_up[idx]).chunk(2, dim=-1)
        return ((F.silu(g) * u) @ w_down[idx]).squeeze(2)


def masked(m, x, idx, weights):
    """Static shapes for many rows: every expert on every row as two matmuls, (N, C) @ (C, E*2I)
    and (N, E*I) @ (E*I, C), each expert's hidden scaled by its weight. An unchosen expert's
    hidden is selected away before the nonlinearity (exactly 0, its gradient too: an inf
    there, times 0, would make NaN); the weights keep their own dtype, float32 at least, so
    their gradient, a sum over the hidden units, does not overflow in float16."""
    E, C, I = m.cfg.n_experts, m.cfg.n_embd, m.cfg.expert_hidden
    h = (x @ m.w_gate_up.to(x.dtype).transpose(0, 1).reshape(C, 2 * E * I)).view(-1, E, 2 * I)
    chosen = torch.zeros(x.size(0), E, dtype=torch.bool, device=x.device).scatter(1, idx, True)
    g, u = torch.where(chosen[..., None], h, 0).chunk(2, dim=-1)
    combine = torch.zeros(x.size(0), E, dtype=weights.dtype, device=x.device).scatter(1, idx, weights)
    act = (F.silu(g) * u * combine[..., None]).reshape(-1, E * I)
    return act.to(x.dtype) @ m.w_down.to(x.dtype).reshape(E * I, C)


def fast_experts(m, x, idx, weights, counts, mode, dt):
    """forward's expert sum by a faster route than the reference's loop, in compute dtype dt:
    gather (static shapes, a decode step's few rows), masked (static shapes, many rows: what
    torch.compile and CUDA graphs take), grouped_mm (the reference's sort, one grouped matmul)."""
    if mode == "gather":
        return (gathered(m, x.to(dt), idx) * weights[..., None]).sum(1)
    if mode == "masked":
        return masked(m, x.to(dt), idx, weights)
    order = idx.flatten().argsort(stable=True)
    token = order // m.cfg.top_k
    offs = counts.cumsum(0).to(torch.int32)
    g, u = F.grouped_mm(x[token].to(dt), m.w_gate_up.to(dt), offs=offs).chunk(2, dim=-1)
    ys = F.grouped_mm((F.silu(g) * u).contiguous(), m.w_down.to(dt), offs=offs) * weights.flatten()[order, None]
    return torch.zeros_like(x).index_add_(0, token, ys.to(x.dtype))


def attend_fast(q, k, v, mask):
    """attend's fast paths: a flex BlockMask (on CUDA the one compiled flex, FLEX), "causal" (SDPA's
    causal kernel), a decode step's few GQA queries folded per K/V head (attend_folded)."""
    gqa = q.size(1) != k.size(1)
    if isinstance(mask, BlockMask):
        if q.is_cuda and not torch.compiler.is_compiling():
            return FLEX(q, k, v, block_mask=mask, enable_gqa=gqa)
        # inside a compiled model Dynamo traces flex with the model; on CPU the eager form is the reference
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
    if isinstance(mask, str):  # "causal"
        return sdpa(q, k, v, None, is_causal=True)
    return attend_folded(q, k, v, mask)


def folds(q, k, mask):
    """Whether a dense-path call is a decode step's few GQA queries, which attend_folded runs: each
    query's own mask row (or none), at most 32 rows per K/V head (bench.py 4e)."""
    if isinstance(mask, (BlockMask, str)) or q.size(1) == k.size(1):
        return False
    Tq, G = q.size(2), q.size(1) // k.size(1)  # G: query heads per K/V head
    per_query = mask is None or (mask.dim() >= 2 and mask.size(-2) == Tq and (mask.dim() == 2 or mask.size(-3) == 1))
    return Tq * G <= 32 and per_query


def sdpa(q, k, v, mask, is_causal=False):
    """F.scaled_dot_product_attention for GQA. On CUDA FlashAttention takes neither a mask nor
    float32, and the fused kernels that do take no GQA: there K and V are expanded to every query
    head (expands_kv), so a fused kernel serves instead of the math fallback, which materializes
    the (B, H, Tq, Tk) scores."""
    gqa = q.size(1) != k.size(1)
    if gqa and expands_kv(q, mask):
        G = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # query head h reads K/V head h // G
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)


def expands_kv(q, mask):
    """Whether sdpa expands K/V for this call: on CUDA, with a mask or outside fp16/bf16."""
    return q.is_cuda and (mask is not None or q.dtype not in (torch.float16, torch.bfloat16))


def attend_folded(q, k, v, mask):
    """Exact GQA with each K/V head's G query heads run as G * Tq rows of that head (the mask
    repeated per head): a K/V row is read once per group, where SDPA's CPU enable_gqa reads it
    once per query head. It pays while the rows fit one CPU query tile (32)."""
    B, H, Tq, hd = q.shape
    G = H // k.size(1)
    mask = None if mask is None else mask.repeat(*(1,) * (mask.dim() - 2), G, 1)
    y = F.scaled_dot_product_attention(q.reshape(B, H // G, G * Tq, hd), k, v, attn_mask=mask)
    return y.reshape(B, H, Tq, hd)  # reshape: SDPA's output layout is its own (on CUDA no view is legal)


# Eager CUDA calls this one compiled flex, made once (flex is fused only when compiled). dynamic: one
# graph serves every batch size and key length, but for torch's special sizes of 1; dynamic=False
# recompiled per shape until the recompile limit sent it back to the unfused flex, which
# materializes the scores.
def compiled_flex(backend="inductor"):
    return torch.compile(flex_attention, dynamic=True, backend=backend)


FLEX = compiled_flex()


def cache_start(caches, start, rows_per_token=1):
    """Where the new tokens go: `start`, the tokens the caches hold, or for caches that count them
    on the device (generate.StaticCache: a decode step replayed as a CUDA graph reads no host
    number) that count, a tensor. Returns (start, keys): keys None (a cache returns the tokens so
    far), or the tokens a static cache has room for and returns whole."""
    if caches is None or not getattr(caches[0], "static", False):
        return start, None
    written = caches[0].written  # None before the cache's first write (the prompt)
    return 0 if written is None else written // rows_per_token, caches[0].capacity // rows_per_token


# -----------------------------------------------------------------------------

if __name__ == "__main__":
    demo_args(__doc__)
    torch.manual_seed(0)
    cfg = ModelConfig()
    model = Transformer(cfg)
    pairs = [(b.mirror_source, i) for i, b in enumerate(model.blocks) if b.mirror_source is not None]
    print(f"config: {cfg}\nparameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M; "
          f"KV-Mirror (source -> consumer): {pairs}")
    idx = torch.randint(cfg.vocab_size, (2, 32))
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    print(f"untrained forward: logits {tuple(logits.shape)}, loss {loss.item():.4f} "
          f"(ln V = {math.log(cfg.vocab_size):.4f}, a uniform guess)")
    for i, row in enumerate(model.expert_load()):  # 62 tokens x top_k selections per layer
        print(f"expert load, moe layer {i}: {row.int().tolist()}  max/mean {(row.max() / row.mean()).item():.2f}")
    out = idx[:1, :8]
    with torch.no_grad():  # greedy, one full forward per token (generate.py decodes with a KV cache)
        for _ in range(16):
            out = torch.cat([out, model(out)[0][:, -1:].argmax(-1)], dim=1)
    print(f"greedy continuation (untrained): prompt {idx[0, :8].tolist()} -> {out[0, 8:].tolist()}")
