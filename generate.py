"""
Decoding for the three models: KV caches, sampling, and the generation loops.

The serving side, kept apart from the methods as gpt-fast keeps its generate.py apart from
its model.py: this file imports moe.py, hd.py and tah.py; they never import it. A model's
forward reads a cache through `len(cache)` and `cache.update(k, v)` only (TaH's through the
few calls its training cache `tah.DepthKV` lists, with the same update per layer), so the
caches here are plain buffers. In the order of this file:

- `generate` (moe, HD: each new token enters as its n stream rows in one step, the final
  stream's logits pick the next token, HD §3.2) and `generate_tah` (the decider sets each new
  token's depth, TaH §4.2), after `sample`; `lora_merged` runs the depth adapter as one matmul.
- `KVCache`: one layer's keys and values, allocated once at the first write and written in
  place, so a step writes its new rows and attention reads a view of the rows so far.
- `WindowCache`: a sliding-window (L) layer's ring of its last `window` rows, as Mistral's
  rolling buffer: memory and reads stay flat as the context grows (HD §3.2's promise for SFA).
- `make_caches(model)`: one per layer, for moe.Transformer and hd.HiddenDecoding (an HD layer
  that attends within one stream keeps one row per token, its streams as batch rows; an L
  layer its window; the others all n rows of each token).
- `TaHCache`: the calls of tah.DepthKV over preallocated buffers, with its (position, depth,
  exists) lookups.
- Speed, last: `compiled_step(model)`, `generate(..., compile=True)`'s one compiled decode step
  per model (torch.compile, fullgraph, dynamic), as gpt-fast compiles its decode_one_token;
  `StaticCache` and `graphed_step`, `generate(..., cuda_graph=True)`: the decode step captured
  once as a CUDA graph and replayed, caches read whole, the step's start a tensor
  (moe.cache_start); `StaticTaHCache` does the same per depth for `generate_tah(..., cuda_graph=True)`.

Run `python generate.py` to decode with the three untrained models.
"""

import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from checks import (MAX_INT, check_buffer, check_caches, check_generation, check_generator, check_kv, check_length,
                    check_logits, check_sampling, check_tokens, demo_args, is_int, real_device, recorded_step)
from hd import HiddenDecoding
from moe import Transformer, upcast
from tah import ThinkAtHard


# -----------------------------------------------------------------------------
# Decoding: sampling, HD's and the backbone's loop, TaH's loop


def sample(logits, temperature=1.0, sample_top_k=None, generator=None):
    """One token id per row of logits (B, V), as a (B, 1) tensor; temperature 0 is greedy;
    sample_top_k keeps the k largest logits (the sampling cut-off, not the MoE's top_k)."""
    check_logits(logits)
    check_sampling(temperature, sample_top_k, logits.size(-1))
    check_generator(generator)
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = upcast(logits) / temperature
    if sample_top_k is not None:
        kth = torch.topk(logits, sample_top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, sample_top_k=None, generator=None, compile=False,
             cuda_graph=False):
    """Sample max_new_tokens after idx (B, T) with a KV cache per layer (moe.Transformer,
    hd.HiddenDecoding). The prompt runs as one forward, then one forward per new token.
    compile: the per-token forwards run compiled (compiled_step; the first call compiles, for
    about a minute on a CPU); the prompt runs eager. cuda_graph (CUDA): the per-token forward is
    captured once as a CUDA graph over static caches and replayed (graphed_step). Same tokens as
    eager under greedy decoding, up to float rounding."""
    check_lm(model)
    check_decoding(model, idx, max_new_tokens, temperature, sample_top_k, generator, compile, cuda_graph)
    caches = make_caches(model, static=cuda_graph)
    step = compiled_step(model) if compile else model
    B, T = idx.shape
    out = torch.cat([idx, idx.new_zeros(B, max_new_tokens)], dim=1)  # the tokens, written in place
    logits, _ = model(idx, caches=caches)
    if cuda_graph and max_new_tokens > 1:
        step = graphed_step(model, caches, B)
    for t in range(T, T + max_new_tokens):
        out[:, t:t + 1] = token = sample(logits[:, -1], temperature, sample_top_k, generator)
        if t + 1 < T + max_new_tokens:  # the last token is returned, not fed
            logits, _ = step(token, caches=caches)  # a tensor of its own, not a view of out
    return out


