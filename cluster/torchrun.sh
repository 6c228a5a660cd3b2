#!/usr/bin/env bash
# Run the labkit training loop on one node with torchrun.
#   NPROC      processes (default: one per GPU, or 2 on a CPU-only machine)
#   DEVICE     cuda | cpu (default: cuda when a GPU is visible)
#   STRATEGY   single | ddp | fsdp | zero1 | zero2 | zero3 | dp_naive | dp_bucketed | zero1_scratch | tp | pp
#              (default: ddp; tp and pp take --tp, --pp, --microbatches and --pp-schedule after the script name)
#   STEPS, SEED, and any extra flags of `python -m labkit.train` after the script name.
#   METRICS    the run's metrics JSON (default: _build/torchrun/metrics.json in this checkout; never its root)
#   PYTHON     the Python that has torch and labkit (default: this checkout's .venv/bin/python from
#              make venv, else python3; checked before anything runs)
set -euo pipefail
LABKIT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=/dev/null
. "$LABKIT_ROOT/cluster/find-python.sh"
find_python
PY=$PYTHON
export PYTHONPATH="$LABKIT_ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${DEVICE:-}" ]; then
  DEVICE=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
fi
if [ -z "${NPROC:-}" ]; then
  NPROC=$([ "$DEVICE" = cuda ] && $PY -c "import torch; print(torch.cuda.device_count())" || echo 2)
fi
exec $PY -m labkit.launch.torchrun --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 \
  -m labkit.train --device "$DEVICE" --strategy "${STRATEGY:-ddp}" \
  --steps "${STEPS:-200}" --seed "${SEED:-0}" --metrics "${METRICS:-$LABKIT_ROOT/_build/torchrun/metrics.json}" "$@"
