#!/usr/bin/env bash
# On the GPU machine: install the carried flash-linear-attention wheels (once a machine) and run
# fla_kda_bench.py with this script's arguments (none: time its chunk KDA; gen/score DIR: see the
# script). The wheels are fetched here first (the GPU machine has no network) into .whl/, which
# .gitignore ignores and the device call carries (FLA_WHL: another folder of them, e.g. .whl-fla
# when the call cannot carry the whole of .whl beside the bundled model):
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl \
#     fla-core==0.6.0 flash-linear-attention==0.6.0 einops
set -euo pipefail
[ -d /tmp/site/fla ] ||
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site ${FLA_WHL:-.whl}/*.whl
PYTHONPATH=/tmp/site python3 tools/device/fla_kda_bench.py "$@"