@torch.no_grad()
def generate_tah(model, idx, max_new_tokens, temperature=1.0, sample_top_k=None, generator=None, mode="decider",
                 compile=False, cuda_graph=False):
    """Token-by-token decoding of a ThinkAtHard; the decider (or "standard"/"always") sets each
    token's depth. Returns (tokens (B, T + new), passes of every token that entered the model
    (B, T + new - 1)). compile: each pass runs compiled (ThinkAtHard.compile_passes, for this
    call), the loop between passes eager. cuda_graph (CUDA): each depth's pass of every batch row
    replayed as a CUDA graph (StaticTaHCache), the loop between passes eager."""
    check_tah(model, "generate_tah")
    check_decoding(model, idx, max_new_tokens, temperature, sample_top_k, generator, compile, cuda_graph)
    if mode == "oracle":
        raise ValueError("generate cannot use mode 'oracle': it needs the reference labels of unseen tokens")
    was = model.passes_compiled
    try:
        return tah_decode(model.compile_passes(compile or was), idx, max_new_tokens, temperature, sample_top_k,
                          generator, mode, cuda_graph)
    finally:
        model.compile_passes(was)


def check_decoding(model, idx, max_new_tokens, temperature, sample_top_k, generator, compile, cuda_graph):
    """generate's and generate_tah's arguments: the prompt and sampling, and the two speed flags."""
    check_generation(idx, max_new_tokens, temperature, sample_top_k, model.cfg)
    check_generator(generator)
    for name, flag in (("compile", compile), ("cuda_graph", cuda_graph)):
        if flag is not True and flag is not False:
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if cuda_graph and (compile or idx.device.type != "cuda"):
        raise ValueError("cuda_graph=True takes a model and tokens on a CUDA device, without compile")


def tah_decode(model, idx, max_new_tokens, temperature, sample_top_k, generator, mode, cuda_graph=False):
    """generate_tah's loop: the prompt in one forward, then one forward per new token."""
    B, T = idx.shape
    cache = StaticTaHCache(model, B, idx.device, graphed=True) if cuda_graph else TaHCache(model, B, idx.device)
    tokens = torch.cat([idx, idx.new_zeros(B, max_new_tokens)], dim=1)  # written in place
    depths = torch.zeros(B, T + max(max_new_tokens - 1, 0), dtype=torch.long, device=idx.device)
    with lora_merged(model):
        out = model(idx, mode=mode, cache=cache)
        depths[:, :T] = out.depths
        for t in range(T, T + max_new_tokens):
            tokens[:, t:t + 1] = sample(out.logits[:, -1], temperature, sample_top_k, generator)
            if t + 1 < T + max_new_tokens:
                out = model(tokens[:, t:t + 1], mode=mode, cache=cache)
                depths[:, t] = out.depths[:, 0]
    return tokens, depths


@contextmanager
def lora_merged(model):
    """Within: each of a ThinkAtHard's adapters runs merged into its weight, W + (alpha / r) B A
    (LoRALinear.merged), one matmul where it would take three. For decoding, where the weights
    hold still."""
    check_tah(model, "lora_merged")
    with torch.no_grad():
        for m in model.loras:
            m.merged = torch.addmm(m.base.weight, m.B, m.A, alpha=m.scale)
    try:
        yield
    finally:
        for m in model.loras:
            m.merged = None


# -----------------------------------------------------------------------------
# The caches: plain buffers, written in place


