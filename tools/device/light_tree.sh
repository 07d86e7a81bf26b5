#!/usr/bin/env bash
# The device tool sends the working tree (at most 64 MiB); the bundled model is 46 MB of it. For a
# call that carries more than ~6 MB beside .devbin (Python wheels: tools/device/fetch_wheels.sh),
# `light_tree.sh out` takes models/gsm-k3 out of what travels (out of the index, its .gitignore
# exception dropped; the files stay on disk) and `light_tree.sh back` puts both back. Nothing may
# be committed in between (a commit then would drop the model from the tree): `out` refuses when
# anything is staged and installs a local pre-commit hook that refuses every commit until `back`
# removes it; `back` is safe to run twice.
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
  out)
    git diff --cached --quiet || { echo "light_tree: staged changes; commit them first" >&2; exit 1; }
    git rm -r -q --cached models/gsm-k3
    sed -i '/^!\/models\/gsm-k3\/$/d' .gitignore
    hook=$(git rev-parse --git-path hooks)/pre-commit
    if [ ! -e "$hook" ]; then # (a hook of the user's own is left alone)
      mkdir -p "$(dirname "$hook")"
      printf '%s\n' '#!/bin/sh' '# light_tree.sh out: removed by light_tree.sh back' \
        'echo "light_tree: models/gsm-k3 is out of the index; run tools/device/light_tree.sh back first" >&2' \
        'exit 1' > "$hook"
      chmod +x "$hook"
    fi
    echo "models/gsm-k3 left out of the tree that travels; run 'light_tree.sh back' after the call" ;;
  slim)
    # the other way round: the bundled model travels (tools/device/logits_env.sh) and the
    # goldens (~10 MB, tracked) stay here, taken out of the working tree until `back`
    git diff --quiet -- tests/golden || { echo "light_tree: tests/golden has changes; commit them first" >&2; exit 1; }
    rm -f tests/golden/*.bin
    echo "tests/golden/*.bin left out of the working tree; run 'light_tree.sh back' after the call" ;;
  back)
    hook=$(git rev-parse --git-path hooks)/pre-commit
    grep -qs 'light_tree.sh out' "$hook" && rm -f "$hook"
    git checkout -q .gitignore
    git reset -q HEAD -- models/gsm-k3
    git checkout -q -- tests/golden
    git diff --cached --quiet && echo "models/gsm-k3 tracked again" ;;
  *) echo "usage: light_tree.sh out|slim|back" >&2; exit 2 ;;
esac
