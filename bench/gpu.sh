#!/usr/bin/env bash
# GPU qualification in one command, for a machine with a CUDA GPU and a CUDA build of torch:
#
#     bash bench/gpu.sh [RESULTS_DIR]        (default: gpu-results)
#
# 1. installs trainwire without touching torch: from wheels in .whl/ when that folder exists
#    (a machine without an index), else `pip install --no-deps --no-build-isolation -e .`;
# 2. runs every CUDA test with deterministic settings (CUBLAS_WORKSPACE_CONFIG=:4096:8): fp32 and
#    bf16, full weights and LoRA, text and token batches, sampling;
# 3. runs the GPU benchmarks: the engine against a plain loop on the Qwen2-0.5B shape, token
#    losses, sampling against `generate`, concurrent sample requests batched, and the sharded
#    session's path (FSDP2 on a 1-rank NCCL group) beside a plain session: memory and step time;
#    and long sequences (8K and 32K tokens, one sequence): the peak a forward_backward adds with
#    the chunked head against the whole logits (at 8K), full weights and LoRA; and eight LoRA
#    runs (r=16, all linear layers) on one Qwen2-0.5B-shaped base: GPU memory against one run
#    (goal <= 1.25x), and steps/s interleaved on one `serve --max-runs 8` against one run alone;
#    and the same eight runs (r=8) computed together, one pass over the base for all of them,
#    against one run alone, each run's digest checked equal to alone (the probe first says
#    whether this GPU's kernels give a row the same bits alone and stacked; where they do not,
#    every run takes its turn and the ratio stays near 1), and their samples decoded together
#    against each run's in its own turn, every answer checked equal to its own turn's;
# 4. writes every figure into RESULTS_DIR/gpu-results.txt (and each step's log beside it).
#
# Without a CUDA device it refuses at once (exit 3) and runs nothing. Budget: about 25 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${1:-gpu-results}

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
then
    echo "bench/gpu.sh: no CUDA device: $PYTHON's torch sees no GPU (or torch is missing)." >&2
    echo "Run it on a machine with a CUDA GPU and a CUDA build of torch; nothing ran." >&2
    exit 3
fi

mkdir -p "$RESULTS"
SUMMARY="$RESULTS/gpu-results.txt"
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1

if [ -d .whl ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/trainwire-site \
        .whl/*.whl || exit 4
    export PYTHONPATH=/tmp/trainwire-site${PYTHONPATH:+:$PYTHONPATH}
else
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . || exit 4
fi

{
    echo "# trainwire GPU qualification, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    "$PYTHON" -c 'import torch, transformers; print("torch", torch.__version__, "cuda",
        torch.version.cuda, "transformers", transformers.__version__)'
} >"$SUMMARY"

failed=0
step() {  # step NAME TIMEOUT_S COMMAND...: run it, log it, and append its output to the summary
    local name=$1 limit=$2
    shift 2
    echo "== $name" | tee -a "$SUMMARY"
    timeout "$limit" "$@" >"$RESULTS/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$RESULTS/$name.log" >>"$SUMMARY"
    echo "== $name: exit $rc" | tee -a "$SUMMARY"
    [ "$rc" -eq 0 ] || failed=1
}

step cuda-tests 240 "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider \
    tests/test_session_cuda.py tests/test_tokens_cuda.py
step engine 150 "$PYTHON" bench/engine.py --device cuda --quick
step tokens 120 "$PYTHON" bench/tokens.py --device cuda --shape qwen2-0.5b --quick
step sampling 120 "$PYTHON" bench/sampling.py --device cuda --shape qwen2-0.5b --quick
step sampling-concurrent 120 "$PYTHON" bench/sampling_concurrent.py --device cuda --quick
step sharding 120 "$PYTHON" bench/sharding.py --device cuda --nproc 1
step long-context 300 "$PYTHON" bench/long_context.py --device cuda --steps 2
# Both many-runs benches in one step (about 2 minutes: three processes load the base, then one
# server opens ten runs); the throughput bench runs even when the memory bench fails.
step many-runs 300 bash -c '"$0" bench/many_runs.py "$@" --quick; memory=$?
    "$0" bench/many_runs_throughput.py "$@" --steps 10 && exit "$memory"' \
    "$PYTHON" --device cuda --shape qwen2-0.5b --runs 8
step runs-together 240 "$PYTHON" bench/runs_together.py --device cuda --shape qwen2-0.5b \
    --runs 8 --quick
step samples-together 180 "$PYTHON" bench/samples_together.py --device cuda --shape qwen2-0.5b \
    --runs 8 --quick

echo "results: $SUMMARY"
exit "$failed"
