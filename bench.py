"""
What each mechanism costs, as ratios measured side by side in one run.

    python bench.py           # a few minutes on CPU; CUDA sections run when a GPU is present
    python bench.py --quick   # everything small, in seconds (CI runs this)
    python bench.py --cuda    # only HD serving on CUDA and the CUDA section (see gpu_check.sh)

Every table times its arms round-robin (arm A, arm B, ..., then again) and reports medians,
so a noisy shared machine slows all arms alike; read the ratio columns, not the milliseconds.
Sections: (1) attention alone per mask type vs n; (2) an HD training step vs n, for a
stream-factorized layout and for all-full; (3) the KV-mirror final-stream skip at two widths,
with the ceiling its measured share of time allows; (4) HD serving: cached decode throughput of
n = 4 vs n = 1 over batch x prompt length (HD Figure 5), the KV cache per layout, and decode
tokens/s against prompt length up to the block size, where a decode step's time goes, GQA
folded for a decode step's few queries, the sliding-window layer's ring alone, and the MoE's
dispatches against the rows they run (4h); (5)
TaH decode and training cost for Standard, TaH (~6% of tokens iterated) and AlwaysThink at two
widths, and where TaH's extra cost goes; (6) on CUDA, flex_attention vs SDPA and the compiled model vs eager.

    python bench.py --compile # only compiled against eager: the decode step (4g), an HD training step (4i) and
                              # TaH decoding compiled per pass (4j);
                              # about a minute of compiling per row
"""

from lab import startup  # first, before torch imports: Ctrl-C in these first seconds ends the process at once

startup.guard(__name__)

import argparse  # noqa: E402
import contextlib
import copy
import os
import statistics
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils._python_dispatch import TorchDispatchMode


from generate import TaHCache, compiled_step, generate_tah, graphed_step, lora_merged, make_caches
from hd import HDConfig, HiddenDecoding, expand_streams, fold, full, intra, letter, local, unfold
from lab.compute import Looped, ParScale
from moe import GATHER_ROWS, MoE, ModelConfig, attend, attend_folded, dense_mask, dispatch as moe_dispatch
from tah import LoRALinear, TaHConfig, ThinkAtHard, stage1_loss


MAX_REPEATS = 1000  # --repeats: timed repeats per arm


@contextlib.contextmanager
def profiled():
    """torch.profiler over the block, with its C++ side (kineto) kept quiet: it writes a
    "USDT ... profiler_start/stop" line to file descriptor 2 at each start and stop, which no
    setting turns off, so that descriptor points at /dev/null while the profiler runs."""
    from torch.profiler import ProfilerActivity, profile
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as p:
            yield p
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


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
        m_intra, m_local = dense_mask(intra(n), t, t), dense_mask(local(4 * n), t, t)
        arms = {
            "intra, folded": lambda: unfold(attend(f(q), f(k), f(v), "causal").transpose(1, 2), n),
            "intra, dense mask": lambda: attend(q, k, v, m_intra),
            "local (window 4n), dense mask": lambda: attend(q, k, v, m_local),
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


def block_share(model, idx, blocks, device, repeats=3):
    """Share of a forward pass's wall time spent inside the given blocks (timed by hooks)."""
    spent, total, stamp = [0.0], [0.0], {}

    def pre(module, args):
        sync(device)
        stamp[module] = time.perf_counter()

    def post(module, args, out):
        sync(device)
        spent[0] += time.perf_counter() - stamp[module]
    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(pre), b.register_forward_hook(post))]
    try:
        for _ in range(repeats):
            sync(device)
            t = time.perf_counter()
            model(idx[:, :-1], idx[:, 1:])
            sync(device)
            total[0] += time.perf_counter() - t
    finally:
        for h in hooks:
            h.remove()
    return spent[0] / total[0]


