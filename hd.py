"""
Hidden Decoding: each token expanded into n streams, Stream-Factorized Attention.

Follows "Hidden Decoding at Scale: Latent Computation Scaling for Large Language Models"
(WeChat AI, arXiv 2607.08186, §2-3), with details the official model file describes. Built on
moe.py: the backbone's blocks run unchanged; this file adds the n embedding tables, the three
attention masks, the final-stream objective, progressive expansion and the KV-mirror
final-stream skip.

Indexing (0-based): token i, stream k, expanded index t = i*n + k, so i(t) = t // n and
s(t) = t % n. The expanded input is S[t] = E_{s(t)}[x_{i(t)}] (HD §2.1).

Each attention pattern is defined once, as a flex-style mask_mod (HD §2.2, Figure 3):
  F  full cross-stream:   kv <= q
  L  local cross-stream:  0 <= q - kv < window       (window counted in expanded positions)
  I  intra-stream:        kv <= q and kv % n == q % n
and every execution path derives from it: a dense boolean mask for SDPA (the reference, any
device, forward and backward), a flex_attention BlockMask (CUDA), and for I layers the
structural fast path "streams folded into the batch dimension + causal SDPA".

Cached decoding (generate.py) runs the same forward over per-layer caches. Input checks live
in checks.py.

Run `python hd.py` to see the three masks drawn for n = 2, L = 4 (as in HD Figure 3) and a
tiny model's loss and KV-mirror skip.
"""

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from checks import check_caches, check_flex, check_length, check_tokens, demo_args, flex_fits, is_int
from moe import LayerPlan, ModelConfig, Positions, Transformer, cache_start, causal, causal_after, dense_mask, upcast

# -----------------------------------------------------------------------------
# Config


@dataclass
class HDConfig(ModelConfig):
    """The backbone's fields (moe.ModelConfig) plus:

    n_streams:   n, streams per token (n = 1 is the backbone itself).
    layout:      one letter per layer: F (full cross-stream), L (local cross-stream, causal
                 sliding window) or I (intra-stream). HD §2.2 keeps most layers I.
    window:      keys an L layer sees, counting itself, in expanded positions.
    positions:   RoPE position of row t: "expanded" (t, the paper and the released code) or
                 "token" (i(t): every stream of token i at position i, for study).
    objective:   "final" (only final-stream rows predict the next token, HD §2.1), or the §5.1
                 ablations "all" (every stream predicts it) and "sum" (stream states of a token
                 summed before the LM head).
    shared_kv:   PHD-like control (HD §5.2): in I layers every stream reads one shared per-token
                 K/V for earlier tokens (see `shared_intra`) instead of its own stream's.
    mirror_skip: KV-mirror final-stream skip (HD §3.1): mirrored layers run only final-stream
                 rows. None = on where exact (objective "final" with kv_mirror). Exact for every
                 logit and gradient, not for loss-free balancing: a skipped row's router load
                 is not counted (its output reaches nothing), so router biases drift from a
                 training without the skip.
    attn_impl:   "fast" (F: causal SDPA; I: streams folded into the batch; L and shared-KV I:
                 flex BlockMask on CUDA, dense mask elsewhere), "dense" (every layer a dense
                 mask: the reference) or "flex" (every layer a BlockMask; CPU: forward only).

    block_size counts tokens; the expanded sequence holds n_streams * block_size rows.
    """

    n_streams: int = 2
    layout: str = "IIFLII"
    window: int = 8
    positions: str = "expanded"
    objective: str = "final"
    shared_kv: bool = False
    mirror_skip: bool | None = None
    attn_impl: str = "fast"

    @property
    def mirror_skip_exact(self):
        return self.objective == "final" and self.kv_mirror

    @property
    def mirror_skip_on(self):
        """mirror_skip, or where it is None, whether it is exact (resolved here, never written back)."""
        return self.mirror_skip_exact if self.mirror_skip is None else self.mirror_skip

    @property
    def letters(self):
        """The letters a layout may hold: LETTERS' (below), which checks.py reads."""
        return "".join(LETTERS)


# -----------------------------------------------------------------------------
# The masks: one mask_mod each (HD §2.2). q_idx, kv_idx are expanded indices t.


full = causal  # M^full: plain causal over the expanded sequence, kv <= q (moe.py's one definition)


