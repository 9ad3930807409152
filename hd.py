"""
Hidden Decoding: each token expanded into n streams, Stream-Factorized Attention.

Follows "Hidden Decoding at Scale: Latent Computation Scaling for Large Language Models"
(WeChat AI, arXiv 2607.08186, §2-3), with details the official model file describes. Built on
moe.py: the backbone's blocks run unchanged; this file adds the n embedding tables, the three
attention masks, the final-stream objective, progressive expansion, the KV-mirror final-stream
skip and cached decoding.

Indexing (0-based): token i, stream k, expanded index t = i*n + k, so i(t) = t // n and
s(t) = t % n. The expanded input is S[t] = E_{s(t)}[x_{i(t)}] (HD §2.1).

Each attention pattern is defined once, as a flex-style mask_mod (HD §2.2, Figure 3):
  F  full cross-stream:   kv <= q
  L  local cross-stream:  0 <= q - kv < window       (window counted in expanded positions)
  I  intra-stream:        kv <= q and kv % n == q % n
and every execution path derives from it: a dense boolean mask for SDPA (the reference, any
device, forward and backward), a flex_attention BlockMask (CUDA), and for I layers the
structural fast path "streams folded into the batch dimension + causal SDPA".

Run `python hd.py` to see the three masks drawn for n = 2, L = 4 (as in HD Figure 3) and a
tiny model's loss, skip and decoding.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from moe import (KVCache, ModelConfig, Transformer, attend, cached_generate, check_flex, check_tokens, dense_mask,
                 upcast)

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
                 rows. None = on where exact (objective "final" with kv_mirror). Exact for
                 every logit and gradient; not for loss-free balancing: under the skip a
                 mirrored layer's router counts only the final-stream rows (the rows that reach
                 the loss), without it also the other streams' rows there, whose outputs reach
                 nothing. The two trainings' router biases therefore drift apart. This project
                 keeps the skip's counts: the loads the skipped rows would have produced are not
                 computed, and balancing the experts for rows that feed no output buys nothing.
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

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.n_streams, bool) or not isinstance(self.n_streams, int) or self.n_streams < 1:
            raise ValueError(f"n_streams must be an int >= 1, got {self.n_streams!r}")
        if not isinstance(self.layout, str):
            raise ValueError(f"layout must be a string of F, L or I, one per layer, got {self.layout!r}")
        if len(self.layout) != self.n_layer:
            raise ValueError(f"layout must have one letter per layer ({self.n_layer}), got {self.layout!r}")
        if set(self.layout) - set("FLI"):
            raise ValueError(f"layout letters must be F, L or I, got {self.layout!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")
        if self.positions not in ("expanded", "token"):
            raise ValueError(f"positions must be 'expanded' or 'token', got {self.positions!r}")
        if self.objective not in ("final", "all", "sum"):
            raise ValueError(f"objective must be 'final', 'all' or 'sum', got {self.objective!r}")
        if self.attn_impl not in ("fast", "dense", "flex"):
            raise ValueError(f"attn_impl must be 'fast', 'dense' or 'flex', got {self.attn_impl!r}")
        if self.shared_kv and "I" not in self.layout:
            raise ValueError(f"shared_kv changes only intra-stream (I) layers; layout {self.layout!r} has none")
        if self.mirror_skip not in (None, True, False):
            raise ValueError(f"mirror_skip must be None, True or False, got {self.mirror_skip!r}")
        if self.mirror_skip and not self.skip_is_exact:
            raise ValueError("mirror_skip is exact only with objective='final' and kv_mirror=True "
                             f"(got objective={self.objective!r}, kv_mirror={self.kv_mirror})")

    @property
    def skip_is_exact(self):
        return self.objective == "final" and self.kv_mirror

    @property
    def final_stream_skip(self):
        """Whether the skip is on: mirror_skip, or where it is None, wherever it is exact.
        (Resolved here, not written back, so the config copies and replaces like any dataclass.)"""
        return self.skip_is_exact if self.mirror_skip is None else self.mirror_skip


# -----------------------------------------------------------------------------
# The masks: one mask_mod each (HD §2.2). q_idx, kv_idx are expanded indices t.


def full():
    def full_mask(b, h, q_idx, kv_idx):  # M^full: plain causal over the expanded sequence
        return kv_idx <= q_idx
    return full_mask


def local(window):
    def local_mask(b, h, q_idx, kv_idx):  # M^local: causal sliding window of `window` rows
        return (q_idx - kv_idx >= 0) & (q_idx - kv_idx < window)
    return local_mask


def intra(n):
    def intra_mask(b, h, q_idx, kv_idx):  # M^intra: causal within the query's own stream
        return (kv_idx <= q_idx) & (kv_idx % n == q_idx % n)
    return intra_mask


def shared_intra(n):
    """Shared-KV control (HD §5.2, PHD-like), used in place of intra when cfg.shared_kv. Our
    definition: the shared per-token K/V is stream 0's (as PHD keeps only the original copy's
    KV). A query at (token i, stream s) reads stream 0's K/V of tokens j < i plus its own row
    (i, s); streams stay separate trajectories and only one K/V row per past token has to be
    retained. n = 1: causal."""
    def shared_intra_mask(b, h, q_idx, kv_idx):
        return (kv_idx == q_idx) | ((kv_idx % n == 0) & (kv_idx // n < q_idx // n))
    return shared_intra_mask


def layer_mask(cfg, i):
    """The mask_mod of layer i: its layout letter, and shared_kv for I layers."""
    kind, n = cfg.layout[i], cfg.n_streams
    if kind == "F":
        return full()
    if kind == "L":
        return local(cfg.window)
    return shared_intra(n) if cfg.shared_kv else intra(n)


def on_final_rows(mask_mod, n):
    """The same mask with query row r standing for expanded index r*n + n-1 (final stream)."""
    def final_rows_mask(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx * n + n - 1, kv_idx)
    return final_rows_mask


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


class StreamCache(KVCache):
    """The KV cache of an intra-stream (I) layer in cached decoding: every stream's rows are
    kept, grouped by stream, (B, n, Hkv, block_size, hd), and written in place. update takes
    the new rows interleaved (t = i*n + k, as the layer computes them) and returns each
    stream's rows as one view, (B*n, Hkv, S, hd) for the S tokens so far, so reading them
    copies nothing. (An interleaved cache would have to be regrouped by stream, a copy of
    every cached row, at every step.) len() counts rows, as KVCache's does."""

    def __init__(self, n, block_size):
        super().__init__(n * block_size)
        self.n, self.tokens = n, block_size

    def update(self, k, v):
        n, (B, H, rows, D) = self.n, k.shape
        if self.len + rows > self.capacity:
            raise ValueError(f"KV cache full: it holds {self.tokens} tokens x {n} streams, {self.len // n} tokens "
                             f"are written and {rows // n} more do not fit")
        if self.k is None:
            self.k, self.v = (x.new_zeros(B, n, H, self.tokens, D) for x in (k, v))
        S, L = self.len // n, rows // n
        for buf, x in ((self.k, k), (self.v, v)):  # (B, H, L*n, D) -> (B, n, H, L, D), into place
            buf[:, :, :, S:S + L] = x.view(B, H, L, n, D).permute(0, 3, 1, 2, 4)
        self.len += rows
        return (buf.view(B * n, H, self.tokens, D)[:, :, :S + L] for buf in (self.k, self.v))


