#!/usr/bin/env bash
# Every GPU check tpplan has, in one command, on a machine with NVIDIA GPUs (CI does not run it):
#
#   1. the Quickstart on CUDA + NCCL: one process, then every GPU under torchrun;
#   2. bf16 (FSDP2 mixed precision) and torch.compile through `tpplan train`, each against
#      the fp32 eager run's first loss;
#      context parallelism (cp 2, ring and Ulysses) against one GPU's first loss;
#   3. --profile on CUDA: a trace per rank, the collective table, the memory snapshot;
#   4. the 1b Llama shape on every GPU: measured MFU and peak memory against
#      `tpplan validate --device` of the same plan, the peak within the dry run's tolerance;
#   5. the figures appended to docs/benchmarks.md with the GPU's name.
#
# It fails loudly: the first check that does not hold stops it with "gpu_check: FAILED: why"
# and exit code 1; nothing is skipped. Without an NVIDIA GPU it refuses to start (exit 2).
#
#   scripts/gpu_check.sh [--steps N] [--out DIR] [--python PY] [--benchmarks FILE] [--no-append]
set -euo pipefail

STEPS=30
OUT=runs/gpu-check
PY=${PYTHON:-python}
BENCH=docs/benchmarks.md
APPEND=1

usage() {
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --steps) STEPS=${2:?--steps needs a number}; shift 2 ;;
        --out) OUT=${2:?--out needs a folder}; shift 2 ;;
        --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
        --benchmarks) BENCH=${2:?--benchmarks needs a file}; shift 2 ;;
        --no-append) APPEND=0; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done
if ! [[ "$STEPS" =~ ^[0-9]+$ ]] || (( STEPS < 10 )); then
    echo "gpu_check: --steps must be a whole number of at least 10 (the profile takes steps 3-4 and the curve must fall), got '$STEPS'" >&2
    exit 2
fi

cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

fail() {
    echo "gpu_check: FAILED: $*" >&2
    exit 1
}
step() {
    echo
    echo "== gpu_check: $*"
}