def local(window):
    def local_mask(b, h, q_idx, kv_idx):  # M^local: causal sliding window of `window` rows
        return (q_idx - kv_idx >= 0) & (q_idx - kv_idx < window)
    return local_mask


def intra(n):
    def intra_mask(b, h, q_idx, kv_idx):  # M^intra: causal within the query's own stream
        return (kv_idx <= q_idx) & (kv_idx % n == q_idx % n)
    return intra_mask


def shared_intra(n):
    """Shared-KV control (HD §5.2, PHD-like) for I layers when cfg.shared_kv. Our definition: a
    query at (token i, stream s) reads stream 0's K/V of tokens j < i (PHD keeps the original
    copy's) plus its own row (i, s): one K/V row per past token. n = 1: causal."""
    def shared_intra_mask(b, h, q_idx, kv_idx):
        return (kv_idx == q_idx) | ((kv_idx % n == 0) & (kv_idx // n < q_idx // n))
    return shared_intra_mask


def local_pairs(n, window, T, final_only):
    """An L layer's (query, key) pairs over T tokens: min(r + 1, window) summed over the query rows
    r, every row or the final stream's (r + 1 = n (t + 1): the first min(T, window // n) inside)."""
    if final_only:
        m = min(T, window // n)
        return n * m * (m + 1) // 2 + (T - m) * window
    N = n * T
    return N * (N + 1) // 2 if N <= window else window * (window + 1) // 2 + (N - window) * window


class Letter(NamedTuple):
    """One letter of a layout (HD §2.2): its mask_mod; how far back its keys reach (what a layer's
    cache keeps: None, every row); the keys query row r (an expanded index) sees; and those keys
    summed over T tokens' query rows, every row or the final stream's, in closed form."""
    mask: object  # (n, window, shared_kv) -> mask_mod
    reach: object  # window -> rows back, or None
    keys: object  # (n, window, r) -> keys
    pairs: object  # (n, window, T, final_only) -> (query, key) pairs


LETTERS = {  # the one table of the letters: the config's check, the cache, the FLOPs count and bench read it
    "F": Letter(mask=lambda n, window, shared_kv: full, reach=lambda window: None, keys=lambda n, window, r: r + 1,
                pairs=lambda n, window, T, final_only: n * T * (T + 1) // 2 if final_only else
                n * T * (n * T + 1) // 2),
    "L": Letter(mask=lambda n, window, shared_kv: local(window), reach=lambda window: window,
                keys=lambda n, window, r: min(r + 1, window), pairs=local_pairs),
    "I": Letter(mask=lambda n, window, shared_kv: shared_intra(n) if shared_kv else intra(n), reach=lambda window: None,
                keys=lambda n, window, r: r // n + 1,  # shared KV: its own row and stream 0's before it, as many
                pairs=lambda n, window, T, final_only: T * (T + 1) // 2 * (1 if final_only else n)),
}


def letter(kind):
    """The table's row of a layout letter, or one line refusing a letter it does not hold."""
    if kind not in LETTERS:
        raise ValueError(f"layout letter {kind!r} is none of {', '.join(LETTERS)}")
    return LETTERS[kind]


def layer_mask(cfg, i):
    """The mask_mod of layer i: its layout letter, and shared_kv for I layers."""
    return letter(cfg.layout[i]).mask(cfg.n_streams, cfg.window, cfg.shared_kv)


def streams_apart(cfg, i):
    """Whether layer i's queries read their own stream's keys alone (M^intra with each stream's own
    K/V): its n streams are then n causal sequences of their own (HD §3.2)."""
    return cfg.layout[i] == "I" and not cfg.shared_kv


def on_final_rows(mask_mod, n):
    """The same mask with query row r standing for expanded index r*n + n-1 (final stream)."""
    def final_rows_mask(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx * n + n - 1, kv_idx)
    return final_rows_mask


def final_stream(x, n, dim=1):
    """The final-stream rows t = i*n + n-1 of x along dim: the rows that predict (HD §2.1)."""
    return x.unflatten(dim, (-1, n)).select(dim + 1, n - 1)


# -----------------------------------------------------------------------------
# The model


@dataclass
class StreamPlan(LayerPlan):
    """moe.LayerPlan for n streams: `enter_skip` keeps only the final-stream rows from this block
    on (the KV-mirror skip); `kv_pos`: the keys' positions where they are not the queries' (under
    the skip the keys still come from every row of the source state)."""
    n: int = 1
    enter_skip: bool = False
    kv_pos: object = None

    def run(self, block, x, kv_u):
        if self.enter_skip:
            x = final_stream(x, self.n)
        return block(x, self.pos, self.mask, kv_u=kv_u, kv_pos=self.kv_pos, cache=self.cache)


class Rows:
    """One forward's rows as every layer's plan reads them, made once: the new rows' expanded
    indices t (after `start` cached tokens), the indices keys may come from (t_kv: every row so far,
    or the `keys` tokens a static cache returns whole, moe.cache_start), and the RoPE positions of
    every row and of the final-stream rows (moe.Positions: each table computed once; the fast
    paths add the streams' as batch rows, fold_pos, at the first layer that runs them apart)."""

    def __init__(self, cfg, B, L, start, keys, device):
        n = cfg.n_streams
        self.B, self.L, self.start, self.keys = B, L, start, keys
        self.t = start * n + torch.arange(L * n, device=device)
        self.t_kv = torch.arange((start + L if keys is None else keys) * n, device=device)
        self.ids = self.t if cfg.positions == "expanded" else self.t // n  # each row's RoPE position
        self.pos, self.final_pos = Positions(self.ids), Positions(final_stream(self.ids, n, 0))
        self.fold_pos = None


class HiddenDecoding(nn.Module):
    def __init__(self, cfg: HDConfig):
        super().__init__()
        self.cfg = cfg
        self.backbone = Transformer(cfg)
        del self.backbone.wte  # HD embeds with its own n tables, E_0 .. E_{n-1} (HD §2.1)
        self.tables = nn.ModuleList(nn.Embedding(cfg.vocab_size, cfg.n_embd) for _ in range(cfg.n_streams))
        for table in self.tables:
            nn.init.normal_(table.weight, std=0.02)

    def embed(self, idx):
        """S[t] = E_{s(t)}[x_{i(t)}]: (B, L) -> (B, L*n, C), rows interleaved t = i*n + k."""
        rows = torch.stack([table(idx) for table in self.tables], dim=2)  # (B, L, n, C)
        return rows.flatten(1, 2)

    def mirror_skip_from(self):
        """The first layer of the KV-mirror skip (HD §3.1), or None: from it on only final-stream
        rows are carried, their K/V still from every row of the source layer's input."""
        return self.cfg.mirrored.start if self.cfg.mirror_skip_on else None

    def kv_window(self, i):
        """How far back layer i's keys reach (its letter's reach: an L layer's window, which its cache
        keeps alone), or None: every row."""
        return letter(self.cfg.layout[i]).reach(self.cfg.window)

    def kv_rows_per_token(self, i):
        """K/V rows layer i's cache keeps per token (per batch row of the cache): the token's n
        stream rows; or one where the layer's streams run apart (streams_apart) and attn_impl "fast"
        runs them as batch rows of their own (each stream's row, or under the skip the final
        stream's alone: no query reads another's)."""
        return 1 if self.cfg.attn_impl == "fast" and streams_apart(self.cfg, i) else self.cfg.n_streams

    def hidden(self, idx, caches=None):
        """Final residual states: (B, L*n, C), or (B, L, C) final-stream rows under the skip."""
        return self.backbone.run_blocks(self.embed(idx), self.plans(idx, caches))

    def plans(self, idx, caches=None):
        """How each block runs a forward of idx (B, L) after the rows the caches hold (LayerPlans)."""
        cfg, dev = self.cfg, idx.device
        B, L = idx.shape
        start = 0 if caches is None else check_caches(caches, cfg.n_layer, cfg.block_size, self.kv_rows_per_token,
                                                       self.kv_window)
        check_length(start, L, cfg.block_size)
        check_flex(cfg.attn_impl, dev, cfg.head_dim)
        start, keys = cache_start(caches, start, self.kv_rows_per_token(0))  # keys: a static cache's tokens
        rows = Rows(cfg, B, L, start, keys, dev)
        return [self.layer_plan(i, rows, None if caches is None else caches[i]) for i in range(cfg.n_layer)]

    def layer_plan(self, i, rows, cache):
        """How block i runs (moe.LayerPlan): its letter's mask (layer_mask) as a dense matrix over
        the rows its queries and keys are, the reference; or the same by a faster path where one
        serves (fast_plan: the fast paths are at the end of the file)."""
        cfg, n, skip = self.cfg, self.cfg.n_streams, self.mirror_skip_from()
        final_only = skip is not None and i >= skip  # queries: the final-stream rows only
        fast = fast_plan(self, i, rows, cache, final_only)
        if fast is not None:
            return fast
        q_t = final_stream(rows.t, n, 0) if final_only else rows.t
        reach = self.kv_window(i) if cache is not None and rows.keys is None else None  # a cached L layer's
        t_kv = rows.t_kv if reach is None else rows.t_kv[max(0, rows.start * n - reach + 1):]  # window of rows
        # under the skip the keys still come from every row of the source state, at their positions
        return StreamPlan(rows.final_pos if final_only else rows.pos, dense_mask(layer_mask(cfg, i), q_t, t_kv), cache,
                          n, i == skip, kv_pos=rows.pos if final_only else None)

    def head(self, h):
        return self.backbone.lm_head(self.backbone.norm_f(h))

    def forward(self, idx, targets=None, caches=None):
        """idx (B, L) -> (logits (B, L, V) of each token's prediction, loss or None). objective
        "final": token i's final-stream row predicts x_{i+1} (HD §2.1, Eq. 1), the LM head on those
        L rows only; "all": every row of token i predicts it (logits still the final stream's);
        "sum": token i's n stream states summed, then normed and projected (HD §5.1)."""
        check_tokens(idx, targets, self.cfg.vocab_size)
        n = self.cfg.n_streams
        h = self.hidden(idx, caches)
        B, L = idx.shape
        if self.cfg.objective == "sum":
            logits = self.head(h.view(B, L, n, -1).sum(2))
        elif self.cfg.objective == "all" and targets is not None:
            all_logits = self.head(h)  # (B, L*n, V)
            loss = F.cross_entropy(upcast(all_logits.flatten(0, 1)),
                                   targets.repeat_interleave(n, dim=1).flatten(), ignore_index=-1)
            return final_stream(all_logits, n), loss
        else:  # under the skip, hidden returned the final-stream rows already
            logits = self.head(h if self.mirror_skip_from() is not None else final_stream(h, n))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(upcast(logits.flatten(0, 1)), targets.flatten(), ignore_index=-1)
        return logits, loss


# -----------------------------------------------------------------------------
# Progressive expansion (HD §2.3): copy embedding tables cyclically, keep the backbone


def expand_streams(model, n_new, **overrides):
    """A new model with n_new streams, E_k <- E_{k mod n} (n -> 2n gives E_{n+k} <- E_k).

    model: a HiddenDecoding, or a trained moe.Transformer (starting HD from an n = 1 backbone is
    the same operation: its wte is E_0). The backbone and LM head carry over unchanged.
    overrides: HDConfig fields of the new model (e.g. layout, objective); shape fields must match.
    """
    if not is_int(n_new) or n_new < 1:
        raise ValueError(f"n_new must be an int >= 1, got {n_new!r}")
    if overrides.get("n_streams", n_new) != n_new:
        raise ValueError(f"n_streams={overrides['n_streams']} contradicts n_new={n_new}: give n_new only")
    if isinstance(model, HiddenDecoding):
        cfg, tables = model.cfg, [t.weight for t in model.tables]
        body = model.backbone.state_dict()
        new_cfg = replace(cfg, **{**overrides, "n_streams": n_new})
    elif isinstance(model, Transformer):
        cfg, tables = model.cfg, [model.wte.weight]
        body = {k: v for k, v in model.state_dict().items() if not k.startswith("wte.")}
        new_cfg = HDConfig(**{**cfg.__dict__, "layout": "F" * cfg.n_layer, **overrides, "n_streams": n_new})
    else:
        raise ValueError(f"expand_streams takes a HiddenDecoding or a moe.Transformer, got {type(model).__name__}")
    n = len(tables)
    if n_new < n or n_new % n:
        raise ValueError(f"n_new must be a multiple of the current n_streams={n}, got {n_new}")
    new = HiddenDecoding(new_cfg).to(device=tables[0].device, dtype=tables[0].dtype).train(model.training)
    load_backbone(new, body, cfg)
    with torch.no_grad():
        for k, table in enumerate(new.tables):
            table.weight.copy_(tables[k % n])
    return new


def load_backbone(model, state_dict, source_cfg=None):
    """Load backbone weights (no wte) into model, raising ValueError on a shape mismatch."""
    if source_cfg is not None:
        for f in ("vocab_size", "n_layer", "n_embd", "n_head", "n_kv_head", "head_dim", "n_experts",
                  "expert_hidden", "ffn_hidden", "kv_mirror", "rope_fraction"):
            if getattr(source_cfg, f) != getattr(model.cfg, f):
                raise ValueError(f"checkpoint has {f}={getattr(source_cfg, f)}, model has {getattr(model.cfg, f)}")
    own = model.backbone.state_dict()
    missing, extra = set(own) - set(state_dict), set(state_dict) - set(own)
    if missing or extra:
        raise ValueError(f"checkpoint does not fit the backbone: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(extra)[:3]}")
    for k, v in state_dict.items():
        if v.shape != own[k].shape:
            raise ValueError(f"checkpoint tensor {k} has shape {tuple(v.shape)}, model {tuple(own[k].shape)}")
    model.backbone.load_state_dict(state_dict)


# -----------------------------------------------------------------------------
# The fast paths (HD §3.2): which attention path serves a layer, and folding streams into the batch


def fold(x, n):
    """(B, L*n, ...) interleaved rows -> (B*n, L, ...): stream k of batch b becomes batch b*n + k.
    The interleaved intra mask has no block sparsity (each 128x128 tile mixes all streams), so
    a BlockMask skips only what causal skips; folding makes each stream a causal sequence."""
    B, T = x.shape[:2]
    return x.view(B, T // n, n, *x.shape[2:]).transpose(1, 2).reshape(B * n, T // n, *x.shape[2:])


def unfold(x, n):
    """Inverse of fold."""
    Bn, L = x.shape[:2]
    return x.view(Bn // n, n, L, *x.shape[2:]).transpose(1, 2).reshape(Bn // n, L * n, *x.shape[2:])


BLOCK_MASKS = {}  # (mask parameters, query rows, key rows, device) -> BlockMask, for eager forwards
MAX_BLOCK_MASKS = 64


def block_mask(mask_mod, key, Tq, Tk, device):
    """mask_mod as a flex BlockMask, built once per (mask parameters `key`, lengths, device) and
    reused by every later forward of that shape: create_block_mask is some 90 kernels on CUDA.
    Inside a compiled graph it is traced with the model instead (a cached one would hold traced
    tensors)."""
    if torch.compiler.is_compiling():
        return create_block_mask(mask_mod, None, None, Tq, Tk, device=device)
    full_key = (key, Tq, Tk, str(device))
    if full_key not in BLOCK_MASKS:
        if len(BLOCK_MASKS) >= MAX_BLOCK_MASKS:
            BLOCK_MASKS.pop(next(iter(BLOCK_MASKS)))  # the oldest
        BLOCK_MASKS[full_key] = create_block_mask(mask_mod, None, None, Tq, Tk, device=device)
    return BLOCK_MASKS[full_key]


@dataclass
class FoldPlan(StreamPlan):
    """The plan of a layer whose streams run apart (streams_apart), on the fast path: each stream
    folded into a batch row of its own; or, `final_only` (under the skip), the final stream alone,
    its keys from the final stream's own rows of the source state."""
    final_only: bool = False

    def run(self, block, x, kv_u):
        n = self.n
        if self.enter_skip:
            x = final_stream(x, n)
        if self.final_only:
            return block(x, self.pos, self.mask, kv_u=final_stream(kv_u, n), kv_pos=self.kv_pos, cache=self.cache)
        x_f, u_f = block(fold(x, n), self.pos, self.mask, kv_u=None if kv_u is None else fold(kv_u, n),
                         cache=self.cache)
        return unfold(x_f, n), unfold(u_f, n)


def fast_plan(model, i, rows, cache, final_only):
    """layer_plan by the path attention_path chooses, or None for "dense" (the reference): "fold"
    (each stream a causal sequence of its own, new rows after `start` cached), "causal" (SDPA's
    causal kernel) or "block" (a flex BlockMask of the same mask)."""
    cfg, n, dev, enter_skip = model.cfg, model.cfg.n_streams, rows.t.device, i == model.mirror_skip_from()
    path = attention_path(cfg, i, final_only, dev, cached=cache is not None)
    if path == "dense":
        return None
    if path == "fold":
        mask = causal_after(rows.start, rows.L, dev, rows.keys)
        if final_only:  # the final stream alone, its K/V from its own rows of the source state
            return FoldPlan(rows.final_pos, mask, cache, n, enter_skip, kv_pos=rows.final_pos, final_only=True)
        if rows.fold_pos is None:  # the streams as batch rows: their RoPE tables, once per forward
            rows.fold_pos = Positions(fold(rows.ids.expand(rows.B, -1), n))
        return FoldPlan(rows.fold_pos, mask, cache, n, enter_skip)
    mod = layer_mask(cfg, i)
    if path == "causal":
        mask = "causal"
    else:  # "block"
        queries = len(final_stream(rows.t, n, 0)) if final_only else len(rows.t)
        mask = block_mask(on_final_rows(mod, n) if final_only else mod,
                          (cfg.layout[i], n, cfg.window, cfg.shared_kv, final_only), queries, len(rows.t_kv), dev)
    return StreamPlan(rows.final_pos if final_only else rows.pos, mask, cache, n, enter_skip,
                      kv_pos=rows.pos if final_only else None)


def attention_path(cfg, i, final_only, device, cached=False):
    """Which attention path serves layer i; decided here only. Every path equals the dense
    reference (the layer's mask_mod as a boolean matrix); test_hd.py checks each against it.

        "fold"    streams folded into the batch, each causal (HD §3.2)   fast: I
        "causal"  SDPA's causal kernel (M^full is plain causal)          fast: F, all rows, uncached
        "block"   a flex BlockMask                                       fast: the rest uncached, on CUDA
                                                                         (head_dim >= 16: flex's kernels)
        "dense"   a dense boolean mask                                   fast: the rest; "dense": all

    attn_impl "flex" gives every uncached layer "block" (cached ones "dense"). I means an I
    layer with per-stream K/V; shared-KV I layers are "the rest". final_only: the queries are
    the final-stream rows (a mirrored layer under the KV-mirror skip): "fold" then runs the
    final stream alone, and F is no longer square, so not "causal"."""
    if cfg.attn_impl != "fast":
        return "block" if cfg.attn_impl == "flex" and not cached else "dense"
    if streams_apart(cfg, i):
        return "fold"
    if cfg.layout[i] == "F" and not cached and not final_only:
        return "causal"
    return "block" if not cached and device.type == "cuda" and flex_fits(cfg.head_dim, device) else "dense"


# -----------------------------------------------------------------------------


def draw(mask_mod, n, L):
    """ASCII picture of a mask over the expanded sequence: row = query t, column = key t'."""
    t = torch.arange(n * L)
    m = dense_mask(mask_mod, t, t)
    lines = ["      " + " ".join(f"{i}{'abcdefgh'[k]}" for i in range(L) for k in range(n))]
    for q in range(n * L):
        label = f"{q // n}{'abcdefgh'[q % n]}"
        lines.append(f"  {label:>3} " + " ".join(" #" if m[q, kv] else " ." for kv in range(n * L)))
    return "\n".join(lines)


if __name__ == "__main__":
    demo_args(__doc__)
    n, L, w = 2, 4, 3
    print(f"Stream-Factorized Attention masks, n={n} streams, L={L} tokens (row 2b = token 2, stream b)")
    for name, mod in [("F full cross-stream", full), (f"L local cross-stream, window={w}", local(w)),
                      ("I intra-stream", intra(n)), ("I with shared KV (control)", shared_intra(n))]:
        print(f"\n{name}:\n{draw(mod, n, L)}")

    torch.manual_seed(0)
    cfg = HDConfig(n_streams=4, layout="IIFLII", window=8)
    model = HiddenDecoding(cfg).eval()
    idx = torch.randint(cfg.vocab_size, (2, 33))
    with torch.no_grad():
        logits, loss = model(idx[:, :-1], idx[:, 1:])
        ref = HiddenDecoding(replace(cfg, mirror_skip=False, attn_impl="dense"))
        ref.load_state_dict(model.state_dict())
        ref_logits, ref_loss = ref.eval()(idx[:, :-1], idx[:, 1:])
    print(f"\nHD n={cfg.n_streams} {cfg.layout} untrained: loss {loss:.4f} (uniform: ln {cfg.vocab_size})"
          f"; skip + fast paths vs dense reference: max |dlogits| {(logits - ref_logits).abs().max():.2e}")

