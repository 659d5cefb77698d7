#!/usr/bin/env bash
# GPU checks for Rewind, as one short script for a machine with CUDA (under 8 minutes on one H200):
#
#   bash bench/gpu_check.sh [OUTDIR]          # OUTDIR default: $OUT or ./gpu-check
#
# 1. `rewind gpu`: NVML read from the real driver.
# 2. tiny_lm on CUDA: interrupted at step 35 and resumed, final weights bit-identical to an uninterrupted run.
# 3. With 2+ GPUs: tiny_lm_ddp on 2 ranks over NCCL (one device each), then resumed resharded on 1.
# 4. The stall benchmark with the state on the GPU (pinned staging buffer, side-stream copies).
# 5. Async sharded saves on CUDA (tiny_lm_ddp --async-save, NCCL + Rewind's own gloo group): killed in its
#    background persist of step 20, resumed from 10, bit-identical to an uninterrupted async run.
#
# Rewind's own packages the GPU image may lack (sqlalchemy, alembic, mako, crc32c) can travel as wheels in
# .whl/ (see the device tool's notes); the catalog is SQLite under a temporary REWIND_HOME.
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-gpu-check}}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
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


"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA here"; print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count())' | tee "$OUTDIR/env.txt"
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')

log "1/5 rewind gpu"
"$PY" -m rewind.flows.cli gpu --json >"$OUTDIR/nvml.json" && log "NVML: $(tr -d '\n ' <"$OUTDIR/nvml.json" | cut -c1-200)"

log "2/5 tiny_lm resume on CUDA"
TL=("$PY" -m rewind.examples.tiny_lm --steps 60 --checkpoint-every 10 --seed 0)
"${TL[@]}" --run ref --out "$WORK/ref" >"$OUTDIR/tiny_ref.log" 2>&1
"${TL[@]}" --run cut --out "$WORK/cut" --stop-after 35 >"$OUTDIR/tiny_cut.log" 2>&1
"${TL[@]}" --run cut --out "$WORK/cut" >>"$OUTDIR/tiny_cut.log" 2>&1
same_weights "$WORK/ref/final.safetensors" "$WORK/cut/final.safetensors" "CUDA resume"

if [ "$GPUS" -ge 2 ]; then
  log "3/5 tiny_lm_ddp: 2 ranks over NCCL, then resharded onto 1"
  DDP=("$PY" -m rewind.examples.tiny_lm_ddp --run ddp --checkpoint-every 10 --seed 0 --out "$WORK/ddp")
  "${DDP[@]}" --steps 20 --nproc 2 >"$OUTDIR/ddp.log" 2>&1
  "${DDP[@]}" --steps 30 --nproc 1 >>"$OUTDIR/ddp.log" 2>&1
  grep -o "resumed run ddp at step [0-9]* on 1 ranks" "$OUTDIR/ddp.log" | tee -a "$OUTDIR/summary.txt"
else
  log "3/5 skipped: $GPUS GPU(s), the NCCL reshard check needs 2"
fi

log "4/5 stall benchmark with the state on the GPU"
"$PY" -m bench.run --gib 1 --repeat 3 --sections stall --dir "$WORK" >"$OUTDIR/bench.log" 2>&1
grep -A8 "GPU stall" "$OUTDIR/bench.log" | tee -a "$OUTDIR/summary.txt" || true
cp bench/results.json "$OUTDIR/results.json" 2>/dev/null || true

log "5/5 async sharded saves on CUDA (one rank, NCCL), resumed bit-exact"
AS=("$PY" -m rewind.examples.tiny_lm_ddp --checkpoint-every 10 --seed 0 --nproc 1 --async-save)
"${AS[@]}" --run aref --steps 30 --out "$WORK/aref" >"$OUTDIR/async_sharded.log" 2>&1
REWIND_FAULT=kill:save.shard_written@20 "${AS[@]}" --run acut --steps 30 --out "$WORK/acut" \
  >>"$OUTDIR/async_sharded.log" 2>&1 && { log "the rank was not killed in its step-20 persist"; exit 1; }
"${AS[@]}" --run acut --steps 30 --out "$WORK/acut" >>"$OUTDIR/async_sharded.log" 2>&1
grep -o "resumed run acut at step [0-9]*" "$OUTDIR/async_sharded.log" | tee -a "$OUTDIR/summary.txt"
same_weights "$WORK/aref/final.safetensors" "$WORK/acut/final.safetensors" "async sharded resume on CUDA"
rm -rf "$WORK"
log "done"
