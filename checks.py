"""
Input checks for moe.py, hd.py and tah.py, kept out of the method files.

Each config has one table: field -> rules, each a test (value, config) -> bool and what the
value must be, so a failure reads "<field> must be <what>, got <value>"; a rule may read the
fields before its own. Tensor inputs are checked by the functions at the end: types and shapes
always, values only where it is free (on CPU: on CUDA a min or max waits for the device).
Sizes go through one rule (check_fits, check_buffer) before anything is allocated. A model's
weights are the caller's: NaN weights give NaN logits without a word here (the trainer stops on a
non-finite loss or weights, and sampling refuses non-finite logits).
"""

import argparse
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import fields

import torch
from torch.nn.attention.flex_attention import BlockMask


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


MAX_INT = 2**53  # every count: an int that float64 and torch's int64 hold exactly


def count(lo=1):
    return lambda v, c: is_int(v) and lo <= v <= MAX_INT, f"an int in [{lo}, 2**53]"


def number(test, says):
    return lambda v, c: is_num(v) and test(v), says


def one_of(*options):  # `is` for True/False/None, so 1 does not pass for True
    return (lambda v, c: any(v is o or (type(v) is type(o) and v == o) for o in options),
            " or ".join(map(repr, options)))


def rule(test, says):
    return lambda v, c: test(v, c), says


FLAG = one_of(True, False)

MODEL = {
    "vocab_size": [count()], "block_size": [count()], "n_layer": [count()], "n_embd": [count()],
    "n_head": [count()],
    "n_kv_head": [count(), rule(lambda v, c: c.n_head % v == 0, "a divisor of n_head ({c.n_head})")],
    "head_dim": [count()],
    "rope_fraction": [number(lambda v: 0 < v <= 1, "a number in (0, 1]"),
                      rule(lambda v, c: c.rope_dim >= 2 and c.rope_dim % 2 == 0,
                           "such that rope_fraction * head_dim rounds to an even number >= 2 "
                           "(* {c.head_dim} -> {c.rope_dim})")],
    "rope_base": [number(lambda v: v > 1, "a finite number > 1")],
    "n_experts": [count(0)],
    "top_k": [rule(lambda v, c: c.n_experts == 0 or is_int(v) and 1 <= v <= c.n_experts,
                   "an int in [1, n_experts={c.n_experts}]")],
    "expert_hidden": [count()], "ffn_hidden": [count()],
    "balance_gamma": [number(lambda v: v >= 0, "a finite number >= 0")],
    "moe_dispatch": [one_of("auto", "gather", "masked", "grouped_mm", "loop")],
    "kv_mirror": [FLAG, rule(lambda v, c: not v or c.n_layer >= 3,
                             "False when n_layer < 3 (it needs a first and a last third; n_layer={c.n_layer})")],
    "norm_eps": [number(lambda v: v > 0, "a finite number > 0")],
}

HD = {**MODEL,
      "n_streams": [count()],
      "layout": [rule(lambda v, c: isinstance(v, str) and len(v) == c.n_layer and not set(v) - set(c.letters),
                      "a string of the letters {c.letters} (hd.LETTERS), one letter per layer ({c.n_layer})")],
      "window": [count()],
      "positions": [one_of("expanded", "token")],
      "objective": [one_of("final", "all", "sum")],
      "shared_kv": [FLAG, rule(lambda v, c: not v or "I" in c.layout,
                               "False for a layout without I layers (it changes only those)")],
      "mirror_skip": [one_of(None, True, False),
                      rule(lambda v, c: not v or c.mirror_skip_exact,
                           "None or False unless objective='final' and kv_mirror=True (only there is it exact)")],
      "attn_impl": [one_of("fast", "dense", "flex")]}

TAH = {**MODEL,
       "max_depth": [count()], "lora_rank": [count()],
       "lora_alpha": [number(lambda v: v > 0, "a finite number > 0")],
       "logit_topk": [rule(lambda v, c: is_int(v) and 1 <= v <= c.vocab_size, "an int in [1, vocab_size={c.vocab_size}]")],
       "threshold": [number(lambda v: 0 < v < 1, "a number in (0, 1)")],
       "decider_layers": [rule(lambda v, c: isinstance(v, (tuple, list)) and all(is_int(l) and 0 <= l <= c.n_layer for l in v),
                               "a tuple of hidden-state indices in [0, n_layer={c.n_layer}] (0: the pass's input)")],
       "decider_hidden": [count()],
       "attention": [one_of("duo", "first_depth", "depth_local")],
       "gather": [FLAG],
       "attn_impl": [one_of("dense", "flex")]}

