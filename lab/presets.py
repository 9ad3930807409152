"""
A preset's checks, run before anything is allocated or written (lab/runner.py's parse_flags), and
what a run's first lines say of how its models attend (describe).
"""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/presets.py is no script: run python train_tiny.py", file=sys.stderr)
    sys.exit(2)

import math
from dataclasses import fields

from checks import MAX_INT, check_fits
from hd_experiment import hd_config
from tah_experiment import tah_config
from tasks import Lookups

MAX_STEPS, MAX_SEEDS = 10**6, 1000  # the counts' stated maxima: steps (every *iters, warm-up, batches), seeds
COUNTS = {"seeds": MAX_SEEDS, **{f: MAX_STEPS for f in ("iters", "warmup", "hd_base_iters", "hd_cont_iters",
                                                          "tah_base_iters", "tah_sft_iters", "decider_iters",
                                                          "tah_eval_batches")}}
TEXT_VOCAB = 100_000  # the text's vocabulary is known only once it is read: at most cl100k's, for the size rule


def check_preset(preset, *, device="cpu", suites=(), text_suites=(), world=1, accum=1, sharing=1, ablations=False):
    """Every field in range, each suite's global batch (text_suites: those that train on text) cut
    into `world` ranks x `accum` micro-steps (an uneven cut is fine), and the models it builds
    valid and within the device's memory, shared by `sharing` processes (the one rule for sizes,
    checks.check_fits): the first problem as one line, or None. The addition task's model (lab/arith.py)
    is checked where it may run: with ablations (--suite all, --smoke), tah-add, or no suites named."""
    for f in fields(preset):
        v = getattr(preset, f.name)
        if isinstance(v, int) and not 1 <= v <= COUNTS.get(f.name, MAX_INT):
            return f"--{f.name} must be an int in [1, {COUNTS.get(f.name, MAX_INT):,}], got {v}"
        if isinstance(v, float) and not (math.isfinite(v) and v > 0):
            return f"--{f.name} must be a finite number > 0, got {v}"
    if not preset.two_hop + preset.three_hop < 1:
        return (f"--two_hop + --three_hop must be below 1 (some queries must be one-hop), got {preset.two_hop} + "
                f"{preset.three_hop}")
    if preset.symbols < 3:
        return f"--symbols must be >= 3 (a cycle where two hops differ from one and from none), got {preset.symbols}"
    if preset.digits > 18:
        return f"--digits must be <= 18 (the operands are int64), got {preset.digits}"
    if len(set(preset.plays)) != len(preset.plays):
        return f"--plays names a play twice: {','.join(preset.plays)}"
    if preset.hd_ns[:1] != (1,) or len(preset.hd_ns) < 2 or list(preset.hd_ns) != sorted(set(preset.hd_ns)) or max(preset.hd_ns) > 64:
        return f"--hd_ns must start at 1 (the control) and rise, at most 64, two values or more, got {preset.hd_ns}"
    for batch_field in dict.fromkeys("batch" if s in text_suites else "tah_batch" for s in suites):
        if getattr(preset, batch_field) < world * accum:
            return f"--{batch_field} {getattr(preset, batch_field)} has fewer rows than {world} rank(s) x {accum} micro-step(s) " \
                   "(--accum)"
    if set(suites) & {"hd-compute", "hd-compute-lr"}:  # their arms beyond HD's: a longer stage, the looped model
        from lab import compute
        if problem := compute.check_arms(preset, vocab=TEXT_VOCAB, max_steps=MAX_STEPS, device=device, sharing=sharing):
            return problem
    return check_models(preset, device, sharing, addition=ablations or not suites or "tah-add" in suites)


def check_models(preset, device, sharing=1, addition=True):
    problems = [("symbols/queries", Lookups(preset.symbols, preset.queries, preset.two_hop, per_problem=True))]
    if addition:  # imported here: a plain run has no addition task
        from lab.arith import Arith
        problems.append(("digits", Arith(preset.digits)))
    for name, task in problems:
        if task.problem_len > preset.block:
            return (f"--block {preset.block} holds no whole {type(task).__name__} problem ({task.problem_len} "
                    f"tokens): raise --block or lower --{name}")
    try:
        cfgs = [(hd_config(preset, TEXT_VOCAB, max(preset.hd_ns)), preset.batch)]
        lookups = Lookups(preset.symbols, preset.queries, preset.two_hop, preset.three_hop)
        for task, layers in [(lookups, preset.tah_layers)] + [(t, preset.add_layers) for _, t in problems[1:]]:
            cfgs.append((tah_config(preset, task, layers), preset.tah_batch))
    except ValueError as e:
        return f"this preset builds no valid model: {e}"
    for cfg, batch in cfgs:  # the largest model of each kind, training at its batch
        try:
            check_fits(cfg, batch, training=True, device=device, sharing=sharing)
        except ValueError as e:
            return f"{e} (--batch {preset.batch}, --tah_batch {preset.tah_batch})"
    return None
