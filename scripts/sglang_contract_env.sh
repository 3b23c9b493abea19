#!/usr/bin/env bash
# Builds once, and prints the path of, the Python environment the SGLang contract tests run
# in (tests/sglang_contract/): the CPU torch build, sglang==$SGLANG_VERSION installed with
# --no-deps, the pure-Python packages its import needs, and an import-only torchvision
# stand-in. Every install goes through tests/sglang_contract/constraints.txt, which pins torch
# to the CPU build. The environment is cached under ~/.cache/tltd (or $TLTD_SGLANG_VENV),
# keyed by the files that define it, so later runs reuse it. Progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VERSION=0.5.23
HERE=tests/sglang_contract
PYTHON=${PYTHON:-python3}
key=$(cat "$0" "$HERE/requirements.txt" "$HERE/constraints.txt" \
  "$HERE/torchvision_standin/torchvision/__init__.py" | sha256sum | cut -c1-16)
VENV=${TLTD_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tltd/sglang-venv-$key}

if [ ! -f "$VENV/.complete" ]; then
  echo "building the SGLang contract environment in $VENV" >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$HERE/constraints.txt")
  "${pip[@]}" "torch==2.13.0" >&2
  "${pip[@]}" -r "$HERE/requirements.txt" >&2
  "${pip[@]}" --no-deps "sglang==$SGLANG_VERSION" >&2
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp -r "$HERE/torchvision_standin/torchvision" "$site/"
  "$VENV/bin/python" -c "import torch, sglang; assert torch.__version__.startswith('2.13.0')" >&2
  touch "$VENV/.complete"
fi
echo "$VENV"
