"""
What each mechanism costs, as ratios measured side by side in one run.

    python bench.py           # a few minutes on CPU; CUDA sections run when a GPU is present
    python bench.py --quick   # everything small, in seconds (CI runs this)

Every table times its arms round-robin (arm A, arm B, ..., then again) and reports medians,
so a noisy shared machine slows all arms alike; read the ratio columns, not the milliseconds.
Sections: (1) attention alone per mask type vs n; (2) an HD training step vs n, for a
stream-factorized layout and for all-full; (3) the KV-mirror final-stream skip; (4) TaH decode
and training cost for Standard, TaH (~6% of tokens iterated) and AlwaysThink; (5) on CUDA,
flex_attention vs SDPA and the compiled model vs eager.
"""

import argparse
import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from hd import HDConfig, HiddenDecoding, fold, full, intra, local, unfold
from moe import attend, dense_mask
from tah import TaHCache, TaHConfig, ThinkAtHard


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timeit(arms, repeats, device, warmup=2):
    """arms: {name: fn}. Round-robin timing; returns {name: median seconds}."""
    for _ in range(warmup):
        for fn in arms.values():
            fn()
    times = {k: [] for k in arms}
    for _ in range(repeats):
        for k, fn in arms.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def show(title, rows, cols):
    print(f"\n### {title}\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


# -----------------------------------------------------------------------------


def attention_by_mask(L, ns, device, repeats, B=2, H=8, Hkv=2, D=32):
    """Attention alone over n*L rows, relative to n = 1 (all masks are causal at n = 1)."""
    res = {}
    for n in ns:
        T = n * L
        q = torch.randn(B, H, T, D, device=device)
        k, v = (torch.randn(B, Hkv, T, D, device=device) for _ in range(2))
        t = torch.arange(T, device=device)
        f = lambda x: fold(x.transpose(1, 2), n).transpose(1, 2)
        m_intra, m_local = dense_mask(intra(n, 1), t, t), dense_mask(local(n, 4 * n), t, t)
        arms = {
            "intra, folded": lambda: unfold(attend(f(q), f(k), f(v), "causal").transpose(1, 2), n),
            "intra, dense mask": lambda: attend(q, k, v, m_intra),
            f"local (window 4n), dense mask": lambda: attend(q, k, v, m_local),
            "full (causal kernel)": lambda: attend(q, k, v, "causal"),
        }
        res[n] = timeit(arms, repeats, device)
    base = res[ns[0]]
    rows = [[k] + [f"{res[n][k] / base[k]:.2f}x" for n in ns] + [f"{base[k] * 1e3:.2f}"] for k in base]
    show(f"1. Attention alone, L={L} tokens, B={B}, {H}/{Hkv} heads x {D}: time vs n=1 (target: intra <= 4.8x "
         f"at n=4, full >= 10x)", rows, ["path"] + [f"n={n}" for n in ns] + ["n=1 ms"])


def hd_cfg(n, layout, L, **kw):
    base = dict(vocab_size=512, block_size=L, n_layer=6, n_embd=64, n_head=12, n_kv_head=2, head_dim=16,
                n_experts=8, top_k=2, expert_hidden=64, n_streams=n, layout=layout, window=4 * n)
    base.update(kw)
    return HDConfig(**base)


def train_step(model, idx):
    def step():
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def hd_steps(L, ns, device, repeats, B=4):
    """Forward + backward of an HD model vs the n = 1 backbone, same tokens."""
    idx = torch.randint(512, (B, L + 1), device=device)
    arms = {}
    for layout in ("IIFLII", "FFFFFF"):
        for n in ns:
            torch.manual_seed(0)
            arms[(layout, n)] = train_step(HiddenDecoding(hd_cfg(n, layout, L)).to(device), idx)
    t = timeit(arms, repeats, device)
    base = t[("FFFFFF", 1)]
    rows = [[layout] + [f"{t[(layout, n)] / base:.2f}x" for n in ns] for layout in ("IIFLII", "FFFFFF")]
    show(f"2. HD training step (fwd+bwd), 6-layer MoE, L={L} tokens x B={B}, vs n=1 "
         "(paper: n=4 costs 4.4-5.1x per batch with SFA; target <= 4.4x)", rows, ["layout"] + [f"n={n}" for n in ns])


def mirror_skip(L, n, device, repeats, B=4):
    idx = torch.randint(512, (B, L + 1), device=device)
    arms = {}
    for skip in (False, True):
        torch.manual_seed(0)
        arms[skip] = train_step(HiddenDecoding(hd_cfg(n, "IIFLII", L, mirror_skip=skip)).to(device), idx)
    t = timeit(arms, repeats, device)
    show(f"3. KV-mirror final-stream skip, n={n}, 6 layers (2 mirrored), L={L} x B={B}: training step",
         [["all streams through mirrored layers", f"{t[False] * 1e3:.1f}", "1.00x"],
          ["final stream only (skip)", f"{t[True] * 1e3:.1f}", f"{t[False] / t[True]:.2f}x speed-up"]],
         ["arm", "ms", "vs no skip (ceiling 1 / (2/3 + 1/3 * 1/4) = 1.33x; target >= 1.2x)"])


def tah_costs(L, device, repeats, B=4, frac=0.06):
    """TaH decode per token and training step: Standard, TaH (frac of tokens iterated), Always."""
    torch.manual_seed(0)
    cfg = TaHConfig(vocab_size=512, block_size=L + 1, n_layer=6, n_embd=64, n_head=12, n_kv_head=2,
                    head_dim=16, n_experts=0, ffn_hidden=192, topk=100, max_depth=2)
    model = ThinkAtHard(cfg).to(device)
    idx = torch.randint(512, (B, L + 1), device=device)
    g = torch.Generator().manual_seed(0)
    hard = (torch.rand(B, L, generator=g) < frac).to(device)
    depths = {"Standard": torch.ones(B, L, dtype=torch.long, device=device), "TaH": 1 + hard.long(),
              "AlwaysThink": torch.full((B, L), 2, device=device)}

    def train(d):
        def step():
            model.stage1_loss(idx[:, :-1], idx[:, 1:], d).backward()
            model.zero_grad(set_to_none=True)
        return step

    @torch.no_grad()
    def decode(d):
        def run():
            cache = TaHCache(cfg.n_layer, B, device)
            for t in range(L):
                model(idx[:, t:t + 1], mode="oracle", depths=d[:, t:t + 1], cache=cache)
        return run
    tt = timeit({k: train(d) for k, d in depths.items()}, repeats, device)
    td = timeit({k: decode(d) for k, d in depths.items()}, max(3, repeats // 3), device, warmup=1)
    it = {k: (d > 1).float().mean().item() for k, d in depths.items()}
    rows = [[k, f"{it[k]:.0%}", f"{td[k] / L * 1e3:.2f}", f"{td[k] / td['Standard']:.2f}x", f"{tt[k] / tt['Standard']:.2f}x"]
            for k in depths]
    show(f"4. TaH, 6-layer dense backbone, L={L} x B={B} (targets: TaH decode <= 1.15x, AlwaysThink ~2x)",
         rows, ["arm", "iterated", "decode ms/token", "decode vs Standard", "train step vs Standard"])


def cuda_section(L, repeats):
    B, H, D = 4, 8, 64
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flex = torch.compile(flex_attention, dynamic=False)
    t = torch.arange(L, device="cuda")
    W = 256
    causal_bm = create_block_mask(full(1, 1), None, None, L, L, device="cuda")
    local_bm = create_block_mask(local(1, W), None, None, L, L, device="cuda")
    m_local = dense_mask(local(1, W), t, t)
    r = timeit({"sdpa causal": lambda: attend(q, k, v, "causal"), "flex causal": lambda: flex(q, k, v, block_mask=causal_bm),
                "sdpa window (dense mask)": lambda: attend(q, k, v, m_local),
                "flex window": lambda: flex(q, k, v, block_mask=local_bm)}, repeats, "cuda")
    show(f"5a. CUDA attention, L={L}, bf16, window {W}", [[k, f"{v * 1e3:.3f}", f"{v / r['sdpa causal']:.2f}x"] for k, v in r.items()],
         ["path", "ms", "vs SDPA causal"])
    torch.manual_seed(0)
    model = HiddenDecoding(hd_cfg(4, "IIFLII", 512, moe_dispatch="loop")).cuda()
    idx = torch.randint(512, (8, 513), device="cuda")
    compiled = torch.compile(model)
    with torch.autocast("cuda", torch.bfloat16):
        r = timeit({"eager": train_step(model, idx), "compiled": train_step(compiled, idx)}, repeats, "cuda")
    show("5b. HD n=4 training step on CUDA, bf16", [[k, f"{v * 1e3:.2f}", f"{r['eager'] / v:.2f}x"] for k, v in r.items()],
         ["model", "ms", "speed-up vs eager"])


def main(argv=None):
    ap = argparse.ArgumentParser(description="cost of each mechanism, as measured ratios")
    ap.add_argument("--quick", action="store_true", help="small sizes, seconds (CI)")
    ap.add_argument("--repeats", type=int, help="timed repeats per arm (median)")
    args = ap.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        ap.error("--repeats must be >= 1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rep = args.repeats or (3 if args.quick else 15)
    dev = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# bench.py{' --quick' if args.quick else ''} on {dev}, torch {torch.__version__}, median of {rep}")
    attention_by_mask(64 if args.quick else 512, [1, 2, 4] if args.quick else [1, 2, 4, 8], device, rep)
    hd_steps(16 if args.quick else 128, [1, 2, 4] if args.quick else [1, 2, 4, 8], device, rep)
    mirror_skip(16 if args.quick else 128, 4, device, rep)
    tah_costs(16 if args.quick else 64, device, rep)
    if device == "cuda":
        cuda_section(1024 if args.quick else 8192, rep)


if __name__ == "__main__":
    main()
