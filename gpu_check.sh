#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one command (budget: under 10 minutes on one H100/H200):
#   1. the CUDA tests (python -m pytest -m cuda): flex_attention forward and backward equal to
#      the dense reference for every HD mask (also under the KV-mirror skip) and for TaH's
#      duo-causal mask, a bf16 training step, the compiled model equal to eager;
#   2. bench.py --cuda --repeats 5, most wanted first: flex_attention vs SDPA (6a); the default
#      CUDA run's compiled training step against eager, from one init on the same batches, their
#      losses step by step and the time per step (6b); the compiled decode step vs eager (4g);
#      HD serving (decode throughput of n=4 vs n=1, HD Figure 5, and against prompt length up to
#      4096 tokens), all at width 512.
# Writes out/gpu_check.md (and prints it).
set -uo pipefail
cd "$(dirname "$0")"
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: no CUDA GPU here (torch.cuda.is_available() is False)" >&2
    exit 1
fi
mkdir -p out
report=out/gpu_check.md
# Each step writes straight to the report, under a time limit that ends in SIGKILL (-k): a process
# stuck in a device call, or a compile worker that outlives its parent, can neither outlast the
# limit nor hold a pipe open (an earlier form piped pytest into tail under a plain timeout, and
# its one run on a GPU outlasted every limit, for a reason not known).
step() {  # step TITLE LIMIT_S COMMAND...
    local title=$1 limit=$2
    shift 2
    { echo; echo "## $title"; echo '```'; } >> "$report"
    PYTHONUNBUFFERED=1 timeout -k 10 "$limit" "$@" >> "$report" 2>&1
    local rc=$?
    { echo '```'; echo "exit status: $rc$([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo " (stopped at its ${limit}-s limit)")"; } >> "$report"
}
echo "# gpu_check.sh on $(python -c 'import torch; print(torch.cuda.get_device_name(), "torch", torch.__version__)'), $(date -u '+%F %H:%M UTC')" > "$report"
step "CUDA tests: python -m pytest -q -m cuda" 200 python -m pytest -q -m cuda -p no:cacheprovider
step "python bench.py --cuda --repeats 5" 330 python bench.py --cuda --repeats 5
cat "$report"
