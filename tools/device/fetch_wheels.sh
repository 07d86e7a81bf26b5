#!/usr/bin/env bash
# Here, before a device call whose command runs Python tests or llguidance on the GPU machine (its
# image lacks llguidance, openai and jsonschema and cannot fetch them): downloads their wheels and
# their needs into .whl (ignored; carry it), the pure-Python ones once and the compiled ones for
# each of cp311/cp312/cp313 under .whl/bin/cpXYZ/ (the image's Python is only known there;
# tools/device/pending_checks.sh installs the right set). About 16 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
P=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
   --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64)
ver() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
get() { python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp "${P[@]}" "$@"; }
mkdir -p .whl
# the versions this machine's make deps installed, where it has them
for pk in "llguidance==$(ver llguidance)" "openai==$(ver openai)" jsonschema \
          jsonschema-specifications referencing distro pytest pluggy iniconfig packaging httpx httpx2 \
          httpcore httpcore2 truststore h11 anyio sniffio pydantic typing_extensions typing_inspection annotated_types \
          tqdm idna certifi attrs; do
  get --python-version 3.12 -d .whl "$pk"
done
for v in 3.11 3.12 3.13; do
  d=.whl/bin/cp${v/./}
  mkdir -p "$d"
  for pk in jiter rpds-py pydantic-core; do get --python-version "$v" -d "$d" "$pk"; done
done
du -sh .whl