class OwnStream:
    """Intra-stream attention in cached decoding (HD §3.2): each new row reads only its own
    stream's rows, which a StreamCache hands over grouped by stream, (B*n, h, S, d): each query
    meets S keys (the S tokens so far) instead of n*S keys under a mask that discards (n-1)/n
    of them. Passed to attend in place of a mask. final_only: the queries are final-stream rows
    only (the KV-mirror skip), which read the final stream's keys."""

    def __init__(self, n, final_only):
        self.n, self.final_only = n, final_only

    def __call__(self, q, k, v):
        n, B = self.n, q.size(0)
        S = k.size(2)  # tokens with rows in the cache, the new ones included
        Lq = q.size(2) if self.final_only else q.size(2) // n  # new tokens
        # new token j is token S - Lq + j: it sees tokens <= itself (all of them when Lq = 1)
        mask = None if Lq == 1 else torch.arange(S, device=q.device) <= torch.arange(S - Lq, S, device=q.device)[:, None]
        if self.final_only:
            final = lambda x: x.view(B, n, *x.shape[1:])[:, n - 1]  # (B*n, h, S, d) -> stream n-1's (B, h, S, d)
            return attend(q, final(k), final(v), mask)
        by_stream = lambda x: fold(x.transpose(1, 2), n).transpose(1, 2)  # (B, h, L*n, d) -> (B*n, h, L, d)
        y = attend(by_stream(q), k, v, mask)
        return unfold(y.transpose(1, 2), n).transpose(1, 2)


class Recent:
    """Sliding-window (L) attention in cached decoding: only the cache rows some new row can
    still reach are read (from `window` - 1 rows before the first new row on), not all of them."""

    def __init__(self, mask_mod, q_t, first_new, window):
        self.mask_mod, self.q_t, self.first = mask_mod, q_t, max(0, first_new - window + 1)

    def __call__(self, q, k, v):
        t_kv = torch.arange(self.first, k.size(2), device=q.device)
        return attend(q, k[:, :, self.first:], v[:, :, self.first:], dense_mask(self.mask_mod, self.q_t, t_kv))