TABLES = {"ModelConfig": MODEL, "HDConfig": HD, "TaHConfig": TAH}


def table_of(cfg):
    return next(TABLES[k.__name__] for k in type(cfg).__mro__ if k.__name__ in TABLES)


def check_config(cfg):
    """Run cfg's table: the first rule a field fails raises one ValueError naming the field; then
    the one rule for sizes (check_fits), before anything is allocated."""
    table = table_of(cfg)
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        for test, says in table[f.name]:
            if not test(v, cfg):
                raise ValueError(f"{f.name} must be {says.format(c=cfg)}, got {v!r}")
    check_fits(cfg)


# -----------------------------------------------------------------------------
# The one rule for sizes: a configuration whose parameters and activations cannot fit the machine
# is refused before anything is allocated or written, with the estimate and the limit.


def parameters(cfg):
    """The parameter count of the model cfg builds, from its shapes (test_checks.py checks it)."""
    C, H, Hkv, hd, V, L = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.vocab_size, cfg.n_layer
    attn = [(C, H * hd), (C, Hkv * hd), (C, Hkv * hd), (C, H), (H * hd, C)]  # q, k, v, gate, o as (in, out)
    E, I = cfg.n_experts, cfg.expert_hidden
    ffn = [(C, I), (C, I), (I, C)] if E else [(C, cfg.ffn_hidden)] * 2 + [(cfg.ffn_hidden, C)]  # shared / dense
    block = sum(i * o for i, o in attn + ffn) + hd + 2 * C + (E * (C + 3 * C * I) if E else 0)
    n = 2 * V * C + L * block + C + (getattr(cfg, "n_streams", 1) - 1) * V * C
    if hasattr(cfg, "max_depth"):  # TaH: LoRA on every block linear, the decider
        n += L * cfg.lora_rank * sum(i + o for i, o in attn + ffn)  # the router keeps no adapter
        D, K = cfg.decider_hidden, cfg.logit_topk
        n += (K + 1) * C + (C * (len(cfg.decider_states) + 1) + 1) * D + (D + 1) * D + D + 1
    return n