class KVCache:
    """Keys and values of one layer, room for `capacity` rows, written in place (gpt-fast's
    static cache). Unwritten rows are never read: attention sees the first len() rows."""

    def __init__(self, capacity):
        if not is_int(capacity) or not 1 <= capacity <= MAX_INT:
            raise ValueError(f"capacity must be an int in [1, 2**53], got {capacity!r}")
        self.capacity, self.len, self.k, self.v = capacity, 0, None, None

    def __len__(self):
        return self.len  # a Python int: reading it never waits on the device

    def check_room(self, k, v):
        """Before anything is written: k and v of the shape held, the batch the cache was started
        with, and room for their T rows. Returns T."""
        check_kv(k, v, self.k)
        T = k.size(2)
        if self.k is not None and k.size(0) != self.k.size(0):
            raise ValueError(f"the cache holds {self.k.size(0)} batch rows, this step has {k.size(0)}: "
                             "continue a cache with the batch it was started with")
        if self.len + T > self.capacity:
            raise ValueError(f"KV cache full: it holds {self.capacity} rows, {self.len} are written and "
                             f"{T} more do not fit")
        return T

    def allocate(self, k, rows):
        """The K and V buffers, `rows` rows like k's, at the first write (the size rule first)."""
        shape = (*k.shape[:2], rows, k.size(3))
        check_buffer((2, *shape), k.dtype, k.device, "a KV cache's keys and values")
        return k.new_zeros(shape), k.new_zeros(shape)

    def update(self, k, v):
        """Append k, v (B, Hkv, T, hd); return the K and V of every row so far."""
        T = self.check_room(k, v)
        if self.k is None:
            self.k, self.v = self.allocate(k, self.capacity)
        self.k[:, :, self.len:self.len + T] = k
        self.v[:, :, self.len:self.len + T] = v
        self.len += T
        return self.k[:, :, :self.len], self.v[:, :, :self.len]


class WindowCache(KVCache):
    """A sliding-window layer's keys and values (hd.py's L, M^local): only the last `window`
    rows, in a ring written in place (Mistral's rolling buffer cache), so memory and reads are
    O(window) whatever the context. len() counts every row written (positions go on past the
    ring); update returns what a new chunk's queries can reach: the window - 1 rows before it,
    in order, then the chunk. `capacity` bounds the rows written, as block_size does."""

    def __init__(self, window, capacity):
        if not is_int(window) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        super().__init__(capacity)
        self.window, self.ring = window, min(window, capacity)  # a window past the capacity keeps every row

    def update(self, k, v):
        T = self.check_room(k, v)
        if self.k is None:
            self.k, self.v = self.allocate(k, self.ring)
        before = torch.arange(self.len - min(self.window - 1, self.len), self.len, device=k.device) % self.ring
        keys, values = torch.cat([self.k[:, :, before], k], 2), torch.cat([self.v[:, :, before], v], 2)
        last = torch.arange(self.len + T - min(T, self.window), self.len + T, device=k.device)  # rows the ring keeps
        self.k[:, :, last % self.ring] = k[:, :, last - self.len]
        self.v[:, :, last % self.ring] = v[:, :, last - self.len]
        self.len += T
        return keys, values


def check_lm(model):
    if isinstance(model, ThinkAtHard) or not isinstance(model, (Transformer, HiddenDecoding)):
        raise ValueError(f"make_caches and generate take a moe.Transformer or hd.HiddenDecoding, got "
                         f"{type(model).__name__}" + (": use TaHCache and generate_tah" * isinstance(model, ThinkAtHard)))


def make_caches(model, static=False):
    """One cache per layer with room for block_size tokens (moe.Transformer, hd.HiddenDecoding):
    KVCache, or WindowCache for a sliding-window layer; static: StaticCache for every layer."""
    check_lm(model)
    per_token = getattr(model, "kv_rows_per_token", lambda i: 1)
    window = getattr(model, "kv_window", lambda i: None)
    rows = [model.cfg.block_size * per_token(i) for i in range(model.cfg.n_layer)]
    if static:
        return [StaticCache(r, window(i)) for i, r in enumerate(rows)]
    return [KVCache(r) if window(i) is None else WindowCache(window(i), r) for i, r in enumerate(rows)]