class Rows:
    """The rows of one forward: expanded indices t of the new rows (after `start` cached ones),
    of every key row, their RoPE positions, the final-stream rows among the new ones, and the
    masks of each layer (BlockMasks built once per forward, shared by layers of one type)."""

    def __init__(self, cfg, start, L, device):
        self.cfg, self.device, self.start, n = cfg, device, start, cfg.n_streams
        self.t = torch.arange(start, start + L * n, device=device)  # expanded indices of the new rows
        self.t_kv = torch.arange(start + L * n, device=device)  # every row the keys may come from
        self.pos = self.t if cfg.positions == "expanded" else self.t // n
        self.final = slice(n - 1, None, n)  # final-stream rows among the new ones
        self.block_masks = {}

    def mask(self, i, final_only, path):
        """Layer i's mask for the new rows (or their final-stream rows) against every key row,
        in the form `path` names (attention_path): "own", "recent", "dense" or "block"."""
        cfg, mod = self.cfg, layer_mask(self.cfg, i)
        q_t = self.t[self.final] if final_only else self.t
        if path == "own":
            return OwnStream(cfg.n_streams, final_only)
        if path == "recent":
            return Recent(mod, q_t, self.start, cfg.window)
        if path == "dense":
            return dense_mask(mod, q_t, self.t_kv)
        key = (cfg.layout[i], final_only)
        if key not in self.block_masks:
            mod = on_final_rows(mod, cfg.n_streams) if final_only else mod
            self.block_masks[key] = create_block_mask(mod, None, None, len(q_t), len(self.t_kv), device=self.device)
        return self.block_masks[key]


def attention_path(cfg, i, cached, final_only, device):
    """Which attention path serves layer i. Every path equals the dense reference (the layer's
    mask_mod as a boolean matrix); test_hd.py checks each against it.

        "causal"  SDPA's causal kernel (M^full is plain causal)      fast: F, uncached, all rows
        "fold"    streams folded into the batch, each causal          fast: I, uncached
        "own"     OwnStream: a row reads its own stream's cache rows  fast: I, cached
        "recent"  Recent: only the cache rows the window reaches      fast: L, cached
        "block"   a flex BlockMask                                    fast: the rest uncached, on CUDA
        "dense"   a dense boolean mask                                fast: the rest; "dense": all

    With attn_impl "flex" every uncached layer takes "block", cached ones "dense". I means an I
    layer with per-stream K/V; shared-KV I layers are "the rest". final_only: the queries are
    the final-stream rows (a mirrored layer under the KV-mirror skip; "fold" then runs the
    final stream alone, and F is no longer square, so not "causal"). device is read only for
    uncached layers (make_caches passes None)."""
    letter = cfg.layout[i]
    if cfg.attn_impl != "fast":
        return "block" if cfg.attn_impl == "flex" and not cached else "dense"
    if letter == "I" and not cfg.shared_kv:
        return "own" if cached else "fold"
    if letter == "L" and cached:
        return "recent"
    if letter == "F" and not cached and not final_only:
        return "causal"
    return "block" if not cached and device.type == "cuda" else "dense"


