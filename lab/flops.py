"""
Training FLOPs of the models as they run: the step line's MFU on CUDA (trainer.log_step) and
--suite hd-compute's compute per arm (lab/compute.py).

The convention is model FLOPs, as nanoGPT's and PaLM's MFU count them: 2 per multiply-add of
every matmul of the forward, 3x the forward for a training step (the backward's two matmuls per
forward one); none for embedding lookups, norms, activations, softmax or the optimizer. What is
counted is what the model runs, not the weights it has:

- each layer's weights on the rows it runs per token: HD's n stream rows, or under the KV-mirror
  skip the final stream's row only (its K/V projections still on the rows they read: every row
  for F and L layers, the final stream's for an I layer); top_k of the routed experts plus the
  shared one (the router on every row); TaH's LoRA adapters on the rows of depth >= 1;
- attention: 4 x heads x head_dim per (query, key) pair each layer's mask allows (QK^T and AV),
  counted per letter: F a causal row over the n*t rows up to it, L its window of rows, I its own
  stream's t + 1 rows (the shared-KV control: 1 + t), only the final-stream queries under the skip;
  TaH's duo-causal pairs (query (i, d) sees (j, k) for j <= i, k <= d);
- the LM head on the rows that run it (HD: the final stream's; TaH: every pass's), TaH's
  next-pass input (the top-k softmax times the embedding table: a (V, C) product per row);
- a looped model's passes (lab/compute.Looped: the blocks `loops` times, the head once);
- ParScale's copies (lab/compute.ParScale: the blocks on P rows a token, each query seeing its
  copy's prefix rows too; the aggregation MLP once a token, the head once).
"""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/flops.py is no script: run python train_tiny.py --suite hd-compute", file=sys.stderr)
    sys.exit(2)

import torch

from hd import attention_path, letter
from moe import Transformer

KV = ("attn.k_proj", "attn.v_proj")  # the weights a layer runs on its key rows
CPU = torch.device("cpu")  # where a layer runs does not change whether its streams fold
ROUTED = ("ffn.w_gate_up", "ffn.w_down")  # the stacked routed experts: top_k of n_experts run per row


def per_token(model, T, passes=1, *, decider=False, stage2=False):
    """One training step's FLOPs per token of `model` on sequences of T tokens, as it runs (the
    convention above). passes: TaH's passes per token (1 Standard, 2 AlwaysThink; between, the
    share of tokens a second pass runs, its attention pairs as if those tokens were spread evenly;
    a gathered pass's padded rows count as run: passes_run). decider: TaH's decider reads every
    pass's rows (a decider-routed forward: its MLP once, as no gradient reaches it). stage2: TaH's
    stage 2, the forward without gradient (once) and the decider trained on its rows (3x; its
    logit projection 2x, as its input takes no gradient).
    What it cannot count (not a model of this project, T not an int in [1, block_size], passes on
    a model without them or outside TaH's range) is refused in one line."""
    return sum(parts(model, T, passes, decider=decider, stage2=stage2).values())


def passes_run(out):
    """The passes per token a TaH forward ran (its TaHOutput), as run: every pass's query rows,
    a gathered pass's padding included, over the batch's tokens: per_token's `passes` for it."""
    return sum(p.sel.numel() for p in out.passes) / out.depths.numel()