# ---- refuse without a GPU -----------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi not found). This script checks tpplan on CUDA + NCCL and runs only on a machine with NVIDIA GPUs; on CPU the checks are the test suite: python -m pytest -q tests" >&2
    exit 2
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: nvidia-smi is here but torch.cuda.is_available() is False (a CPU build of torch? install torch 2.13's CUDA build). Refusing to run." >&2
    exit 2
fi
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
GPU=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")
TORCH=$("$PY" -c "import torch; print(torch.__version__)")
PRESET=$("$PY" -c "from tpplan.analysis.runs.expected import device_preset as d; p = d('$GPU'); print(p.name if p else '')")
echo "gpu_check: $NGPU × $GPU, torch $TORCH, device preset '${PRESET:-none}', $STEPS steps per run, runs in $OUT"
mkdir -p "$OUT"

# The Quickstart's mesh on NGPU ranks: tp 2 with FSDP2 over the rest where the count is even.
if (( NGPU % 2 == 0 )); then TP=2; else TP=1; fi

# Checks on a run folder, in Python: the curve is finite and falls, the row has GPU figures.
check_run() {  # check_run DIR WORLD
    "$PY" - "$1" "$2" <<'PYEOF' || fail "run $1: see above"
import json, math, sys
run, world = sys.argv[1], int(sys.argv[2])
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
assert rows, f"{run}: no metrics rows"
losses = [r["loss"] for r in rows]
assert all(math.isfinite(x) for x in losses), f"{run}: a loss is not finite: {losses}"
assert losses[-1] < losses[0], f"{run}: the loss did not fall ({losses[0]} -> {losses[-1]})"
last = rows[-1]
assert round(last["tokens_per_s"] / last["tokens_per_s_per_device"]) == world, f"{run}: world size"
assert last.get("peak_mem_gib", 0) > 0, f"{run}: no peak memory in the metrics (CUDA only)"
est = json.load(open(f"{run}/estimate.json"))
assert est["device_type"] == "cuda" and est["measured"]["peak_bytes"], f"{run}: estimate.json: {est}"
print(f"ok: {run}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {last['tokens_per_s']:,.0f} tokens/s, "
      f"peak {last['peak_mem_gib']:.2f} GiB")
PYEOF
}
first_loss() {
    "$PY" -c "import json; print(json.loads(open('$1/metrics.jsonl').readline())['loss'])"
}
same_first_loss() {  # same_first_loss DIR REFERENCE_DIR REL what
    "$PY" - "$1" "$2" "$3" "$4" <<'PYEOF' || fail "$4: first loss differs from the fp32 eager run's"
import json, sys
a, b, rel, what = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
la = json.loads(open(f"{a}/metrics.jsonl").readline())["loss"]
lb = json.loads(open(f"{b}/metrics.jsonl").readline())["loss"]
assert abs(la - lb) <= rel * abs(lb), f"{what}: step 1 loss {la} vs {lb} (fp32 eager), beyond {rel}"
print(f"ok: {what}: step 1 loss {la:.6f} vs {lb:.6f} (fp32 eager)")
PYEOF
}
COMMON=(--set "train.steps=$STEPS" --set checkpoint.enabled=false --set metrics.log_interval=5 --overwrite)

# ---- 1. the Quickstart on CUDA + NCCL ---------------------------------------------------------
step "Quickstart, one process on cuda"
"$PY" -m tpplan train --plan plans/llama.yaml --device cuda --set mesh.tp=1 \
    --set "metrics.run_dir=$OUT/world1" "${COMMON[@]}" || fail "tpplan train on one GPU exited $?"
check_run "$OUT/world1" 1

step "Quickstart under torchrun on all $NGPU GPU(s), tp $TP (NCCL)"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m tpplan train \
    --plan plans/llama.yaml --set "mesh.tp=$TP" --set "metrics.run_dir=$OUT/all" "${COMMON[@]}" \
    || fail "torchrun on $NGPU GPUs exited $?"
check_run "$OUT/all" "$NGPU"
same_first_loss "$OUT/all" "$OUT/world1" 1e-3 "all GPUs against one"

# ---- 2. bf16 and torch.compile through tpplan train -------------------------------------------
step "bf16 mixed precision (FSDP2 param_dtype bfloat16, reduce float32) on all GPUs"
"$PY" -m tpplan train --plan plans/llama.yaml --nproc "$NGPU" --set "mesh.tp=$TP" \
    --set "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}" \
    --set "metrics.run_dir=$OUT/bf16" "${COMMON[@]}" || fail "bf16 run exited $?"
check_run "$OUT/bf16" "$NGPU"
same_first_loss "$OUT/bf16" "$OUT/all" 2e-2 "bf16"

step "torch.compile of every block on all GPUs"
"$PY" -m tpplan train --plan plans/llama.yaml --nproc "$NGPU" --set "mesh.tp=$TP" \
    --set compile.enabled=true --set "metrics.run_dir=$OUT/compile" "${COMMON[@]}" \
    || fail "compiled run exited $?"
check_run "$OUT/compile" "$NGPU"
same_first_loss "$OUT/compile" "$OUT/all" 1e-3 "torch.compile"

# Context parallelism on CUDA: attention takes the mask path there (the mask-free causal
# blocks use CPU's flash kernel; docs/long-context.md), ring and Ulysses, against one GPU.
if (( NGPU >= 2 )); then
    for method in ring ulysses; do
        step "context parallelism on 2 GPUs: cp 2, $method, 4,096 tokens (NCCL)"
        "$PY" -m tpplan train --plan plans/llama-long.yaml --nproc 2 --set mesh.cp=2 \
            --set "context_parallel=$method" --set train.seq_len=4096 \
            --set "metrics.run_dir=$OUT/cp-$method" "${COMMON[@]}" \
            || fail "cp 2 ($method) exited $?"
        check_run "$OUT/cp-$method" 2
    done
    "$PY" -m tpplan train --plan plans/llama-long.yaml --set mesh.cp=1 --set train.seq_len=4096 \
        --set "metrics.run_dir=$OUT/cp-1" "${COMMON[@]}" \
        || fail "cp 1 exited $?"
    same_first_loss "$OUT/cp-ring" "$OUT/cp-1" 1e-3 "cp 2 ring"
    same_first_loss "$OUT/cp-ulysses" "$OUT/cp-1" 1e-3 "cp 2 ulysses"
fi

# ---- 3. --profile on CUDA ---------------------------------------------------------------------
step "--profile 3:4 on all GPUs: traces, the collective table, the memory snapshot"
"$PY" -m tpplan train --plan plans/llama.yaml --nproc "$NGPU" --set "mesh.tp=$TP" --profile 3:4 \
    --set "metrics.run_dir=$OUT/profile" "${COMMON[@]}" | tee "$OUT/profile.log" \
    || fail "profiled run exited $?"
for ((r = 0; r < NGPU; r++)); do
    [[ -s "$OUT/profile/profile/trace-rank$r.json" ]] || fail "no trace for rank $r"
    [[ -s "$OUT/profile/profile/memory-rank$r.pickle" ]] || fail "no memory snapshot for rank $r"
done
"$PY" - "$OUT/profile/profile/summary-rank0.json" "$NGPU" <<'PYEOF' || fail "profile summary: see above"
import json, sys
s = json.load(open(sys.argv[1]))
assert [r["step"] for r in s["steps"]] == [3, 4], s
for r in s["steps"]:
    assert r["compute_ms"] > 0, r
    if int(sys.argv[2]) > 1:
        assert r["collectives"] and sum(r["collective_ms"].values()) > 0, f"no NCCL time: {r}"
print("ok: profile:", json.dumps(s["steps"][-1]))
PYEOF
grep -q "tp n / ms\|dp_shard n / ms" "$OUT/profile.log" || [[ "$NGPU" == 1 ]] || fail "no profile table printed"

# ---- 4. the 1b shape: MFU and peak memory against the dry run ---------------------------------
ONEB=(--set model.config=1b --set train.seq_len=2048 --set "train.global_batch_size=$((4 * NGPU))"
      --set train.micro_batch_size=1 --set mesh.tp=1
      --set "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}")
step "1b Llama on all $NGPU GPU(s): seq 2048, 4 sequences per GPU per step, bf16, FSDP2"
"$PY" -m tpplan validate --plan plans/llama.yaml --world-size "$NGPU" "${ONEB[@]}" \
    ${PRESET:+--device "$PRESET"} --json > "$OUT/1b-validate.json" || fail "tpplan validate of the 1b plan exited $?"
"$PY" -m tpplan train --plan plans/llama.yaml --nproc "$NGPU" "${ONEB[@]}" \
    --set train.steps=12 --set train.warmup_steps=2 --set checkpoint.enabled=false \
    --set metrics.log_interval=1 --set "metrics.run_dir=$OUT/1b" --overwrite || fail "1b run exited $?"
"$PY" - "$OUT" "$GPU" "$NGPU" "$TORCH" "${PRESET:-none}" > "$OUT/1b-row.md" <<'PYEOF' || fail "1b figures: see above"
import json, statistics, sys, time
out, gpu, n, torch_version, preset = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
from tpplan.train.verdict import MEMORY_TOLERANCE
v = json.load(open(f"{out}/1b-validate.json"))
assert v["ok"], f"validate: {v.get('errors') or v.get('analysis_errors')}"
rows = [json.loads(line) for line in open(f"{out}/1b/metrics.jsonl")][2:]  # warm-up and compile left out
est = json.load(open(f"{out}/1b/estimate.json"))
measured, predicted = est["measured"]["peak_bytes"], v["memory_per_rank"]["peak"]
ratio = measured / predicted
mfu = statistics.median(r["mfu"] for r in rows) if rows[0].get("mfu") is not None else None
tps = statistics.median(r["tokens_per_s_per_device"] for r in rows)
st = v.get("step_time") or {}
print(f"1b: peak {measured / 2**30:.2f} GiB measured vs {predicted / 2**30:.2f} GiB dry run (x{ratio:.3f}); "
      f"MFU {mfu if mfu is None else f'{mfu:.1%}'} measured vs {st.get('mfu', 'n/a')} estimated", file=sys.stderr)
assert MEMORY_TOLERANCE[0] <= ratio <= MEMORY_TOLERANCE[1], \
    f"peak memory {measured} vs the dry run's {predicted}: x{ratio:.3f} outside {MEMORY_TOLERANCE}"
fmt = lambda x: "n/a" if x is None else f"{x:.1%}"
print(f"| {time.strftime('%Y-%m-%d')} | {n} × {gpu} | torch {torch_version} | {tps:,.0f} | {fmt(mfu)} | "
      f"{fmt(st.get('mfu'))} ({preset}) | {measured / 2**30:.2f} GiB | {predicted / 2**30:.2f} GiB | {ratio:.3f}× |")
PYEOF
ROW=$(cat "$OUT/1b-row.md")
echo "$ROW"

# ---- 5. the figures into docs/benchmarks.md ---------------------------------------------------
if (( APPEND )); then
    step "appending to $BENCH"
    if ! grep -q "^## GPU check (scripts/gpu_check.sh)" "$BENCH"; then
        cat >> "$BENCH" <<'MDEOF'

## GPU check (scripts/gpu_check.sh)

`scripts/gpu_check.sh` on a machine with NVIDIA GPUs: every GPU check passed, then the 1b
Llama (seq 2048, 4 sequences per GPU per step, bf16 parameters, FSDP2 over every GPU)
measured against `tpplan validate --device` of the same plan. MFU: median over steps 3-12;
memory: `torch.cuda.max_memory_allocated` against the dry run's peak per rank.

| date | GPUs | torch | tokens/s per GPU | MFU measured | MFU estimated (preset) | peak measured | peak dry run | ratio |
| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |
MDEOF
    fi
    echo "$ROW" >> "$BENCH"
fi
echo
echo "gpu_check: all checks passed on $NGPU × $GPU"