# -----------------------------------------------------------------------------
# The model


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

    # Which attention path serves each layer: attention_path. The skip (HD §3.1): mirrored
    # layers are the last n_layer // 3 (moe.py), so from the first of them on only the
    # final-stream rows are carried; their K/V still come from every row of the source
    # layer's input.

    def skip_from(self):
        """Index of the first layer that runs final-stream rows only, or None (no skip)."""
        return self.cfg.n_layer - self.cfg.n_layer // 3 if self.cfg.final_stream_skip else None

    def make_caches(self):
        """One KV cache per layer for cached decoding, room for block_size tokens (n rows each):
        a StreamCache where the layer reads its own stream ("own"), else an interleaved KVCache."""
        cfg, skip = self.cfg, self.skip_from()
        return [StreamCache(cfg.n_streams, cfg.block_size)
                if attention_path(cfg, i, True, skip is not None and i >= skip, None) == "own"
                else KVCache(cfg.n_streams * cfg.block_size) for i in range(cfg.n_layer)]

    def hidden(self, idx, caches=None):
        """Final residual states: (B, L*n, C), or (B, L, C) final-stream rows under the skip."""
        cfg, n = self.cfg, self.cfg.n_streams
        B, L = idx.shape
        start = 0 if caches is None else len(caches[0])  # rows already cached
        if start // n + L > cfg.block_size:
            raise ValueError(f"sequence of {start // n + L} tokens exceeds block_size={cfg.block_size}")
        check_flex(cfg.attn_impl, idx.device)
        rows = Rows(cfg, start, L, idx.device)
        skip = self.skip_from()

        def layer(i, block, x, kv_u):
            cache = None if caches is None else caches[i]
            final_only = skip is not None and i >= skip  # queries: the final-stream rows only
            if i == skip:
                x = x[:, rows.final]
            path = attention_path(cfg, i, cache is not None, final_only, idx.device)
            if (path == "own") != isinstance(cache, StreamCache):
                raise ValueError(f"layer {i}'s cache is a {type(cache).__name__}, its cached path needs "
                                 f"{'a StreamCache' if path == 'own' else 'a KVCache'}: take caches from "
                                 "model.make_caches()")
            if final_only:  # queries: final-stream rows; keys: every row's (the source layer's input)
                q_pos = rows.pos[rows.final]
                if path == "fold":  # the final stream attends to its own rows only
                    return block(x, q_pos, "causal", kv_u=kv_u[:, rows.final], kv_pos=q_pos)
                return block(x, q_pos, rows.mask(i, True, path), kv_u=kv_u, kv_pos=rows.pos, cache=cache)
            if path == "causal":
                return block(x, rows.pos, "causal", kv_u=kv_u)
            if path == "fold":
                x_f, u_f = block(fold(x, n), fold(rows.pos.expand(B, -1), n), "causal",
                                 kv_u=None if kv_u is None else fold(kv_u, n))
                return unfold(x_f, n), unfold(u_f, n)
            return block(x, rows.pos, rows.mask(i, False, path), kv_u=kv_u, cache=cache)

        return self.backbone.run_blocks(self.embed(idx), layer)

    def head(self, h):
        return self.backbone.lm_head(self.backbone.norm_f(h))

    def forward(self, idx, targets=None, caches=None):
        """idx (B, L) -> (logits (B, L, V) of each token's prediction, loss or None).

        objective "final": the final-stream row of token i predicts x_{i+1} (HD §2.1, Eq. 1);
        the LM head runs on those L rows only. "all": every row of token i predicts x_{i+1}
        (the returned logits are still the final stream's). "sum": the n stream states of
        token i are summed, then normed and projected (HD §5.1).
        """
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
            return all_logits[:, n - 1::n], loss
        else:  # under the skip, hidden returned the final-stream rows already
            logits = self.head(h if self.skip_from() is not None else h[:, n - 1::n])
        loss = None
        if targets is not None:
            loss = F.cross_entropy(upcast(logits.flatten(0, 1)), targets.flatten(), ignore_index=-1)
        return logits, loss

    def generate(self, idx, max_new_tokens, temperature=1.0, sample_top_k=None, generator=None):
        """Cached decoding (HD §3.2): each new token enters as its n stream rows in one step
        (forward does that); all n rows are cached in every layer; the final stream's logits
        pick the next token."""
        return cached_generate(self, idx, max_new_tokens, temperature, sample_top_k, generator)


# -----------------------------------------------------------------------------
# Progressive expansion (HD §2.3): copy embedding tables cyclically, keep the backbone


def expand_streams(model, n_new, **overrides):
    """A new model with n_new streams, E_k <- E_{k mod n} (n -> 2n gives E_{n+k} <- E_k).

    model: a HiddenDecoding, or a trained moe.Transformer (starting HD from an n = 1 backbone is
    the same operation: its wte is E_0). The backbone and LM head carry over unchanged.
    overrides: HDConfig fields of the new model (e.g. layout, objective); shape fields must match.
    """
    if isinstance(n_new, bool) or not isinstance(n_new, int) or n_new < 1:
        raise ValueError(f"n_new must be an int >= 1, got {n_new!r}")
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
    n, L, w = 2, 4, 3
    print(f"Stream-Factorized Attention masks, n={n} streams, L={L} tokens (row 2b = token 2, stream b)")
    for name, mod in [("F full cross-stream", full()), (f"L local cross-stream, window={w}", local(w)),
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
    print(f"\nHD n={cfg.n_streams}, layout {cfg.layout}: loss {loss.item():.4f}; KV-mirror skip + fast paths vs "
          f"all-stream dense reference: max |dlogits| = {(logits - ref_logits).abs().max().item():.2e}")
    out = model.generate(idx[:1, :8], 12, temperature=0)
    print(f"cached greedy decoding: {idx[0, :8].tolist()} -> {out[0, 8:].tolist()}")