def activations(cfg, batch=1, scores=False):
    """Elements a forward of `batch` sequences keeps, roughly: per row (token x stream, x pass) and
    layer ~16 C plus the heads and the experts' hidden, the logits, and with `scores` the dense
    path's attention scores (a training step on the dense reference)."""
    rows = batch * cfg.block_size * getattr(cfg, "n_streams", 1) * getattr(cfg, "max_depth", 1)
    hidden = 3 * (cfg.top_k * cfg.expert_hidden + cfg.expert_hidden) if cfg.n_experts else 3 * cfg.ffn_hidden
    per_row = 16 * cfg.n_embd + 3 * (cfg.n_head + cfg.n_kv_head) * cfg.head_dim + hidden
    return rows * cfg.n_layer * (per_row + scores * cfg.n_head * rows // batch) + rows * cfg.vocab_size


def memory_limit(device="cpu"):
    """Bytes the device has: the GPU's memory, or the machine's physical memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(cfg, batch=1, training=False, device="cpu", sharing=1):
    """The one rule for sizes: float32 parameters (x4 training: gradients, AdamW's moments) and
    the activations at `batch` must fit the device's memory, or its share of it when `sharing`
    processes each hold such a model on it (train_tiny.py's --jobs)."""
    need = 4 * (parameters(cfg) * (4 if training else 1) + activations(cfg, batch, scores=training))
    limit = memory_limit(device) / sharing
    if need > limit:
        share = f" ({sharing} processes share its {memory_limit(device) / 2**30:,.1f})" if sharing > 1 else ""
        raise ValueError(f"this configuration needs ~{need / 2**30:,.3g} GiB ({parameters(cfg):,} parameters, "
                         f"activations of {batch} sequence(s) of block_size {cfg.block_size}) and the "
                         f"{torch.device(device).type} has {limit / 2**30:,.1f} GiB{share}: make it smaller")


def check_buffer(shape, dtype, device, what):
    """A buffer about to be allocated (a cache's rows) within the device's memory: the size rule,
    before the allocator meets it. Inside a compiled graph it is not taken (a compiled step reads
    no host value; the eager first call has allocated its buffers)."""
    if torch.compiler.is_compiling():
        return
    need = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if need > memory_limit(device):
        raise ValueError(f"{what} of shape {tuple(shape)} needs ~{need / 2**30:,.3g} GiB and the "
                         f"{torch.device(device).type} has {memory_limit(device) / 2**30:,.1f} GiB: make it smaller")


# -----------------------------------------------------------------------------
# Tensor inputs


RECORDING = []  # non-empty while a step that will be replayed runs (recorded_step)


@contextmanager
def recorded_step():
    """Within: the step being run will be replayed, as a CUDA graph replays its capture (generate.py
    runs a graph's warm-up and its capture inside): it takes static shapes and reads no value on
    the host, exactly as the capture will, so the warm-up runs the very kernels the graph records."""
    RECORDING.append(True)
    try:
        yield
    finally:
        RECORDING.pop()


def static_step(device):
    """Whether this step must take static shapes and read no value on the host: compiled, recorded
    for replay (recorded_step), or captured by a CUDA graph (which can wait on nothing)."""
    return (torch.compiler.is_compiling() or bool(RECORDING)
            or device.type == "cuda" and torch.cuda.is_current_stream_capturing())



def check_tokens(idx, targets, vocab_size, values=None):
    """idx (B, T) int64/int32 ids in [0, vocab_size); targets None or int64 of idx's shape, ids or
    -1 (ignored), not all -1. The ids themselves only where reading them is free (values=None:
    on CPU, not compiled); elsewhere the embedding checks them, and the trainer stops on a nan."""
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"idx must be an integer tensor of token ids (int64 or int32, as nn.Embedding takes), "
                         f"got {getattr(idx, 'dtype', type(idx))}")
    if idx.dim() != 2 or idx.numel() == 0:
        raise ValueError(f"idx must have shape (B, T) with B, T >= 1, got {tuple(idx.shape)}")
    if idx.device.type == "meta":
        raise ValueError("idx is on the meta device, which holds no values: give token ids on the model's device")
    if targets is not None:
        if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64:
            raise ValueError(f"targets must be an integer tensor (int64, as cross_entropy takes), "
                             f"got {getattr(targets, 'dtype', type(targets))}")
        if targets.shape != idx.shape:
            raise ValueError(f"targets must have idx's shape {tuple(idx.shape)}, got {tuple(targets.shape)}")
    if not (idx.device.type == "cpu" if values is None else values) or static_step(idx.device):
        return  # compiled or recorded: a branch on a value would break the graph; the embedding checks its ids
    if idx.min() < 0 or idx.max() >= vocab_size:
        raise ValueError(f"idx must hold ids in [0, vocab_size={vocab_size}), got [{idx.min().item()}, {idx.max().item()}]")
    if targets is not None and (targets.min() < -1 or targets.max() >= vocab_size):
        raise ValueError(f"targets must be ids in [0, vocab_size={vocab_size}) or -1 (ignored), got "
                         f"[{targets.min().item()}, {targets.max().item()}]")
    if targets is not None and (targets == -1).all():
        raise ValueError("every target is -1 (ignored): the loss would be 0/0")


FLEX_MIN_HEAD_DIM = 16  # inductor's flex kernels on CUDA: "tl.dot does not support embedding size less than 16"


def flex_fits(head_dim, device):
    """Whether flex_attention runs this head width on this device: CUDA's fused kernels need 16."""
    return device.type != "cuda" or head_dim >= FLEX_MIN_HEAD_DIM


def check_flex(attn_impl, device, head_dim):
    """An explicit attn_impl='flex' that the device cannot run, said before torch fails inside it:
    flex_attention has no backward on CPU (torch 2.13), and on CUDA needs head_dim >= 16."""
    if attn_impl == "flex" and device.type == "cpu" and torch.is_grad_enabled():
        raise ValueError("attn_impl='flex' runs forward only on CPU (torch has no flex_attention backward "
                         "there): call it under torch.no_grad(), or train with the default attn_impl")
    if attn_impl == "flex" and not flex_fits(head_dim, device):
        raise ValueError(f"attn_impl='flex' needs head_dim >= {FLEX_MIN_HEAD_DIM} on CUDA (flex_attention's "
                         f"kernels), got {head_dim}: raise head_dim, or use attn_impl 'fast' (dense masks below 16)")


def check_length(start, T, block_size, unit="tokens"):
    """A forward of T new positions after `start` cached ones fits the model's block_size."""
    if start + T > block_size:
        raise ValueError(f"sequence of {start + T} {unit} exceeds block_size={block_size}")


def check_caches(caches, n_layer, block_size, rows_per_token=lambda i: 1, window=lambda i: None):
    """A forward's caches, one per layer as generate.make_caches gives them; returns the tokens
    they hold."""
    if (not isinstance(caches, (list, tuple)) or len(caches) != n_layer
            or not all(hasattr(c, "update") and hasattr(c, "__len__") for c in caches)):
        raise ValueError(f"caches must be a list of one KV cache per layer ({n_layer}): take them from "
                         f"generate.make_caches(model); got {type(caches).__name__} of "
                         f"{[type(c).__name__ for c in caches] if isinstance(caches, (list, tuple)) else '?'}")
    tokens = len(caches[0]) // rows_per_token(0)
    for i, c in enumerate(caches):
        r = rows_per_token(i)
        if getattr(c, "window", None) != window(i):
            keeps, reads = (f"the last {w} rows" if w else "every row" for w in (getattr(c, "window", None), window(i)))
            raise ValueError(f"cache {i} keeps {keeps}, layer {i} reads {reads}: take caches from "
                             "generate.make_caches(model)")
        if len(c) != tokens * r or getattr(c, "capacity", block_size * r) < block_size * r:
            raise ValueError(f"cache {i} does not fit layer {i} of this model (it holds {len(c)} rows, room for "
                             f"{getattr(c, 'capacity', '?')}; the layer keeps {r} per token): take caches from "
                             "generate.make_caches(model)")
    return tokens


def check_depths(name, depths, like, max_depth):
    """Integer passes per token, of idx's shape, in [1, max_depth] (on CUDA an assert the device checks)."""
    if not isinstance(depths, torch.Tensor) or depths.shape != like.shape:
        raise ValueError(f"{name} needs depths of the same shape as idx {tuple(like.shape)}")
    if depths.dtype.is_floating_point or depths.dtype == torch.bool:
        raise ValueError(f"depths must be integers (passes per token), got {depths.dtype}")
    if depths.device.type != "cpu":
        torch._assert_async((depths >= 1).all() & (depths <= max_depth).all(),
                            f"depths must be in [1, max_depth={max_depth}]")
    elif depths.min() < 1 or depths.max() > max_depth:
        raise ValueError(f"depths must be in [1, max_depth={max_depth}], got "
                         f"[{depths.min().item()}, {depths.max().item()}]")


TAH_CACHE_CALLS = ("batch", "reserve", "add", "lookups", "len", "layers")  # what tah.DepthKV's docstring lists


def check_routing(cfg, modes, idx, targets, mode, depths, cache, threshold):
    """ThinkAtHard.forward's inputs: a known mode, token ids, the oracle's depths, a TaH cache of
    idx's batch size and layers, a threshold in (0, 1) or None."""
    if mode not in modes:
        raise ValueError(f"mode must be one of {modes}, got {mode!r}")
    if cache is not None and not all(hasattr(cache, a) for a in TAH_CACHE_CALLS):
        raise ValueError(f"cache must be None or one TaH cache for the whole model (tah.DepthKV, or generate.TaHCache "
                         f"for decoding), got {type(cache).__name__}")
    if cache is not None and len(cache.layers) != cfg.n_layer:
        raise ValueError(f"the cache was made for {len(cache.layers)} layer(s), this model has {cfg.n_layer}")
    check_tokens(idx, targets, cfg.vocab_size)
    check_flex(cfg.attn_impl, idx.device, cfg.head_dim)
    if mode == "oracle":
        check_depths("mode 'oracle'", depths, idx, cfg.max_depth)
    if cache is not None and cache.batch != idx.size(0):
        raise ValueError(f"the cache holds {cache.batch} batch rows, idx has {idx.size(0)}")
    if threshold is not None and not (is_num(threshold) and 0 < threshold < 1):
        raise ValueError(f"threshold must be None or a number in (0, 1), got {threshold!r}")


def check_stage2(cfg, idx, depths, pos_weight):
    if cfg.max_depth < 2:
        raise ValueError("stage2_loss needs max_depth >= 2: with one pass there is no decision to learn")
    check_depths("stage2_loss", depths, idx, cfg.max_depth)
    if pos_weight is not None and not (is_num(pos_weight) and pos_weight > 0):
        raise ValueError(f"pos_weight must be None or a finite number > 0, got {pos_weight!r}")


def check_oracle(ref_logits, targets, max_depth, response):
    """oracle_depths' inputs: logits (B, T, V), targets (B, T), a count max_depth, response (B, T) bool or None."""
    if not is_int(max_depth) or max_depth < 1:
        raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")
    if not isinstance(targets, torch.Tensor) or targets.dim() != 2 or targets.dtype != torch.int64:
        raise ValueError(f"targets must be an int64 tensor (B, T), got {getattr(targets, 'shape', type(targets))}")
    if not isinstance(ref_logits, torch.Tensor) or ref_logits.shape[:-1] != targets.shape or ref_logits.dim() != 3:
        raise ValueError(f"ref_logits must have shape (B, T, V) with (B, T) = targets' {tuple(targets.shape)}, "
                         f"got {tuple(getattr(ref_logits, 'shape', ()))}")
    bad = (targets != -1) & ((targets < 0) | (targets >= ref_logits.size(-1)))
    if bad.any():
        raise ValueError(f"targets must be -1 (ignored: never hard) or a token id in [0, {ref_logits.size(-1)}), "
                         f"got {targets[bad][0].item()}")
    if response is not None and (not isinstance(response, torch.Tensor) or response.dtype != torch.bool
                                 or response.shape != targets.shape):
        raise ValueError(f"response must be None or a bool tensor of targets' shape {tuple(targets.shape)}, "
                         f"got {getattr(response, 'dtype', type(response))} {tuple(getattr(response, 'shape', ()))}")


def check_generation(idx, max_new_tokens, temperature, sample_top_k, cfg):
    """generate's arguments; the prompt's ids are checked on every device (one wait per call)."""
    check_tokens(idx, None, cfg.vocab_size, values=True)
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    check_length(idx.size(1), max_new_tokens, cfg.block_size, "tokens (prompt + max_new_tokens)")
    check_sampling(temperature, sample_top_k, cfg.vocab_size)


def check_logits(logits):
    """sample's logits: a float tensor (B, V), every value finite or -inf (a masked token)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor (B, V), got {getattr(logits, 'shape', type(logits))}")
    usable = (logits == logits) & (logits != float("inf"))  # not NaN, not +inf
    if not (usable.all() & (logits != float("-inf")).any(-1).all()):  # one wait for the device per call
        raise ValueError("logits must be finite (or -inf for a masked token, not every token of a row); got NaN, "
                         "+inf or a row with no token left")


def check_generator(generator):
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be None or a torch.Generator, got {type(generator).__name__}")


def check_sampling(temperature, sample_top_k, vocab_size):
    if not is_num(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if sample_top_k is not None and not (is_int(sample_top_k) and 1 <= sample_top_k <= vocab_size):
        raise ValueError(f"sample_top_k must be an int in [1, {vocab_size}], got {sample_top_k!r}")


def check_attend(q, k, v, mask):
    """moe.attend's inputs: q (B, H, Tq, hd), k and v (B, Hkv, Tk, hd) alike, H a multiple of Hkv,
    and a mask in one of its forms (a boolean tensor broadcastable to (B, H, Tq, Tk))."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        raise ValueError("attend takes q, k, v as 4-D tensors (B, heads, T, head_dim), got shapes "
                         f"{[tuple(getattr(t, 'shape', ())) for t in (q, k, v)]}")
    (B, H, Tq, hd), (Bk, Hkv, Tk, hdk) = q.shape, k.shape
    if k.shape != v.shape or Bk != B or hdk != hd or H % Hkv:
        raise ValueError(f"attend needs k and v of one shape (B={B}, Hkv, Tk, head_dim={hd}) with Hkv dividing "
                         f"H={H}; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise ValueError(f"attend's mask must be boolean (True = may attend), got {mask.dtype}")
        full = (B, H, Tq, Tk)
        if mask.dim() > 4 or any(m not in (1, f) for m, f in zip(mask.shape[::-1], full[::-1])):
            raise ValueError(f"attend's mask {tuple(mask.shape)} does not broadcast to (B, H, Tq, Tk) = {full}")
        if mask.dim() < 2:
            raise ValueError(f"attend's mask must have at least 2 dimensions (Tq, Tk) = ({Tq}, {Tk}), got "
                             f"{tuple(mask.shape)}")
    elif isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"attend's mask as a string must be 'causal', got {mask!r}")
        if Tq != Tk:
            raise ValueError(f"attend's mask 'causal' needs Tq == Tk, got Tq={Tq}, Tk={Tk}")
    elif isinstance(mask, BlockMask):
        if not flex_fits(hd, q.device):
            raise ValueError(f"a BlockMask on CUDA needs head_dim >= {FLEX_MIN_HEAD_DIM} (flex_attention's "
                             f"kernels), got {hd}: give a dense mask")
    elif mask is not None:
        raise ValueError(f"attend's mask must be 'causal', None, a boolean tensor or a BlockMask, got "
                         f"{type(mask).__name__}")


def check_kv(k, v, held):
    """A cache's update(k, v): k and v alike, (B, Hkv, T, hd), and (after the first write) the
    heads and head width the cache holds."""
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 4 and k.shape == v.shape):
        raise ValueError("a cache's update takes k and v of one shape (B, Hkv, T, head_dim), got "
                         f"{tuple(getattr(k, 'shape', ()))} and {tuple(getattr(v, 'shape', ()))}")
    if held is not None and (k.size(1), k.size(3)) != (held.size(1), held.size(3)):
        raise ValueError(f"the cache holds {held.size(1)} heads x {held.size(3)}, this update has "
                         f"{k.size(1)} x {k.size(3)}: one cache per layer, from generate.make_caches(model)")