class TaHCache:
    """The TaH forward's cache preallocated for decoding B rows: the calls tah.DepthKV answers,
    with room for block_size tokens at every depth and every buffer (the (position, depth,
    exists) lookups, each layer's K/V) written in place at the slot of the pass add() opened.
    Why two caches: decoding writes in place, with no graph to keep; training needs every
    pass's K/V in the autograd graph, which tah.DepthKV keeps by concatenation."""

    def __init__(self, model, B, device):
        check_tah(model, "TaHCache")
        if not is_int(B) or B < 1:
            raise ValueError(f"B must be an int >= 1 (batch rows), got {B!r}")
        device = real_device(device)
        cfg = model.cfg
        self.capacity = cfg.block_size * cfg.max_depth
        check_buffer((3, B, self.capacity), torch.long, device, "a TaH cache's (position, depth, exists) lookups")
        self.lookups = [torch.zeros(B, self.capacity, dtype=dt, device=device) for dt in (torch.long, torch.long, torch.bool)]
        self.layers = [TaHLayerCache(self) for _ in range(cfg.n_layer)]
        self.batch, self.len, self.next_pos, self.rows, self.slot = B, 0, 0, None, 0  # slot: where the pass's rows start

    def reserve(self, T, block_size):
        """Claim positions for T new tokens; returns the first one."""
        check_length(self.next_pos, T, block_size)
        self.next_pos += T
        return self.next_pos - T

    def write(self, buf, new, dim):
        """Write new (B', ...) into buf's slots of this pass along dim, for the pass's batch rows."""
        dst = buf.narrow(dim, self.slot, new.size(dim))
        if self.rows is None:
            dst.copy_(new)
        else:
            dst.index_copy_(0, self.rows, new)

    def add(self, pos, depth, valid, rows=None):
        if self.len + pos.size(1) > self.capacity:
            raise ValueError(f"TaH cache full: it holds {self.capacity} rows, {self.len} are written and "
                             f"{pos.size(1)} more do not fit")
        self.rows, self.slot = rows, self.len
        for buf, x in zip(self.lookups, (pos, depth, valid)):
            self.write(buf, x, 1)
        self.len += pos.size(1)


class TaHLayerCache:
    """One layer of a TaHCache: moe's update(k, v), into the slots of the pass add() opened;
    its K/V buffers are allocated at the first write, when their shape is known."""

    def __init__(self, owner):
        self.owner, self.k, self.v = owner, None, None

    def update(self, k, v):
        o = self.owner
        if self.k is None:
            shape = (o.batch, k.size(1), o.capacity, k.size(3))
            check_buffer((2, *shape), k.dtype, k.device, "a TaH cache layer's keys and values")
            self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
        o.write(self.k, k, 2)
        o.write(self.v, v, 2)
        k, v = self.k[:, :, :o.len], self.v[:, :, :o.len]
        return (k, v) if o.rows is None else (k.index_select(0, o.rows), v.index_select(0, o.rows))


def check_tah(model, name):
    if not isinstance(model, ThinkAtHard):
        raise ValueError(f"{name} takes a tah.ThinkAtHard, got {type(model).__name__}" +
                         (": use generate and make_caches" * isinstance(model, (Transformer, HiddenDecoding))))


# -----------------------------------------------------------------------------
# Speed: the compiled decode step, and CUDA graphs over static caches


_compiled_steps = weakref.WeakKeyDictionary()  # model -> its compiled decode step


def compiled_step(model):
    """The model's forward compiled for decode steps, once per model (gpt-fast compiles its
    decode_one_token the same way). fullgraph: the whole step is one graph, or compiling fails.
    dynamic: the rows a cache holds are a symbolic size, so one graph serves every step. (The
    other way, gpt-fast's, reads the whole preallocated buffer under a mask with the position
    as a tensor: a read that grows with the capacity rather than the rows written, and every
    mask and check rewritten on tensors. Here the caches stay plain buffers read by length.)"""
    if model not in _compiled_steps:
        compiled = torch.compile(model, fullgraph=True, dynamic=True)

        def step(idx, caches):
            check_step(model, idx, caches)
            return compiled(idx, caches=caches)
        _compiled_steps[model] = step
    return _compiled_steps[model]


