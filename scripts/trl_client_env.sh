#!/usr/bin/env bash
# Builds once, and prints the path of, the Python environment TRL's own VLLMClient runs in for
# tests/trl_client/: the CPU torch build and trl with its dependencies, every install through
# tests/trl_client/constraints.txt (which pins torch to the CPU build). The daemon under test
# runs in the project's environment; only the client runs here, as a trainer's would. Cached
# under ~/.cache/tltd (or $TLTD_TRL_VENV), keyed by the files that define it. Progress goes to
# stderr; a failed build exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
HERE=tests/trl_client
PYTHON=${PYTHON:-python3}
key=$(cat "$0" "$HERE/requirements.txt" "$HERE/constraints.txt" | sha256sum | cut -c1-16)
VENV=${TLTD_TRL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tltd/trl-venv-$key}

if [ ! -f "$VENV/.complete" ]; then
  echo "building the TRL client environment in $VENV" >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$HERE/constraints.txt")
  "${pip[@]}" "torch==2.13.0" >&2
  "${pip[@]}" -r "$HERE/requirements.txt" >&2
  "$VENV/bin/python" -c "import torch, trl; from trl.generation.vllm_client import VLLMClient; assert torch.__version__.startswith('2.13.0')" >&2
  touch "$VENV/.complete"
fi
echo "$VENV"
