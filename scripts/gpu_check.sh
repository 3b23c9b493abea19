#!/usr/bin/env bash
# The prepared GPU check (scripts/gpu_check.py): on a lent GPU machine, install the carried
# wheels (scripts/gpu_wheels.sh made them here; no network there), put the project on the path
# under its installed names, and run every step within one budget. --dry-run: the same steps
# on the CPU with small sizes in this checkout's environment (CI runs it).
#
#   bash scripts/gpu_check.sh [--dry-run] OUT_DIR [gpu_check.py options, e.g. --steps tests]
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=()
if [ "${1:-}" = "--dry-run" ]; then DRY=(--dry-run); shift; fi
OUT="${1:?usage: scripts/gpu_check.sh [--dry-run] OUT_DIR [options]}"
shift
mkdir -p "$OUT"
if [ ${#DRY[@]} -gt 0 ]; then
  exec "${PY:-.venv/bin/python}" scripts/gpu_check.py --dry-run --out "$OUT" "$@"
fi
PY="${PY:-python3}"
SITE="${TLTD_GPU_SITE:-/tmp/tltd-site}"
if ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "no wheels in .whl: run scripts/gpu_wheels.sh on the development machine and carry .whl" >&2
  exit 2
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .whl/*.whl
# The project from its folders under its installed names (an editable install needs a build).
ln -sfn "$PWD/workers" "$SITE/tltd_workers"
ln -sfn "$PWD/clients" "$SITE/tltd_clients"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" scripts/gpu_check.py --out "$OUT" "$@"