def check_step(model, idx, caches):
    """What the forward checks first, run eagerly before the compiled step: inside it a full cache
    surfaces as dynamo's "Observed exception", and an id past the vocabulary (CPU; on CUDA no value
    is read) as an index error naming generated code."""
    check_tokens(idx, None, model.cfg.vocab_size)
    per_token = getattr(model, "kv_rows_per_token", lambda i: 1)
    window = getattr(model, "kv_window", lambda i: None)
    start = check_caches(caches, model.cfg.n_layer, model.cfg.block_size, per_token, window)
    check_length(start, idx.size(1), model.cfg.block_size)


class StaticCache(KVCache):
    """gpt-fast's static cache, for a decode step replayed as a CUDA graph: every one of `capacity`
    rows is returned at every step (the layer's causal mask hides the rows not yet written), and the
    rows written are counted on the device (`written`, read by moe.cache_start), so that no shape
    and no host number the step reads changes from one step to the next. A sliding-window layer
    keeps every row too: its window is its mask's."""
    static = True

    def __init__(self, capacity, window=None):
        super().__init__(capacity)
        if window is not None and not (is_int(window) and window >= 1):
            raise ValueError(f"window must be None or an int >= 1 (its layer's mask's window), got {window!r}")
        self.window, self.written, self.step_rows = window, None, 0

    def update(self, k, v):
        T = self.check_room(k, v)
        if self.k is None:
            self.k, self.v = self.allocate(k, self.capacity)
            self.written = torch.zeros((), dtype=torch.long, device=k.device)
        rows = self.written + torch.arange(T, device=k.device)
        self.k.index_copy_(2, rows, k)
        self.v.index_copy_(2, rows, v)
        self.written += T
        self.len, self.step_rows = self.len + T, T  # the host's count, for the checks
        return self.k, self.v


