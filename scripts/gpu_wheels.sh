#!/usr/bin/env bash
# Download the wheels that scripts/gpu_check.sh installs on a lent GPU machine (Python 3.12,
# manylinux x86-64, no network there). The machine's image already has torch, transformers,
# numpy, pytest, scipy, click, rich, prometheus-client, nvidia-ml-py, safetensors and tokenizers;
# these are the project's other runtime dependencies, one pinned version each, --no-deps.
#
#   bash scripts/gpu_wheels.sh [DIR]     (default .whl, which git ignores)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
LIMIT_MIB=50
PINS=(
  grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
  SQLAlchemy==2.1.9 alembic==1.20.1 Mako==1.4.3 MarkupSafe==3.0.4
  APScheduler==3.11.3 tzlocal==5.4.5
  starlette==1.10.0 uvicorn==0.54.0 h11==0.16.0 anyio==4.16.0 idna==3.20
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing_extensions==4.16.0 crc32c==2.9.post0 zstandard==0.25.0
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64 manylinux_2_34_x86_64; do
  PLATFORMS+=(--platform "$p")
done
mkdir -p "$DIR"
PY="${PY:-python3}"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d "$DIR" "${PINS[@]}"
size=$(du -sm "$DIR" | cut -f1)
echo "$(ls "$DIR" | wc -l) wheels, ${size} MiB in $DIR"
if [ "$size" -gt "$LIMIT_MIB" ]; then
  echo "wheels exceed ${LIMIT_MIB} MiB" >&2
  exit 1
fi