def parts(model, T, passes=1, *, decider=False, stage2=False):
    """per_token in two parts: "weights" (every matmul with a weight, the head and TaH's decider
    included) and "attention" (the mask's pairs), training FLOPs per token each."""
    inner = getattr(model, "model", model)  # lab/compute's Looped and ParScale wrap an n = 1 model
    body = inner if isinstance(inner, Transformer) else getattr(inner, "backbone", None)
    if not isinstance(model, torch.nn.Module) or not isinstance(body, Transformer):
        raise ValueError(f"flops counts a model of moe.py, hd.py or tah.py (or lab/compute's Looped and ParScale "
                         f"around one), got {type(model).__name__}"[:200])
    cfg = body.cfg
    if type(T) is not int or not 1 <= T <= cfg.block_size:
        raise ValueError(f"flops: T must be an int in [1, block_size {cfg.block_size}], got {T!r}"[:200])
    loops = getattr(model, "loops", 1) * getattr(model, "copies", 1)  # passes, or copies, of the blocks a token
    prefix = getattr(model, "prefix", 0)  # ParScale's prefix rows: keys every query sees
    if hasattr(cfg, "max_depth"):
        fwd = tah_forward(body, cfg, T, passes)
        dec = {n: 2 * p.numel() for n, p in inner.decider.named_parameters() if p.ndim == 2}
        mlp = sum(dec.values()) * passes  # on every pass's rows
        if stage2:  # the forward without gradient; the decider trained on what it read, 3x, but its logit projection
            # 2x: its input (the logit values, read without gradient) takes no gradient
            return {"weights": fwd["weights"] + 3 * mlp - dec["logit_proj.weight"] * passes, "attention": fwd["attention"]}
        return {"weights": 3 * fwd["weights"] + (mlp if decider else 0), "attention": 3 * fwd["attention"]}
    if decider or stage2:
        raise ValueError(f"flops: decider and stage2 are TaH's; a {type(model).__name__} has no decider")
    if not isinstance(passes, int) or isinstance(passes, bool) or passes != 1:
        raise ValueError(f"flops: passes is TaH's (passes per token); a {type(model).__name__} runs one, got "
                         f"{passes!r}"[:200])
    n = getattr(cfg, "n_streams", 1)
    skip = inner.mirror_skip_from() if hasattr(inner, "mirror_skip_from") else None
    matmuls, attention = 0.0, 0.0
    for i, block in enumerate(body.blocks):
        final_only = skip is not None and i >= skip
        folded = final_only and attention_path(cfg, i, True, CPU) == "fold"  # an I layer's streams run apart:
        kv_rows = 1 if folded else n  # its keys, the final stream's own
        matmuls += weights(block, cfg, 1 if final_only else n, kv_rows)
        attention += 4 * cfg.n_head * cfg.head_dim * (pairs(cfg, i, n, T, final_only) / T + prefix)
    head = 2 * body.lm_head.weight.numel() * (n if getattr(cfg, "objective", "final") == "all" else 1)
    if hasattr(model, "aggregate"):  # ParScale's weighted sum: its MLP's matrices once a token
        head += sum(2 * p.numel() for p in model.aggregate.parameters() if p.ndim == 2)
    return {"weights": 3 * (loops * matmuls + head), "attention": 3 * loops * attention}


def weights(block, cfg, q_rows, kv_rows, lora_rows=0):
    """A block's forward FLOPs per token from its weights: 2 per weight on each row that runs it."""
    total = 0.0
    for name, p in block.named_parameters():
        if p.ndim < 2:
            continue  # norms
        if name.endswith((".A", ".B")):  # TaH's LoRA adapter: the rows of depth >= 1
            total += 2 * p.numel() * lora_rows
        elif name.startswith(ROUTED):
            total += 2 * p.numel() * cfg.top_k / cfg.n_experts * q_rows
        else:
            total += 2 * p.numel() * (kv_rows if name.startswith(KV) else q_rows)
    return total


def pairs(cfg, i, n, T, final_only):
    """(query, key) pairs layer i's mask allows over T tokens of n streams, by its letter (hd.LETTERS:
    a closed form each; a model without a layout attends causally, as F)."""
    return letter(cfg.layout[i] if hasattr(cfg, "layout") else "F").pairs(n, getattr(cfg, "window", 0), T, final_only)


def tah_forward(body, cfg, T, passes):
    """TaH's forward FLOPs per token (weights, attention): pass 1 on every token, and `passes - 1`
    more per token (a share of the tokens in pass 2; past 2 passes, every token the same number),
    each with the LoRA adapter, the next-pass input and the head."""
    if (not isinstance(passes, (int, float)) or isinstance(passes, bool) or not 1 <= passes <= cfg.max_depth
            or passes > 2 and passes != int(passes)):  # nan fails the range
        raise ValueError(f"flops: passes must be in [1, 2], or a whole number up to max_depth {cfg.max_depth}, got "
                         f"{passes!r}"[:200])
    deeper = passes - 1
    rows = 1 + deeper
    matmuls = sum(weights(block, cfg, rows, rows, lora_rows=deeper) for block in body.blocks)
    matmuls += 2 * body.lm_head.weight.numel() * rows + 2 * body.wte.weight.numel() * deeper
    # duo-causal pairs: a depth-d query sees the t + 1 tokens' states of depths 0 .. d that exist: at
    # p whole passes (d + 1)(t + 1) each, p (p + 1) / 2 (t + 1) a token; a share f in pass 2: 1 + f (1 + f)
    keys = (T + 1) / 2 * (1 + deeper * (1 + deeper) if deeper <= 1 else passes * (passes + 1) / 2)
    return {"weights": matmuls, "attention": 4 * cfg.n_head * cfg.head_dim * keys * cfg.n_layer}
