#!/usr/bin/env bash
# A venv of its own for bench/peers_bench.py: DeepSpeed and fairscale beside zero, never in the
# project's own dependencies. The CPU torch the project pins; DeepSpeed's ops are not built
# (DS_BUILD_OPS=0: its ZeRO stages 1 and 2 run in Python on the CPU accelerator).
set -euo pipefail
VENV=${PEERS_VENV:-/tmp/peers-venv}
cd "$(dirname "$0")/.."
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
DS_BUILD_OPS=0 "$VENV/bin/pip" install -q deepspeed==0.19.8 fairscale==0.4.13
"$VENV/bin/pip" install -q optree rich xxhash
"$VENV/bin/pip" install -q --no-deps -e .
echo "made $VENV: $VENV/bin/python bench/peers_bench.py"
