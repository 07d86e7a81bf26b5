#!/usr/bin/env bash
# On the GPU machine: unpacks what tools/device/pack_devbin.sh packed into .devbin (once; every
# device script calls it first).
cd "$(dirname "$0")/../.." || exit 1
if [ -f .devbin/bin.tar.xz ]; then
  tar xJf .devbin/bin.tar.xz -C .devbin && rm -f .devbin/bin.tar.xz
fi