class StaticTaHCache(TaHCache):
    """TaHCache for passes replayed as CUDA graphs (StaticCache's idea): a pass reads every slot
    (`len` is the capacity; the exists lookup, which the duo-causal mask reads, hides the unwritten
    ones), writes its rows at a slot counted on the device, and takes its positions from a device
    counter. graphed (CUDA): `graphed` replays each depth's pass of every batch row from a graph
    captured at its first step; a prompt, or a pass of some rows only, runs eagerly."""

    def __init__(self, model, B, device, graphed=False):
        if graphed is not True and graphed is not False:
            raise ValueError(f"graphed must be True or False, got {graphed!r}")
        if graphed and real_device(device).type != "cuda":
            raise ValueError(f"graphed=True replays CUDA graphs: it takes a CUDA device, got {device!r}")
        super().__init__(model, B, device)
        self.len, self.filled, self.graphs = self.capacity, 0, {}  # len: what a pass reads; filled: the host's count
        self.written, self.next_t = (torch.zeros((), dtype=torch.long, device=self.lookups[0].device) for _ in range(2))
        self.graphed = self.replay if graphed else None

    def reserve(self, T, block_size):
        super().reserve(T, block_size)  # the host's count: the length check
        start = self.next_t.clone()
        self.next_t += T
        return start

    def add(self, pos, depth, valid, rows=None):
        T = pos.size(1)
        if self.filled + T > self.capacity:
            raise ValueError(f"TaH cache full: it holds {self.capacity} rows, {self.filled} are written and {T} "
                             "more do not fit")
        self.rows, self.cols = rows, self.written + torch.arange(T, device=pos.device)
        for buf, x in zip(self.lookups, (pos, depth, valid)):
            self.write(buf, x, 1)
        self.written += T
        self.filled += T

    def write(self, buf, new, dim):
        rows = torch.arange(self.batch, device=buf.device) if self.rows is None else self.rows
        slots, new = (buf, new) if dim == 1 else (buf.transpose(1, 2), new.transpose(1, 2))  # (B, slots, ...)
        slots.index_put_((rows[:, None], self.cols[None, :]), new)

    @torch.no_grad()
    def replay(self, model, x, q_pos, d, valid, cache, rows):
        if rows is not None or x.size(1) > 1:
            return ThinkAtHard.run_pass(model, x, q_pos, d, valid, cache, rows)
        if (d, x.shape) not in self.graphs:
            self.graphs[d, x.shape] = self.capture(model, x, q_pos, d, valid)
        graph, inputs, (h, kept) = self.graphs[d, x.shape]
        for buf, new in zip(inputs, (x, q_pos, valid)):
            buf.copy_(new)
        graph.replay()
        self.filled += x.size(1)
        return h, list(kept)  # the forward writes into its list

    def capture(self, model, *args):
        """Depth d's pass on static inputs: a warm-up on a side stream, undone, then the recording."""
        x, q_pos, d, valid = (a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        saved = self.written.clone(), self.filled
        side = torch.cuda.Stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with recorded_step():  # the warm-up takes the kernels the capture records (checks.recorded_step)
            with torch.cuda.stream(side):
                ThinkAtHard.run_pass(model, x, q_pos, d, valid, self, None)
            torch.cuda.current_stream(x.device).wait_stream(side)
            self.written.copy_(saved[0])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = ThinkAtHard.run_pass(model, x, q_pos, d, valid, self, None)
        self.filled = saved[1]  # recorded, not run
        return graph, (x, q_pos, valid), out


@torch.no_grad()
def graphed_step(model, caches, B):
    """The decode step of B rows captured once as a CUDA graph over static caches (StaticCache),
    then replayed: one launch a step where eager launches every kernel of every layer (gpt-fast
    gets the same from torch.compile(mode="reduce-overhead")). A warm-up step runs first, on a side
    stream as CUDA asks, and is undone (the caches' counts put back; its rows are rewritten).
    Returns step(token, caches) -> (logits, None), the logits a buffer the next replay overwrites."""
    dev = caches[0].k.device
    token = torch.zeros(B, 1, dtype=torch.long, device=dev)
    counts = [(c.written.clone(), c.len) for c in caches]
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with recorded_step():  # the warm-up takes the kernels the capture records (checks.recorded_step)
        with torch.cuda.stream(side):
            model(token, caches=caches)
        torch.cuda.current_stream(dev).wait_stream(side)
        for c, (written, n) in zip(caches, counts):
            c.written.copy_(written)
            c.len = n
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # recorded, not run: the counts the capture adds on the host go back
            logits = model(token, caches=caches)[0]
    for c, (_, n) in zip(caches, counts):
        c.len = n

    captured = caches

    @torch.no_grad()
    def step(new, caches=captured):
        if caches is not captured:
            raise ValueError("a graphed step replays over the caches it was captured with: pass those")
        check_step(model, new, caches)
        token.copy_(new)
        graph.replay()
        for c in caches:
            c.len += c.step_rows
        return logits, None
    return step


if __name__ == "__main__":
    demo_args(__doc__)
    from hd import HDConfig
    from moe import ModelConfig
    from tah import TaHConfig

    torch.manual_seed(0)
    prompt = torch.randint(128, (1, 8))
    for model in (Transformer(ModelConfig(vocab_size=128)), HiddenDecoding(HDConfig(vocab_size=128, n_streams=4))):
        out = generate(model.eval(), prompt, 12, temperature=0)
        print(f"{type(model).__name__:>14}, greedy: {prompt[0].tolist()} -> {out[0, 8:].tolist()}")
    tah = ThinkAtHard(TaHConfig(vocab_size=128, n_experts=0, logit_topk=16)).eval()
    tokens, depths = generate_tah(tah, prompt, 12, temperature=0, mode="always")
    print(f"{'ThinkAtHard':>14}, greedy, every token 2 passes: {prompt[0].tolist()} -> {tokens[0, 8:].tolist()}")
