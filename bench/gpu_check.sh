#!/usr/bin/env bash
# GPU checks for Rewind, as one short script for a machine with CUDA (about 6 minutes on one H200):
#
#   bash bench/gpu_check.sh [OUTDIR]          # OUTDIR default: $OUT or ./gpu-check
#   GPU_CHECKS="5 6" bash bench/gpu_check.sh  # only those checks (a rerun inside a short lease)
#
# Each check runs on its own (a failure is logged and the next still runs), each program under
# `timeout $STEP_TIMEOUT` (default 300 s): a hung NCCL step cannot take the whole lease.
#
# 1. `rewind gpu`: NVML read from the real driver.
# 2. tiny_lm on CUDA: interrupted at step 35 and resumed, final weights bit-identical to an uninterrupted run.
# 3. With 2+ GPUs: tiny_lm_ddp on 2 ranks over NCCL (one device each), then resumed resharded on 1.
# 4. The stall benchmark with the state on the GPU (pinned staging buffer, side-stream copies).
# 5. Async sharded saves on CUDA (tiny_lm_ddp --async-save, NCCL + Rewind's own gloo group): killed in its
#    background persist of step 20, resumed from 10, bit-identical to an uninterrupted async run.
# 6. bench.multirank with the shards on the GPU (one rank per GPU): Rewind's async stall and time to durable
#    against DCP's async_save and save, peak RSS, training overhead (keys with a _cuda suffix).
#
# Rewind's own packages the GPU image may lack (sqlalchemy, alembic, mako, crc32c) can travel as wheels in
# .whl/ (see the device tool's notes); the catalog is SQLite under a temporary REWIND_HOME.
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-gpu-check}}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
STEP_TIMEOUT="${STEP_TIMEOUT:-300}"
for c in ${GPU_CHECKS:-}; do
  case "$c" in [1-6]) ;; *) echo "GPU_CHECKS: '$c' is not a check number (1-6, space-separated)" >&2; exit 2 ;; esac
done
rm -f bench/results.json  # a warm machine's earlier keys must not pass for this run's
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
WORK="$(mktemp -d)"
export REWIND_HOME="$WORK/home" REWIND_CATALOG_URL="" REWIND_CHECKPOINT_ROOT=""
log() { echo "[gpu_check] $*" | tee -a "$OUTDIR/summary.txt"; }
# same_weights A B WHAT: the two final.safetensors bit-identical (exit 1 otherwise), said in the summary.
same_weights() {
  "$PY" - "$1" "$2" "$3" <<'EOF' | tee -a "$OUTDIR/summary.txt"
import sys, torch
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
print(f"[gpu_check] {sys.argv[3]} bit-exact: {same}")
sys.exit(0 if same else 1)
EOF
}


"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA here"; print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count())' | tee -a "$OUTDIR/summary.txt"
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')

nvml() {
  "$PY" -m rewind.flows.cli gpu --json >"$OUTDIR/nvml.json"
  log "NVML: $(tr -d '\n ' <"$OUTDIR/nvml.json" | cut -c1-300)"
}

tiny_resume() {
  local TL=(timeout -k 10 "$STEP_TIMEOUT" "$PY" -m rewind.examples.tiny_lm --steps 60 --checkpoint-every 10 --seed 0)
  "${TL[@]}" --run ref --out "$WORK/ref" >"$OUTDIR/tiny.log" 2>&1
  "${TL[@]}" --run cut --out "$WORK/cut" --stop-after 35 >>"$OUTDIR/tiny.log" 2>&1
  "${TL[@]}" --run cut --out "$WORK/cut" >>"$OUTDIR/tiny.log" 2>&1
  same_weights "$WORK/ref/final.safetensors" "$WORK/cut/final.safetensors" "CUDA resume"
}

