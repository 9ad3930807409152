"""
Training FLOPs of the models as they run: the step line's MFU on CUDA (trainer.log_step).
"""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/flops.py is no script: run python train_tiny.py --suite hd-compute", file=sys.stderr)
    sys.exit(2)

from moe import Transformer


def per_token(model, T):
    """Training FLOPs per token (3x forward): 6 per weight a row passes through (top_k of the
    routed experts, no embedding lookups) plus attention's, times the rows a token becomes (HD: n;
    TaH: the first pass only)."""
    body = model if isinstance(model, Transformer) else model.backbone
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