def check_lookups(symbols, queries, two_hop, three_hop, per_problem):
    """tasks.Lookups' sizes: a cycle over 2+ symbols, 1+ queries, hop shares that are probabilities."""
    if not is_int(symbols) or symbols < 2:
        raise ValueError(f"symbols must be an int >= 2 (a cycle to follow), got {symbols!r}")
    if not is_int(queries) or queries < 1:
        raise ValueError(f"queries must be an int >= 1 per problem, got {queries!r}")
    for name, p in (("two_hop", two_hop), ("three_hop", three_hop)):
        if not is_num(p) or not 0 <= p <= 1:
            raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")
    if two_hop + three_hop > 1:
        raise ValueError(f"two_hop + three_hop must be at most 1 (the rest are one-hop queries), got "
                         f"{two_hop} + {three_hop}")
    if per_problem is not True and per_problem is not False:
        raise ValueError(f"per_problem must be True or False, got {per_problem!r}")


def real_device(device):
    """device as a torch.device this machine has, or one line naming it ('cpu:1' parses, and is no device)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or a name such as 'cpu' or 'cuda', got {device!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type not in ("cpu", "cuda") or device.type == "cpu" and device.index not in (None, 0) or \
            device.type == "cuda" and (device.index or 0) >= gpus:
        raise ValueError(f"device {str(device)!r} is not a device of this machine (cpu, or cuda:N with N < {gpus})")
    return device


def demo_args(doc):
    """A method file's demo takes no arguments: --help prints its docstring, anything else is refused."""
    argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()


def not_a_script(path, instead):
    """A module that is no script, run as one (by its path or with -m, with any arguments): one
    line saying what to run instead, and exit 2. (lab/'s modules say it in their first lines: by
    its path a lab module cannot import the project.)"""
    print(f"{path} is no script: run {instead}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    not_a_script("checks.py", "python train_tiny.py (the methods call its checks; python -m pytest tests them)")