def mirror_skip(L, n, device, repeats, widths, B=4):
    """The KV-mirror final-stream skip (HD §3.1) vs running every stream through the mirrored
    layers, at two widths and two layouts. Ceiling (Amdahl): the skip removes (n-1)/n of the
    mirrored blocks' time s, so it can give at most 1 / (1 - s (n-1)/n); s is measured."""
    idx = torch.randint(512, (B, L + 1), device=device)
    rows = []
    for layout in ("IIFLII", "IIIIII"):
        for C in widths:
            models = {}
            for skip in (False, True):
                torch.manual_seed(0)
                cfg = hd_cfg(n, layout, L, mirror_skip=skip, n_embd=C, head_dim=C // 4, expert_hidden=C)
                models[skip] = HiddenDecoding(cfg).to(device)
            t = timeit({k: train_step(m, idx) for k, m in models.items()}, repeats, device)
            mirrored = [b for b in models[False].backbone.blocks if b.mirror_source is not None]
            s = block_share(models[False], idx, mirrored, device)
            rows.append([layout, C, f"{t[False] * 1e3:.1f}", f"{t[True] * 1e3:.1f}", f"{t[False] / t[True]:.2f}x",
                         f"{s:.0%}", f"{1 / (1 - s * (n - 1) / n):.2f}x"])
    show(f"3. KV-mirror final-stream skip, n={n}, 6 layers (2 mirrored), L={L} x B={B}: training step "
         f"(ceiling if every layer cost the same: 1 / (2/3 + 1/3 * 1/{n}) = {1 / (2 / 3 + 1 / (3 * n)):.2f}x; "
         "target >= 1.2x; paper: 1.25x at 80B)", rows,
         ["layout", "width", "all streams ms", "skip ms", "speed-up", "mirrored blocks' share of forward",
          "ceiling from that share"])


def tah_costs(L, device, repeats, widths, frac=0.06):
    """TaH cost per model width: decoding per token at batch 1 and 4, and the stage-1 training
    step, for Standard, TaH (frac of tokens iterated) and AlwaysThink."""
    rows = []
    for C in widths:
        torch.manual_seed(0)
        cfg = TaHConfig(vocab_size=512, block_size=L + 1, n_layer=6, n_embd=C, n_head=12, n_kv_head=2,
                        head_dim=C // 4, n_experts=0, ffn_hidden=3 * C, logit_topk=100, max_depth=2)
        model = ThinkAtHard(cfg).to(device)
        res = {}
        for B in (1, 4):
            idx = torch.randint(512, (B, L + 1), device=device)
            g = torch.Generator().manual_seed(0)
            hard = (torch.rand(B, L, generator=g) < frac).to(device)
            depths = {"Standard": torch.ones(B, L, dtype=torch.long, device=device), "TaH": 1 + hard.long(),
                      "AlwaysThink": torch.full((B, L), 2, device=device)}
            res[B] = dict(depths=depths, decode=timeit({k: tah_decode(model, idx, d) for k, d in depths.items()},
                                                       repeats, device, warmup=1))
            if B == 4:
                res[B]["train"] = timeit({k: tah_train(model, idx, d) for k, d in depths.items()}, repeats, device)
        for arm in ("Standard", "TaH", "AlwaysThink"):
            d4 = res[4]["depths"][arm]
            second = (d4 > 1).any(0).float().mean().item()  # decode steps where some row runs depth 1
            dec = {B: res[B]["decode"][arm] / res[B]["decode"]["Standard"] for B in (1, 4)}
            always4 = res[4]["decode"]["AlwaysThink"] / res[4]["decode"]["Standard"]
            rows.append([C, arm, f"{(d4 > 1).float().mean().item():.0%}", f"{dec[1]:.2f}x", f"{second:.0%}",
                         f"{dec[4]:.2f}x", f"{1 + second * (always4 - 1):.2f}x" if arm == "TaH" else "",
                         f"{res[4]['train'][arm] / res[4]['train']['Standard']:.2f}x"])
    show(f"5. TaH, 6-layer dense backbone, L={L} (targets: TaH decode <= 1.10x at B=1, <= 1.15x at B=4; "
         "train step <= 1.3x at width 256; AlwaysThink ~2x; paper: ~1.06 passes per token)", rows,
         ["width", "arm", "tokens iterated", "decode B=1 vs Standard", "B=4: steps with a 2nd pass",
          "decode B=4 vs Standard", "B=4 if a 2nd pass cost what a whole batch's does: 1 + steps x (AlwaysThink - 1)",
          "train step (B=4) vs Standard"])


def tah_profile(L, device, repeats, width=256, frac=0.06, B=4):
    """Where TaH's extra cost goes, measured. Decoding: ops issued per step with and without a
    second pass (torch.profiler), against the rows that pass runs. Training: the step with
    two diagnostic arms that are not models (each drops one piece of the second pass's work):
    no LoRA at depth >= 1, and no gradient from depth >= 1 into the backbone's weights."""
    torch.manual_seed(0)
    cfg = TaHConfig(vocab_size=512, block_size=L + 1, n_layer=6, n_embd=width, n_head=12, n_kv_head=2,
                    head_dim=width // 4, n_experts=0, ffn_hidden=3 * width, logit_topk=100, max_depth=2)
    model = ThinkAtHard(cfg).to(device)
    idx = torch.randint(512, (B, L + 1), device=device)
    ops = {}
    with torch.no_grad(), lora_merged(model):
        for name, d in (("one pass (every row)", [1] * B), ("+ a 2nd pass for 1 row", [2] + [1] * (B - 1))):
            cache = TaHCache(model, B, device)
            model(idx[:, :L // 2], mode="standard", cache=cache)
            depths = torch.tensor(d, device=device)[:, None]
            with profiled() as p:
                for t in range(L // 2, L // 2 + 8):
                    model(idx[:, t:t + 1], mode="oracle", depths=depths, cache=cache)
            ops[name] = sum(e.count for e in p.key_averages()) / 8
    hard = (torch.rand(B, L, generator=torch.Generator().manual_seed(0)) < frac).to(device)
    depths = {"Standard": torch.ones(B, L, dtype=torch.long, device=device), "TaH": 1 + hard.long()}

    t = timeit({"Standard": tah_train(model, idx, depths["Standard"]), "TaH": tah_train(model, idx, depths["TaH"]),
                "TaH, no LoRA in pass 2 (diagnostic)": tah_train(with_adapters(model, NoLoRA), idx, depths["TaH"]),
                "TaH, no gradient from pass 2 into W (diagnostic)":
                    tah_train(with_adapters(model, NoGradIntoW), idx, depths["TaH"])}, repeats, device)
    first = ops["one pass (every row)"]
    rows = [[f"decode step, B={B}: {k}", f"{v:.0f} ops", f"{v / first:.2f}x"] for k, v in ops.items()]
    rows += [[f"train step, B={B}, width {width}: {k}", f"{v * 1e3:.1f} ms", f"{v / t['Standard']:.2f}x"]
             for k, v in t.items()]
    show(f"5b. Where TaH's extra cost goes (L={L}; ops counted by torch.profiler, 8 decode steps after {L // 2} tokens)",
         rows, ["what", "per step", "vs one pass (decode) or Standard (train)"])


class NoLoRA(LoRALinear):
    """Diagnostic adapter: off at every depth (the second pass runs the base weights)."""

    def forward(self, x):
        return self.base(x)


class NoGradIntoW(LoRALinear):
    """Diagnostic adapter: at depth >= 1 the base weight is read without a gradient into it."""

    def forward(self, x):
        if not self.active:
            return self.base(x)
        return F.linear(x, self.base.weight.detach(), self.base.bias) + self.scale * F.linear(F.linear(x, self.A), self.B)


def with_adapters(model, cls):
    """A copy of a ThinkAtHard whose adapters run as `cls` (a LoRALinear subclass), same weights."""
    m = copy.deepcopy(model)
    for parent in list(m.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is LoRALinear:
                new = cls(child.base, child.A.size(0), child.scale * child.A.size(0))
                new.A, new.B = child.A, child.B
                setattr(parent, name, new)
    m.loras = [x for x in m.backbone.modules() if isinstance(x, LoRALinear)]
    return m


def tah_train(model, idx, depths):
    def step():
        stage1_loss(model, idx[:, :-1], idx[:, 1:], depths).backward()
        model.zero_grad(set_to_none=True)
    return step


def tah_decode(model, idx, depths):
    """Token-by-token cached decoding of idx with the given depths (oracle routing), the
    adapters merged as generate runs them."""
    @torch.no_grad()
    def run():
        cache = TaHCache(model, idx.size(0), idx.device)
        with lora_merged(model):  # as generate decodes
            for t in range(depths.size(1)):
                model(idx[:, t:t + 1], mode="oracle", depths=depths[:, t:t + 1], cache=cache)
    return run


# Figure 5 of the HD paper (WeLM-HD4-80B on 8 H20 GPUs, decode TPS of HD n=4 as % of the
# baseline), the cells its text gives: batch 1 keeps 83-88% in every input bucket; batch 4
# keeps 69-88% for short/2k/8k inputs; batch 16: short 60%, 2k 54%, 8k 49%, 32k 44%.
PAPER_FIG5 = {(1, "short"): "83-88%", (1, "long"): "83-88%", (4, "short"): "69-88%", (4, "long"): "69-88% (8k)",
              (16, "short"): "60%", (16, "long"): "49% (8k), 44% (32k)", (64, "short"): "-", (64, "long"): "-"}


def hd_decode(model, B, prompt, steps, device, graph=False):
    """Decode `steps` tokens for B rows after a cache of `prompt` tokens. The model's own
    preallocated caches are filled once with random K/V for the prompt (a decode step's cost
    depends on shapes, not values), so no prefill is timed or even run; each call starts again
    from that cache (the steps' rows are written over). graph: static caches, the step replayed
    as a CUDA graph (generate.graphed_step)."""
    cfg, n = model.cfg, getattr(model.cfg, "n_streams", 1)
    per_token = getattr(model, "kv_rows_per_token", lambda i: 1)
    skip = model.mirror_skip_from() if hasattr(model, "mirror_skip_from") else None
    g = torch.Generator(device=device).manual_seed(0)
    caches = make_caches(model, static=graph)
    for i, c in enumerate(caches):  # a layer that keeps one row per token holds its streams as batch rows
        b = B * n if per_token(i) == 1 and (skip is None or i < skip) else B
        c.update(*(torch.randn(b, cfg.n_kv_head, prompt * per_token(i), cfg.head_dim, generator=g, device=device)
                   for _ in range(2)))
    first = torch.randint(cfg.vocab_size, (B, 1), generator=g, device=device)
    step = graphed_step(model, caches, B) if graph else model

    @torch.no_grad()
    def run():
        for i, c in enumerate(caches):
            c.len = prompt * per_token(i)  # back to the prompt: the rows written by the last call are free again
            if graph:
                c.written.fill_(c.len)
        x = first
        for _ in range(steps):
            logits, _ = step(x, caches=caches)
            x = logits[:, -1:].argmax(-1)
    return run


def hd_serving(prompts, batches, device, repeats, steps, n=4, width=64, graph=False):
    """HD decode throughput relative to n = 1 (HD §4.5, Figure 5), over batch x prompt length,
    for the stream-factorized layout and all-full; then the KV cache each layout keeps. graph
    (CUDA): each step replayed as a CUDA graph, so that a step costs HD's work, not its launches;
    a static cache reads its whole block, so each prompt gets models whose block just fits it."""
    arms = {"n=1": (1, "IIFLII", None), f"n={n} SFA (IIFLII)": (n, "IIFLII", False),
            f"n={n} SFA + KV-mirror skip": (n, "IIFLII", True), f"n={n} all-full": (n, "FFFFFF", False)}

    def models_for(block):
        models = {}
        for name, (streams, layout, skip) in arms.items():
            torch.manual_seed(0)
            cfg = hd_cfg(streams, layout, block, mirror_skip=skip, n_embd=width, head_dim=width // 4,
                         expert_hidden=width)
            models[name] = HiddenDecoding(cfg).to(device).eval()
        return models
    models = models_for(max(prompts.values()) + steps + 1)
    rows = []
    for B in batches:
        for bucket, P in prompts.items():
            ms = models_for(P + steps + 1) if graph else models
            t = timeit({k: hd_decode(m, B, P, steps, device, graph) for k, m in ms.items()}, repeats, device, warmup=1)
            base = t["n=1"]
            rows.append([B, f"{bucket} ({P})", f"{B * steps / base:.0f}"]
                        + [f"{base / t[k]:.0%}" for k in list(arms)[1:]] + [PAPER_FIG5.get((B, bucket), "-")])
    show(f"4. HD serving{' (each step a CUDA graph)' if graph else ''}: decode tokens/s of n={n} as % of n=1, 6-layer "
         f"MoE width {width}, cached decoding of {steps} tokens after the prompt (paper: WeLM-HD4-80B, HD Figure 5; "
         "excludes the KV-mirror skip)", rows,
         ["batch", "prompt (tokens)", "n=1 tokens/s"] + [k.replace(f"n={n} ", "") for k in list(arms)[1:]] + ["paper, HD4"])
    T = max(prompts.values())
    cfg = hd_cfg(n, "IIFLII", T, n_embd=width, head_dim=width // 4, expert_hidden=width)
    per_row = 2 * cfg.n_kv_head * cfg.head_dim  # K and V elements of one row in one layer
    kv_rows = []
    for name, streams, layout in [("n=1", 1, "IIFLII"), (f"n={n} SFA (IIFLII)", n, "IIFLII"),
                                  (f"n={n} all-full", n, "FFFFFF")]:
        model = HiddenDecoding(hd_cfg(streams, layout, T, n_embd=width, head_dim=width // 4, expert_hidden=width))
        caches = make_caches(model)  # what decoding keeps: an L layer's ring holds its window, whatever T
        rings = sum(hasattr(c, "window") for c in caches)
        kept = streams * (len(caches) - rings)  # every stream's row (an I layer's as batch rows)
        needed = sum(streams for c in layout if letter(c).reach(cfg.window) is None)  # L: only the last `window` rows
        kv_rows.append([name, f"{kept * per_row}" + (f" + {rings} ring(s) of {model.cfg.window} rows" if rings else ""),
                        f"{needed * per_row}" + (" + window" if rings else ""), f"{qk_pairs(streams, layout, T, cfg.window):,}"])
    base = int(kv_rows[0][3].replace(",", ""))
    for r in kv_rows:
        r.append(f"{int(r[3].replace(',', '')) / base:.1f}x")
    show(f"4b. KV cache per token of context (elements, all 6 layers; {cfg.n_kv_head} KV heads x {cfg.head_dim}) and "
         f"attention work per decoded token after {T} tokens (query-key pairs, all layers)", kv_rows,
         ["model", "kept per token (generate.make_caches)", "needed per token (L layers keep only their window)",
          "query-key pairs per decoded token", "vs n=1"])


def qk_pairs(n, layout, S, window):
    """Query-key pairs a decoded token's n rows score after S tokens, over the layers: an F layer
    reads every row (n * S), an I layer its stream's S, an L layer its window (the ring)."""
    return sum(n * letter(c).keys(n, window, n * S - 1) for c in layout)  # the keys of the token's last row


def prompts_to(block, steps):
    """Prompt lengths doubling from 64, the last one leaving room for exactly `steps` tokens."""
    return [p for p in (64, 128, 256, 512, 1024, 2048, 4096) if p < block - steps] + [block - steps]


class WholeCache(HiddenDecoding):
    """The contrast to the ring: every layer's cache keeps and reads every row; an L layer's
    mask hides the rows beyond its window (decoding before generate.WindowCache)."""

    def kv_window(self, i):
        return None


def decode_vs_prompt(block, batches, device, repeats, steps, n=4, width=64):
    """Decode cost per step as the prompt grows to the block size (the last prompt leaves room
    for exactly `steps` tokens): n = 1, n = 4 stream-factorized (its L layer on a ring, and on a
    whole cache, the contrast) and n = 4 all-full, none with the KV-mirror skip. With caches
    written in place a step's cost grows only with the attention it does: I layers read S rows,
    the F layer n*S, the L layer its window on the ring but n*S on a whole cache. Beside each row,
    the attention work it predicts (qk_pairs, relative to n = 1)."""
    prompts = prompts_to(block, steps)
    arms = {"n=1": (HiddenDecoding, 1, "IIFLII"), "SFA": (HiddenDecoding, n, "IIFLII"),
            "SFA, whole cache": (WholeCache, n, "IIFLII"), "all-full": (HiddenDecoding, n, "FFFFFF")}
    models = {}
    for name, (kind, streams, layout) in arms.items():
        torch.manual_seed(0)
        cfg = hd_cfg(streams, layout, block, mirror_skip=False, n_embd=width, head_dim=width // 4, expert_hidden=width)
        models[name] = kind(cfg).to(device).eval()
    w, rows = models["SFA"].cfg.window, []
    for B in batches:
        for P in prompts:  # the arms of one row in one round-robin: drift hits them alike, and no longer
            # prompt's caches (timed in between) evict a short one's from the CPU caches
            t = timeit({a: hd_decode(m, B, P, steps, device) for a, m in models.items()}, repeats, device, warmup=1)
            work = {a: qk_pairs(s, lay, P, w) for a, (_, s, lay) in arms.items()}
            rows.append([B, P, f"{B * steps / t['n=1']:.0f}", f"{t['n=1'] / t['SFA']:.0%}",
                         f"{t['n=1'] / t['SFA, whole cache']:.0%}", f"{t['SFA, whole cache'] / t['SFA']:.2f}x",
                         f"{t['n=1'] / t['all-full']:.0%}", f"{work['SFA'] / work['n=1']:.1f}x",
                         f"{work['all-full'] / work['n=1']:.1f}x"])
    show(f"4c. HD decode tokens/s against prompt length, 6-layer MoE width {width}, block size {block}, {steps} tokens "
         f"decoded after the prompt (targets: n={n} SFA >= 83% of n=1 at batch 1 with a 64-token prompt, >= 44% at "
         f"batch 16 with a 512-token one; the ring's gain alone, as the prompt grows: 4f)",
         rows, ["batch", "prompt (tokens)", "n=1 tokens/s", f"n={n} SFA (ring) as % of n=1",
                f"n={n} SFA, whole cache", "ring's gain over the whole cache", f"n={n} all-full",
                f"predicted attention work, n={n} SFA / n=1", "all-full / n=1"])


def graphed_vs_prompt(block, batches, device, repeats, steps, n=4, width=64):
    """4c on CUDA graphs: decode tokens/s as the prompt grows, each step replayed as a CUDA graph
    over static caches (which read their whole block, so each prompt gets models whose block just
    fits it): n = 1, n = 4 stream-factorized, n = 4 all-full, none with the KV-mirror skip. What a
    step then costs is its attention and projections, not its launches."""
    arms = {"n=1": (1, "IIFLII"), "SFA": (n, "IIFLII"), "all-full": (n, "FFFFFF")}
    rows = []
    for B in batches:
        for P in prompts_to(block, steps):
            models = {}
            for name, (streams, layout) in arms.items():
                torch.manual_seed(0)
                models[name] = HiddenDecoding(hd_cfg(streams, layout, P + steps, mirror_skip=False, n_embd=width,
                                                     head_dim=width // 4, expert_hidden=width)).to(device).eval()
            t = timeit({a: hd_decode(m, B, P, steps, device, graph=True) for a, m in models.items()}, repeats, device,
                       warmup=1)
            rows.append([B, P, f"{B * steps / t['n=1']:.0f}", f"{t['n=1'] / t['SFA']:.0%}",
                         f"{t['n=1'] / t['all-full']:.0%}"])
    show(f"4c (CUDA graph). HD decode tokens/s against prompt length, each step a CUDA graph, 6-layer MoE width "
         f"{width}, {steps} tokens after the prompt (the targets of 4c)", rows,
         ["batch", "prompt (tokens)", "n=1 tokens/s", f"n={n} SFA as % of n=1", f"n={n} all-full as % of n=1"])


def window_layer(block, batches, device, repeats, steps, n=4, width=64):
    """The ring against a whole cache where it acts alone: a one-layer HD model whose layer is
    L (M^local), decoding after prompts up to the block size. On the ring a step reads the
    window - 1 rows before the new token and its n rows, whatever the prompt; on a whole cache
    it reads all n * (S + 1) rows under the window mask, so its cost grows with the prompt."""
    prompts = prompts_to(block, steps)
    models = {}
    for name, kind in (("ring", HiddenDecoding), ("whole", WholeCache)):
        torch.manual_seed(0)
        cfg = hd_cfg(n, "L", block, n_layer=1, kv_mirror=False, n_embd=width, head_dim=width // 4, expert_hidden=width)
        models[name] = kind(cfg).to(device).eval()
    w, rows = models["ring"].cfg.window, []
    for B in batches:
        for P in prompts:
            t = timeit({a: hd_decode(m, B, P, steps, device) for a, m in models.items()}, repeats, device, warmup=1)
            rows.append([B, P, w - 1 + n, f"{n * (P + 1):,}", f"{t['ring'] * 1e3 / steps:.3f}",
                         f"{t['whole'] * 1e3 / steps:.3f}", f"{t['whole'] / t['ring']:.2f}x"])
    show(f"4f. The L layer alone: a one-layer HD n={n} model (layout L, window {w} rows) decoding {steps} tokens, "
         "its cache a ring (generate.WindowCache) or whole (the ring's gain grows with the prompt)", rows,
         ["batch", "prompt (tokens)", "rows read per step, ring", "rows read, whole cache", "ms per step, ring",
          "ms per step, whole cache", "ring's gain"])


def decode_profile(prompts, batches, device, steps, n=4, width=64):
    """Where a decode step's time goes (torch.profiler, self time on the host): the attention
    kernels' share and the ops issued per step, n = 1 and n = 4 (SFA, no skip). A step's op
    count does not grow with the prompt; its attention does."""
    rows = []
    for streams in (1, n):
        torch.manual_seed(0)
        cfg = hd_cfg(streams, "IIFLII", max(prompts) + steps + 1, mirror_skip=False, n_embd=width,
                     head_dim=width // 4, expert_hidden=width)
        model = HiddenDecoding(cfg).to(device).eval()
        for B in batches:
            for P in prompts:
                run = hd_decode(model, B, P, steps, device)
                run()
                with profiled() as p:
                    for _ in range(3):
                        run()
                ev = p.key_averages()
                total = sum(e.self_cpu_time_total for e in ev)
                att = sum(e.self_cpu_time_total for e in ev if "scaled_dot_product" in e.key)
                rows.append([B, f"n={streams}", P, f"{total / (3e3 * steps):.2f}", f"{att / total:.0%}",
                             f"{sum(e.count for e in ev) / (3 * steps):.0f}"])
    show(f"4d. Where a decode step's time goes, 6-layer MoE width {width} (torch.profiler, host self time; "
         "the profiler adds its own cost per op)", rows,
         ["batch", "model", "prompt (tokens)", "ms per step (profiled)", "attention kernels' share", "ops per step"])


def gqa_decode(keys, device, repeats, B=16, H=12, Hkv=2, hd=16):
    """moe.attend's folded GQA: with few queries (a decode step), the G = H / Hkv query heads
    of a K/V head run as G * Tq query rows of that one head, against SDPA's enable_gqa, which
    reads every K/V row once per query head. The mask is a cached F layer's (each query sees
    every earlier row). attend folds while G * Tq <= 32."""
    rows, G = [], H // Hkv
    for Tk in keys:
        for Tq in (1, 4, 8, 16):
            q = torch.randn(B, H, Tq, hd, device=device)
            k, v = (torch.randn(B, Hkv, Tk, hd, device=device) for _ in range(2))
            m = torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril(Tk - Tq)
            t = timeit({"gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
                        "fold": lambda: attend_folded(q, k, v, m)}, repeats, device)
            rows.append([Tk, Tq, G * Tq, f"{t['gqa'] * 1e6:.0f}", f"{t['fold'] * 1e6:.0f}",
                         f"{t['gqa'] / t['fold']:.2f}x", "fold" if G * Tq <= 32 else "enable_gqa"])
    show(f"4e. Attention of a decode step: query heads folded per K/V head vs SDPA's enable_gqa (batch {B}, "
         f"{H} query heads on {Hkv} K/V heads, head dim {hd})", rows,
         ["keys", "queries per head", "folded query rows", "enable_gqa (us)", "folded (us)", "fold's speed-up",
          "moe.attend takes"])


@torch.no_grad()
def timed_decode(model, step, idx, steps, device, graph=False):
    """Greedy: the prompt eager, then `steps` calls of step(token, caches=...), timed alone. graph:
    static caches, and the step captured after the prompt (generate.graphed_step), before the clock.
    Returns (tokens, seconds)."""
    caches = make_caches(model, static=graph)
    x = model(idx, caches=caches)[0][:, -1:].argmax(-1)
    step = graphed_step(model, caches, idx.size(0)) if graph else step
    out = [x]
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        x = step(x, caches=caches)[0][:, -1:].argmax(-1)
        out.append(x)
    sync(device)
    return torch.cat(out, 1), time.perf_counter() - t


def compiled_decode(cells, device, repeats, steps=32, width=64, layout="IIFLII", ns=(1, 4)):
    """gpt-fast's compiled decode step, as users get it (generate.compiled_step: fullgraph,
    dynamic): from the same prompt and caches, greedy, the compiled step against the same model
    eager (moe_dispatch "auto": a decode step's few rows gather) and against eager with the
    loop dispatch (the dispatch before "gather"). For each (batch, prompt) in cells, the models
    n = 1 and n = 4 are timed round-robin together, so n = 4's share of n = 1 is a ratio of one
    run. Reports the compile time (the first compiled decode's steps less a steady compiled
    decode's; the prompt runs eager, before the clock), the graphs compiled per model (one: no
    recompiles across steps), steady tokens/s, and whether the tokens agree."""
    from torch._dynamo.utils import counters

    rows = []
    for B, P in cells:
        arms, first, graphs = {}, {}, {}
        for n in ns:
            torch.manual_seed(0)
            cfg = hd_cfg(n, layout, P + steps + 1, n_layer=len(layout), kv_mirror=len(layout) >= 3, n_embd=width,
                         head_dim=width // 4, expert_hidden=width)
            model = HiddenDecoding(cfg).to(device).eval()
            loop = HiddenDecoding(replace(cfg, moe_dispatch="loop")).to(device).eval()
            loop.load_state_dict(model.state_dict())
            idx = torch.randint(cfg.vocab_size, (B, P), device=device)
            before = counters["stats"]["unique_graphs"]
            first[n] = timed_decode(model, compiled_step(model), idx, steps, device)[1]  # its first step compiles
            graphs[n] = counters["stats"]["unique_graphs"] - before
            arms.update({(n, "loop"): (loop, loop, idx), (n, "eager"): (model, model, idx),
                         (n, "compiled"): (model, compiled_step(model), idx)})
        runs, before = {k: [] for k in arms}, counters["stats"]["unique_graphs"]
        for _ in range(repeats):  # round-robin over both models' arms, as timeit
            for k, (m, step, idx) in arms.items():
                runs[k].append(timed_decode(m, step, idx, steps, device))
        later = counters["stats"]["unique_graphs"] - before  # recompiles after the first decode: none
        sec = {k: statistics.median(s for _, s in v) for k, v in runs.items()}
        speed = {k: B * steps / v for k, v in sec.items()}
        for n in ns:
            same = all(torch.equal(a, b) and torch.equal(a, c) for (a, _), (b, _), (c, _) in
                       zip(runs[n, "eager"], runs[n, "compiled"], runs[n, "loop"]))
            share = (" / ".join(f"{speed[n, k] / speed[ns[0], k]:.0%}" for k in ("eager", "compiled"))
                     if n != ns[0] else "")
            graph_count = f"{graphs[n]}" + (f" (+{later} later)" if later else "")
            rows.append([n, B, P, f"{first[n] - sec[n, 'compiled']:.0f}", graph_count,
                         *(f"{speed[n, k]:.0f}" for k in ("loop", "eager", "compiled")),
                         f"{sec[n, 'eager'] / sec[n, 'compiled']:.2f}x", f"{sec[n, 'loop'] / sec[n, 'compiled']:.2f}x",
                         share, "yes" if same else "no"])
    show(f"4g. A compiled decode step (generate.compiled_step: fullgraph, dynamic) vs eager, HD layout {layout}, "
         f"width {width}, {steps} greedy tokens after the prompt (targets at batch 1: compiled >= 3x eager and "
         f">= 2x the loop dispatch's eager; at batch 16, prompt 512: >= 1.3x; compile <= 60 s; n=4 keeps >= 83% "
         f"of n=1 at batch 1 and >= 44% at batch 16, prompt 512)", rows,
         ["n", "batch", "prompt (tokens)", "compile time (s)", "graphs compiled", "eager, loop dispatch (tokens/s)",
          "eager (tokens/s)", "compiled (tokens/s)", "compiled / eager", "compiled / loop eager",
          "n=4 as % of n=1 (eager / compiled)", "same tokens"])


def graphed_decode(device, repeats, steps=32, width=512, layout="IIFLII", ns=(1, 4), batches=(1, 16), P=64):
    """4k (CUDA). The decode step captured as a CUDA graph over static caches (generate's
    cuda_graph=True: one replay a step) against eager, greedy from the same prompt; the capture
    (one warm-up step and the recording) happens before the clock. Tokens/s, the graph against
    eager (target at batch 1, width 512: >= 10x), and n = 4's share of n = 1 under the graph,
    where a step costs HD's work rather than its kernel launches (HD Figure 5's measure)."""
    rows = []
    for B in batches:
        sec, tokens = {}, {}
        for n in ns:
            torch.manual_seed(0)
            cfg = hd_cfg(n, layout, P + steps + 1, n_layer=len(layout), kv_mirror=True, n_embd=width,
                         head_dim=width // 4, expert_hidden=width)
            model = HiddenDecoding(cfg).to(device).eval()
            idx = torch.randint(cfg.vocab_size, (B, P), device=device)
            for _ in range(repeats):
                for arm in ("eager", "graph"):
                    got, s = timed_decode(model, model, idx, steps, device, graph=arm == "graph")
                    sec.setdefault((n, arm), []).append(s)
                    tokens.setdefault((n, arm), got)
        speed = {k: B * steps / statistics.median(v) for k, v in sec.items()}
        for n in ns:
            share = f"{speed[n, 'graph'] / speed[ns[0], 'graph']:.0%}" if n != ns[0] else ""
            rows.append([n, B, P, f"{speed[n, 'eager']:.0f}", f"{speed[n, 'graph']:.0f}",
                         f"{speed[n, 'graph'] / speed[n, 'eager']:.1f}x", share,
                         "yes" if torch.equal(tokens[n, "eager"], tokens[n, "graph"]) else "no"])
    show(f"4k. The decode step as a CUDA graph (generate(..., cuda_graph=True)) vs eager, HD layout {layout}, "
         f"width {width}, {steps} greedy tokens after a {P}-token prompt (target at batch 1: >= 10x eager)", rows,
         ["n", "batch", "prompt (tokens)", "eager (tokens/s)", "CUDA graph (tokens/s)", "graph / eager",
          "n=4 as % of n=1 (graph)", "same tokens"])


def graphed_tah(device, repeats, steps=64, width=512, n_layer=6, P=64):
    """4l (CUDA). TaH decoding with each depth's pass replayed as a CUDA graph (generate_tah(...,
    cuda_graph=True)) against eager, batch 1, greedy: every token 2 passes ("always"), and the
    untrained decider (which sends about none on). A call's capture (one per depth) is inside its
    time; `steps` tokens amortize it."""
    torch.manual_seed(0)
    cfg = TaHConfig(vocab_size=512, block_size=P + steps + 1, n_layer=n_layer, n_embd=width, n_head=8, n_kv_head=2,
                    head_dim=max(16, width // 8), n_experts=0, ffn_hidden=3 * width, logit_topk=100, max_depth=2,
                    kv_mirror=n_layer >= 3)
    model = ThinkAtHard(cfg).to(device).eval()
    idx = torch.randint(cfg.vocab_size, (1, P), device=device)
    rows = []
    for mode in ("always", "decider"):
        sec, out = {}, {}
        for _ in range(repeats):
            for arm in ("eager", "graph"):
                sync(device)
                t = time.perf_counter()
                out[arm] = generate_tah(model, idx, steps, temperature=0, mode=mode, cuda_graph=arm == "graph")
                sync(device)
                sec.setdefault(arm, []).append(time.perf_counter() - t)
        speed = {k: steps / statistics.median(v) for k, v in sec.items()}
        same = torch.equal(out["eager"][0], out["graph"][0]) and torch.equal(out["eager"][1], out["graph"][1])
        rows.append([mode, f"{speed['eager']:.0f}", f"{speed['graph']:.0f}", f"{speed['graph'] / speed['eager']:.1f}x",
                     "yes" if same else "no"])
    show(f"4l. TaH decoding with each pass a CUDA graph vs eager, {n_layer}-layer dense width {width}, batch 1, {steps} "
         f"greedy tokens after a {P}-token prompt (captures inside the time)", rows,
         ["mode", "eager (tokens/s)", "CUDA graph (tokens/s)", "graph / eager", "same tokens and passes"])


def moe_dispatch_rows(rows_list, device, repeats, width=64, E=8, k=2):
    """The MoE layer alone (forward, no grad) over N rows: each dispatch's time, to place
    moe.GATHER_ROWS, the crossover "auto" uses between gather and sorting by expert."""
    torch.manual_seed(0)
    rows = []
    for N in rows_list:
        ms = {d: MoE(ModelConfig(n_embd=width, expert_hidden=width, n_experts=E, top_k=k, moe_dispatch=d)).eval()
              for d in ("gather", "masked", "grouped_mm", "loop")}
        for m in ms.values():
            m.load_state_dict(ms["gather"].state_dict())
        x = torch.randn(N, width, device=device)
        with torch.no_grad():
            r = timeit({d: (lambda m=m: m(x)) for d, m in ms.items()}, repeats, device)
        auto = MoE(ModelConfig(n_embd=width, expert_hidden=width, n_experts=E, top_k=k))
        rows.append([N, N * k, *(f"{r[d] * 1e6:.0f}" for d in ms), min(r, key=r.get),
                     moe_dispatch(auto, N, x.dtype, device)])
    show(f"4h. The MoE layer alone ({E} experts, top-{k}, width {width}, forward): time per dispatch "
         f"(eager, auto gathers up to moe.GATHER_ROWS = {GATHER_ROWS} (token, k) pairs)", rows,
         ["rows", "(token, k) pairs", "gather (us)", "masked (us)", "grouped_mm (us)", "loop (us)", "fastest",
          "auto picks (eager)"])


def compiled_tah(P, device, repeats, steps=32, width=64, n_layer=6, modes=("always", "decider")):
    """TaH decoding with each pass compiled (generate_tah(compile=True): tah.COMPILED_PASS) vs
    eager, batch 1, greedy; the loop between passes stays eager. The first mode compiles the
    graphs of both depths, the next reuses them. The decider is untrained (its passes column
    says how many it ran)."""
    torch.manual_seed(0)
    cfg = TaHConfig(vocab_size=512, block_size=P + steps + 1, n_layer=n_layer, n_embd=width, n_head=12,
                    n_kv_head=2, head_dim=width // 4, n_experts=0, ffn_hidden=3 * width, logit_topk=100,
                    max_depth=2, kv_mirror=n_layer >= 3)
    model = ThinkAtHard(cfg).to(device).eval()
    idx = torch.randint(512, (1, P), device=device)
    rows = []
    for mode in modes:
        def run(compile):
            sync(device)
            t = time.perf_counter()
            out = generate_tah(model, idx, steps, temperature=0, mode=mode, compile=compile)
            sync(device)
            return out, time.perf_counter() - t
        first = run(True)[1]
        runs = {False: [], True: []}
        for _ in range(repeats):
            for c in runs:
                runs[c].append(run(c))
        sec = {c: statistics.median(s for _, s in v) for c, v in runs.items()}
        same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for (a, _), (b, _) in zip(*runs.values()))
        passes = runs[False][0][0][1][:, P:].float().mean().item()
        rows.append([mode, f"{passes:.2f}", f"{first - sec[True]:.0f}", f"{steps / sec[False]:.0f}",
                     f"{steps / sec[True]:.0f}", f"{sec[False] / sec[True]:.2f}x", "yes" if same else "no"])
    show(f"4j. TaH decoding with each pass compiled (generate_tah(compile=True)) vs eager, {n_layer}-layer dense "
         f"backbone, width {width}, batch 1, a {P}-token prompt, {steps} greedy tokens", rows,
         ["mode", "passes per new token", "compile time (s)", "eager (tokens/s)", "compiled (tokens/s)",
          "compiled / eager", "same tokens"])


def compiled_training(L, ns, device, repeats, B=4, width=64, layout="IIFLII"):
    """An HD training step (forward, loss, backward) compiled (fullgraph) against eager, with
    the compile time (the first compiled step less a steady one)."""
    rows = []
    for n in ns:
        torch.manual_seed(0)
        model = HiddenDecoding(hd_cfg(n, layout, L, n_layer=len(layout), kv_mirror=len(layout) >= 3, n_embd=width,
                                      head_dim=width // 4, expert_hidden=width)).to(device).train()
        idx = torch.randint(512, (B, L + 1), device=device)
        compiled = torch.compile(model, fullgraph=True)
        t = time.perf_counter()
        train_step(compiled, idx)()
        first = time.perf_counter() - t
        r = timeit({"eager": train_step(model, idx), "compiled": train_step(compiled, idx)}, repeats, device)
        rows.append([n, f"{first - r['compiled']:.0f}", f"{r['eager'] * 1e3:.1f}", f"{r['compiled'] * 1e3:.1f}",
                     f"{r['eager'] / r['compiled']:.2f}x"])
    show(f"4i. A compiled HD training step (torch.compile, fullgraph) vs eager, layout {layout}, width {width}, "
         f"L={L} x B={B}", rows, ["n", "compile time (s)", "eager (ms)", "compiled (ms)", "compiled / eager"])


def cuda_attention(L, repeats):
    B, H, D = 4, 8, 64
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flex = torch.compile(flex_attention, dynamic=False)
    t = torch.arange(L, device="cuda")
    W = 256
    causal_bm = create_block_mask(full, None, None, L, L, device="cuda")
    local_bm = create_block_mask(local(W), None, None, L, L, device="cuda")
    m_local = dense_mask(local(W), t, t)
    r = timeit({"sdpa causal": lambda: attend(q, k, v, "causal"), "flex causal": lambda: flex(q, k, v, block_mask=causal_bm),
                "sdpa window (dense mask)": lambda: attend(q, k, v, m_local),
                "flex window": lambda: flex(q, k, v, block_mask=local_bm)}, repeats, "cuda")
    show(f"6a. CUDA attention, L={L}, bf16, window {W}", [[k, f"{v * 1e3:.3f}", f"{v / r['sdpa causal']:.2f}x"] for k, v in r.items()],
         ["path", "ms", "vs SDPA causal"])


def cpu_beside_gpu(repeats, gpu="cuda"):
    """7. The default preset's training steps (eager, float32; HD n = 1 and 4 at batch 8 x 64
    tokens; TaH's one-layer lookup model at batch 32, every token 2 passes) on the CPU (one thread)
    and on the GPU: how much one GPU speeds the tiny run's steps up."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for name, make, B, L in (
                ("HD n=1", lambda: HiddenDecoding(hd_cfg(1, "IIFLII", 64, window=16, vocab_size=9711)), 8, 64),
                ("HD n=4", lambda: HiddenDecoding(hd_cfg(4, "IIFLII", 64, window=16, vocab_size=9711)), 8, 64),
                ("TaH, 2 passes", lambda: ThinkAtHard(TaHConfig(vocab_size=24, block_size=64, n_layer=1, n_embd=64,
                                                                n_head=12, n_kv_head=2, head_dim=16, n_experts=0,
                                                                ffn_hidden=48, logit_topk=24, max_depth=2,
                                                                kv_mirror=False)), 32, 48)):
            ms = {}
            for dev in ("cpu", gpu):
                torch.manual_seed(0)
                model, idx = make().to(dev), torch.randint(24, (B, L + 1), device=dev)
                step = (tah_train(model, idx, torch.full((B, L), 2, device=dev)) if isinstance(model, ThinkAtHard)
                        else train_step(model, idx))
                ms[dev] = timeit({dev: step}, repeats, dev)[dev] * 1e3
            rows.append([name, f"{B} x {L}", f"{ms['cpu']:.1f}", f"{ms[gpu]:.1f}", f"{ms['cpu'] / ms[gpu]:.1f}x"])
    finally:
        torch.set_num_threads(threads)
    show("7. A default-preset training step (eager, float32) on the CPU (1 thread) and on the GPU", rows,
         ["model", "batch x tokens", "CPU (ms)", "GPU (ms)", "CPU / GPU"])


def progression_batch(i, B, L, V, device):
    """Batch i of a learnable stream: each row counts from a random start by a random stride
    (mod V), so the loss falls within a few steps and two runs' curves can be compared."""
    g = torch.Generator().manual_seed(i)
    start, stride = torch.randint(V, (B, 1), generator=g), torch.randint(1, 8, (B, 1), generator=g)
    idx = ((start + stride * torch.arange(L + 1)) % V).to(device)
    return idx[:, :-1], idx[:, 1:]


def compiled_against_eager(width, repeats, device="cuda", steps=30, B=8, L=256, n=4, seeds=range(5), tol=1e-3):
    """6b. The --compile training step (torch.compile fullgraph, AdamW, the router-bias update)
    against eager, both on the MoE dispatch a compiled step takes ("masked": the same algorithm on
    either side), from the same weights on the same batches, so that a bug can be told from rounding: (i) one step in float32: the loss and every gradient, which must agree
    within float32's tolerance (`tol`, relative to the largest gradient); (ii) `steps` float32
    steps: how far the losses drift; (iii) bf16 autocast (a CUDA run's precision) over several
    seeds: each seed's mean difference of the losses. Rounding moves the seeds each its own way;
    a bug moves them all one way (the verdict rule: one sign in every seed, |mean| > 2 std, and beyond
    float32's `tol`, so that equal runs are no bug)."""
    cfg = hd_cfg(n, "IIFLII", L, n_embd=width, n_head=8, n_kv_head=2, head_dim=max(16, width // 8),
                 expert_hidden=width, moe_dispatch="masked")
    dev = torch.device(device)

    def run(seed, compiled, n_steps, dtype):
        torch.manual_seed(seed)
        model = HiddenDecoding(cfg).to(device)
        fwd = torch.compile(model, fullgraph=True) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        losses, grads, times = [], None, []
        for i in range(n_steps):
            x, y = progression_batch(seed * 10_000 + i, B, L, cfg.vocab_size, device)
            sync(device)
            t = time.perf_counter()
            with torch.autocast(dev.type, dtype, enabled=dtype != torch.float32):
                loss = fwd(x, y)[1]
            loss.backward()
            if grads is None:
                grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            model.backbone.update_router_bias()
            losses.append(loss.item())
            times.append(time.perf_counter() - t)
        return losses, grads, times

    (le, ge, _), (lc, gc, _) = (run(seeds[0], c, 1, torch.float32) for c in (False, True))
    worst = max(((gc[k] - ge[k]).abs().max() / ge[k].abs().max().clamp_min(1e-12)).item() for k in ge)
    one = worst <= tol and abs(lc[0] - le[0]) <= tol * abs(le[0])
    print(f"\n6b. The --compile training step (fullgraph, dispatch masked, AdamW) vs eager, HD n={n}, width {width}, "
          f"L={L} x B={B}, from the same weights on the same batches\n(i) one step, float32: loss {le[0]:.6f} vs "
          f"{lc[0]:.6f}, largest gradient difference {worst:.1e} of its tensor's largest -> "
          f"{'agree' if one else 'DISAGREE'} (within {tol:g})")
    (le, _, _), (lc, _, _) = (run(seeds[0], c, steps, torch.float32) for c in (False, True))
    drift = [abs(a - b) / abs(a) for a, b in zip(le, lc)]
    print(f"(ii) {steps} steps, float32: largest loss difference {max(drift):.2%} (at step {drift.index(max(drift)) + 1})")
    means = []  # each seed's row printed as it finishes: a run cut at its limit keeps the seeds it had
    show(f"(iii) {steps} steps in bf16 autocast, each seed its own init and batches: (compiled - eager) / eager loss",
         [], ["seed", "mean", "largest", "eager step (ms)", "compiled step (ms)", "eager / compiled"])
    for seed in seeds:
        (le, _, te), (lc, _, tc) = (run(seed, c, steps + repeats, torch.bfloat16) for c in (False, True))
        diff = [(b - a) / a for a, b in zip(le[:steps], lc[:steps])]
        means.append(statistics.mean(diff))
        e_ms, c_ms = (statistics.median(t[-repeats:]) * 1e3 for t in (te, tc))
        print(f"| {seed} | {means[-1]:+.3%} | {max(map(abs, diff)):.3%} | {e_ms:.1f} | {c_ms:.1f} | {e_ms / c_ms:.2f}x |",
              flush=True)
    sd = statistics.stdev(means) if len(means) > 1 else float("inf")
    one_way = len({m > 0 for m in means}) == 1 and abs(statistics.mean(means)) > max(2 * sd, tol)  # tol: ties
    print(f"bf16: mean {statistics.mean(means):+.3%} ± {sd:.3%} over {len(means)} seeds -> "
          f"{'one way in every seed: a bug' if one_way else 'no common direction: rounding'}")


def looped_costs(device, repeats, L=128, B=4, prompt=64, steps=8, quick=False):
    """9. What a loop and ParScale cost against HD's streams (lab/compute.py, --suite hd-compute):
    the n = 1 model looped x4 (its whole stack run 4 times per token), ParScale P = 4 (4 copies side
    by side, each with its prefix), HD n = 4 and n = 1, IIFLII at width 64: a training step, and
    cached decoding (a cache per pass for the loop; one for ParScale's 4 x B rows) at batch 1 and
    16. HD's argument (HD §3), ParScale's too: at a small batch parallel streams use idle compute in
    one pass, a loop waits on itself."""
    torch.manual_seed(0)
    if quick:
        L, prompt, steps = 16, 8, 2
    base = HiddenDecoding(hd_cfg(1, "IIFLII", max(L, prompt + steps + 1), window=16)).to(device)
    arms = {"n=1": base, "n=1 looped x4": Looped(base, 4), "ParScale P=4": ParScale(base, 4),
            "HD n=4": expand_streams(base, 4)}
    idx = torch.randint(512, (B, L + 1), device=device)
    train = timeit({k: train_step(m, idx) for k, m in arms.items()}, repeats, device)
    rows = []
    for batch in (1, 16):
        p = torch.randint(512, (batch, prompt), device=device)
        dec = timeit({k: (lambda m=m: decode_greedy(m, p, steps)) for k, m in arms.items()}, repeats, device)
        rows.append((batch, dec))
    table = [[k, f"{train[k] / train['n=1']:.2f}x", f"{train[k] / train['HD n=4']:.2f}x"]
             + [f"{d[k] / d['n=1']:.2f}x" for _, d in rows] + [f"{d[k] / d['HD n=4']:.2f}x" for _, d in rows]
             for k in arms]
    show(f"9. A loop and ParScale against HD's streams: n=1 looped x4 (the whole stack, shared weights), ParScale P=4 "
         f"(4 copies with prefixes) vs n=1 and HD n=4, layout "
         f"IIFLII width 64; training step L={L} x B={B}; {steps} greedy decode steps after a {prompt}-token prompt "
         "(time ratios)", table,
         ["model", "train step vs n=1", "train step vs HD n=4", "decode B=1 vs n=1", "decode B=16 vs n=1",
          "decode B=1 vs HD n=4", "decode B=16 vs HD n=4"])


@torch.no_grad()
def decode_greedy(model, idx, steps):
    """Greedy cached decoding: one forward for the prompt, one per new token (a Looped model keeps a
    cache per pass; ParScale one for its copies' rows)."""
    looped = isinstance(model, Looped)
    caches = [make_caches(model.model) for _ in range(model.loops)] if looped else make_caches(
        model.model if isinstance(model, ParScale) else model)
    logits, _ = model(idx, caches=caches)
    for _ in range(steps):
        logits, _ = model(logits[:, -1:].argmax(-1), caches=caches)
    return logits


class OpCount(TorchDispatchMode):
    """The aten ops a call runs (the CPU's proxy for a GPU's kernel launches), and how many of them
    wait for the device to hand the host a value (.item(), nonzero, a boolean-mask index)."""

    def __init__(self):
        super().__init__()
        self.ops, self.syncs = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        bool_index = func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        self.syncs += func.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero") or bool_index
        return func(*args, **(kwargs or {}))


def counted(fn):
    with OpCount() as c:
        fn()
    return c


def op_counts(device, quick=False):
    """8. Aten ops per training step (forward and backward) and per decode step (one token after a
    16-token prompt, cached) at the default preset's shapes: HD n = 1 and 4 (layout IIFLII, width 64,
    batch 8 x 64 tokens) and TaH on lookups (one dense layer, batch 32 x 48, ~30% of tokens two
    passes; decoding under its decider, every token sent on); the ops that wait on the device,
    counted apart."""
    torch.manual_seed(0)
    B, L = (2, 16) if quick else (8, 64)
    hd_models = {n: HiddenDecoding(hd_cfg(n, "IIFLII", max(L, 32), window=16)).to(device) for n in (1, 4)}
    tah = ThinkAtHard(TaHConfig(vocab_size=24, block_size=max(L, 32), n_layer=1, n_embd=64, n_head=12, n_kv_head=2, head_dim=16,
                                n_experts=0, ffn_hidden=48, logit_topk=24, max_depth=2, kv_mirror=False,
                                threshold=0.01)).to(device)
    idx = torch.randint(24, (B, L + 1), device=device)
    depths = 1 + (torch.rand(B, L, device=device) < 0.3).long()

    def decode(model, tah_model=False):
        def run():
            with torch.no_grad():
                if tah_model:
                    cache = TaHCache(model, 1, device)
                    model(idx[:1, :16], mode="decider", cache=cache)
                    return lambda: model(idx[:1, 16:17], mode="decider", cache=cache)
                caches = make_caches(model)
                model(idx[:1, :16], caches=caches)
                return lambda: model(idx[:1, 16:17], caches=caches)
        return run

    cases = [(f"HD n={n}", train_step(m, idx), decode(m)) for n, m in hd_models.items()]
    cases.append(("TaH", tah_train(tah, idx, depths), decode(tah, tah_model=True)))
    rows = []
    for name, train, dec in cases:
        step = dec()  # the prompt outside the count
        t, d = counted(train), counted(lambda: torch.no_grad()(step)())
        rows.append([name, t.ops, t.syncs, d.ops, d.syncs])
    show(f"8. Aten ops per step (a dispatch-mode count: the CPU's proxy for kernel launches), batch {B} x {L} "
         "training, one decode token after a 16-token prompt", rows,
         ["model", "training ops", "of which wait on the device", "decode ops", "of which wait on the device"])


def section_table(mode, q, device, rep):
    """Every section a mode runs, id -> its call, in the order it prints them: a plain run's (any
    device; on CUDA 6a and 6b too), --compile's, or --cuda's (the sections only a GPU answers, most
    wanted first, so that a time limit cuts the least wanted)."""
    if mode == "compile":
        layout = "IL" if q else "IIFLII"
        return {
            "4g": lambda: compiled_decode([(1, 64), (16, 512)] if not q else [(1, 8)], device, rep, steps=4 if q else 32,
                                          layout=layout),
            "4i": lambda: compiled_training(16 if q else 128, [4] if q else [1, 4], device, rep, layout=layout),
            "4j": lambda: compiled_tah(8 if q else 64, device, rep, steps=4 if q else 32, n_layer=1 if q else 6,
                                       modes=("decider",) if q else ("always", "decider"))}
    if mode == "cuda":
        return {
            "4k": lambda: graphed_decode(device, rep),  # seconds: no compile
            "4l": lambda: graphed_tah(device, rep),
            "6b": lambda: compiled_against_eager(512, rep, steps=20),
            "6a": lambda: cuda_attention(1024 if q else 8192, rep),
            "7": lambda: cpu_beside_gpu(rep),
            "4g": lambda: compiled_decode([(1, 64)], device, rep, steps=32, width=512),
            "4": lambda: hd_serving({"short": 64, "long": 2048}, (1, 4, 16, 64), device, rep, steps=16, width=512,
                                    graph=True),
            "4c": lambda: graphed_vs_prompt(4096 + 16, (1, 16), device, rep, steps=16, width=512)}
    table = {
        "1": lambda: attention_by_mask(64 if q else 512, [1, 2, 4] if q else [1, 2, 4, 8], device, rep),
        "2": lambda: hd_steps(16 if q else 128, [1, 2, 4] if q else [1, 2, 4, 8], device, rep),
        "3": lambda: mirror_skip(16 if q else 128, 4, device, rep, widths=(32,) if q else (64, 256)),
        "4": lambda: hd_serving({"short": 8, "long": 32} if q else {"short": 64, "long": 512},
                                (1, 4) if q else (1, 4, 16, 64), device, rep, steps=2 if q else 8),
        "4c": lambda: decode_vs_prompt(72 if q else 4096 + 8, (1,) if q else (1, 16), device, rep, steps=2 if q else 8),
        "4d": lambda: decode_profile((8,) if q else (64, 1016), (1,) if q else (1, 16), device, steps=2 if q else 8),
        "4e": lambda: gqa_decode((64,) if q else (512, 4096), device, rep),
        "4h": lambda: moe_dispatch_rows((1, 4, 16, 64) if q else (1, 2, 4, 8, 16, 32, 64, 128, 512, 4096), device, rep),
        "4f": lambda: window_layer(72 if q else 4096 + 32, (1,) if q else (1, 16), device, rep, steps=2 if q else 32),
        "5": lambda: tah_costs(16 if q else 64, device, rep, widths=(32,) if q else (64, 256)),
        "5b": lambda: tah_profile(16 if q else 64, device, rep, width=32 if q else 256),
        "8": lambda: op_counts(device, quick=q),
        "9": lambda: looped_costs(device, rep, quick=q)}
    if device == "cuda":
        table["6a"] = lambda: cuda_attention(1024 if q else 8192, rep)
        table["6b"] = lambda: compiled_against_eager(512, rep, steps=20)
    return table


def main(argv=None):
    ap = argparse.ArgumentParser(description="cost of each mechanism, as measured ratios")
    ap.add_argument("--quick", action="store_true", help="small sizes, seconds (CI)")
    ap.add_argument("--repeats", type=int,
                    help=f"timed repeats per arm, their median reported, at most {MAX_REPEATS} (default: 15; 3 with "
                         "--quick)")
    ap.add_argument("--compile", action="store_true",
                    help="only compiled vs eager: 4g, the decode step, 4i, an HD training step (a compile per row), "
                         "and 4j, TaH decoding compiled per pass")
    ap.add_argument("--cuda", action="store_true",
                    help="only the sections a GPU answers, most wanted first: 4k, 4l, 6b, 6a, 7, 4g, 4, 4c "
                         "(gpu_check.sh)")
    ap.add_argument("--sections", help="a comma list of the sections to run, of those the mode runs (e.g. "
                                       "--cuda --sections 4k,6b); default: all of them")
    args = ap.parse_args(argv)
    if args.compile and args.cuda:
        ap.error("--compile and --cuda each run their own sections: give one")
    if args.cuda and not torch.cuda.is_available():
        ap.error("--cuda needs a CUDA GPU")
    if args.repeats is not None and not 1 <= args.repeats <= MAX_REPEATS:
        ap.error(f"--repeats must be an int in [1, {MAX_REPEATS}], got {args.repeats}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rep = args.repeats or (3 if args.quick else 15)
    mode = "cuda" if args.cuda else "compile" if args.compile else "plain"
    table = section_table(mode, args.quick, device, rep)
    chosen = list(table) if args.sections is None else args.sections.split(",")
    if unknown := [s for s in chosen if s not in table]:
        ap.error(f"--sections: no section {', '.join(unknown)} in this mode's {', '.join(table)}")
    dev = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# bench.py{' --quick' if args.quick else ''} on {dev}, torch {torch.__version__}, median of {rep}")
    if args.quick:
        print("--quick runs small sizes in seconds: the targets in the section titles are the full run's sizes', "
              "and its ratios are not comparable with them")
    for name in chosen:
        table[name]()


if __name__ == "__main__":
    main()