ddp_reshard() {
  local DDP=(timeout -k 10 "$STEP_TIMEOUT" "$PY" -m rewind.examples.tiny_lm_ddp --run ddp --checkpoint-every 10 --seed 0 --out "$WORK/ddp")
  "${DDP[@]}" --steps 20 --nproc 2 >"$OUTDIR/ddp.log" 2>&1
  "${DDP[@]}" --steps 30 --nproc 1 >>"$OUTDIR/ddp.log" 2>&1
  grep -o "resumed run ddp at step [0-9]* on 1 ranks" "$OUTDIR/ddp.log" | tee -a "$OUTDIR/summary.txt"
}

gpu_stall() {
  timeout -k 10 "$STEP_TIMEOUT" "$PY" -m bench.run --gib 1 --repeat 3 --sections stall --dir "$WORK" >"$OUTDIR/bench.log" 2>&1
  grep -A9 "GPU stall" "$OUTDIR/bench.log" | tee -a "$OUTDIR/summary.txt" || true
}

async_sharded() {
  local AS=(timeout -k 10 "$STEP_TIMEOUT" "$PY" -m rewind.examples.tiny_lm_ddp --checkpoint-every 10 --seed 0 --nproc 1 --async-save)
  "${AS[@]}" --run aref --steps 30 --out "$WORK/aref" >"$OUTDIR/async_sharded.log" 2>&1
  if REWIND_FAULT=kill:save.shard_written@20 "${AS[@]}" --run acut --steps 30 --out "$WORK/acut" \
    >>"$OUTDIR/async_sharded.log" 2>&1; then
    log "the rank was not killed in its step-20 persist"
    return 1
  fi
  "${AS[@]}" --run acut --steps 30 --out "$WORK/acut" >>"$OUTDIR/async_sharded.log" 2>&1
  grep -o "resumed run acut at step [0-9]*" "$OUTDIR/async_sharded.log" | tee -a "$OUTDIR/summary.txt"
  same_weights "$WORK/aref/final.safetensors" "$WORK/acut/final.safetensors" "async sharded resume on CUDA"
}

multirank_cuda() {
  timeout -k 10 "$STEP_TIMEOUT" "$PY" -m bench.multirank --device cuda --ranks "$GPUS" --mib-per-rank 512 --repeat 3 --overhead-pairs 2 \
    --dir "$WORK" >"$OUTDIR/multirank_cuda.log" 2>&1
  grep -E "^(multirank_|rewind_|dcp_|checkpoint_every|overhead_pct_each)" "$OUTDIR/multirank_cuda.log" \
    | sed "s/^multirank_[a-z_]*/&_cuda/" | tee -a "$OUTDIR/summary.txt"
}

# step N NAME FUNCTION: runs one check in a subshell (errexit on), timed; a failure is logged and the next
# check still runs; the script exits 1 at the end if any failed.
FAILED=0
step() {
  case " ${GPU_CHECKS:-1 2 3 4 5 6} " in *" $1 "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  log "$1/6 $2"
  (set -euo pipefail; "$3")
  local rc=$?
  if [ "$rc" -ne 0 ]; then FAILED=1; log "$1/6 FAILED (exit $rc)"; fi
  log "$1/6 took $((SECONDS - t0)) s"
}

set +e
step 1 "rewind gpu" nvml
step 2 "tiny_lm resume on CUDA" tiny_resume
if [ "$GPUS" -ge 2 ] || [[ " ${GPU_CHECKS:-3} " != *" 3 "* ]]; then
  step 3 "tiny_lm_ddp: 2 ranks over NCCL, then resharded onto 1" ddp_reshard
else
  log "3/6 skipped: $GPUS GPU(s), the NCCL reshard check needs 2"
fi
step 4 "stall benchmark with the state on the GPU" gpu_stall
step 5 "async sharded saves on CUDA (one rank, NCCL), resumed bit-exact" async_sharded
step 6 "bench.multirank with the shards on the GPU ($GPUS rank(s))" multirank_cuda
cp bench/results.json "$OUTDIR/results.json" 2>/dev/null
rm -rf "$WORK"
log "done: $([ "$FAILED" -eq 0 ] && echo "every check passed" || echo "some checks FAILED")"
exit "$FAILED"
