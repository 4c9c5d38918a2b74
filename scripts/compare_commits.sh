#!/usr/bin/env bash
# Does a change keep answers and stores as they were? An older commit's code and the working
# tree's each ingest the same document (prose and code, the first TOKENS tokens) with `emllm
# ingest`'s defaults, then answer the same questions greedily; the answers and every layer file
# are compared byte for byte.
#
#   bash scripts/compare_commits.sh OLD_COMMIT [TOKENS]      # e.g. 643f78a 32768
#
# Needs the installed .venv (scripts/install.sh). Works in /var/tmp/compare (removed first).
set -euo pipefail
old=${1:?usage: compare_commits.sh OLD_COMMIT [TOKENS]}
tokens=${2:-32768}
cd "$(dirname "$0")/.."
root=$(pwd)
PY=$root/.venv/bin/python
work=/var/tmp/compare
rm -rf "$work"; git worktree prune
mkdir -p "$work/path"
git worktree add -q --detach "$work/tree" "$old"
trap 'git -C "$root" worktree remove --force "$work/tree" 2>/dev/null || true' EXIT
ln -s "$work/tree/core" "$work/path/emllm"          # the old package first on the path
ln -s "$work/tree/emllm_cli" "$work/path/emllm_cli"
MODELS=$($PY -c "from emllm.home import models_dir; print(models_dir())")
TOKENS=$tokens WORK=$work $PY - <<'PYEOF'
import os
from transformers import AutoTokenizer
from emllm.home import models_dir
from emllm.evals.corpus import code, prose
tok = AutoTokenizer.from_pretrained(models_dir() / "smollm2")
ids = tok(prose() + "\n\n" + code(), add_special_tokens=False)["input_ids"]
n = int(os.environ["TOKENS"])
ids = (ids * (n // len(ids) + 1))[:n]
open(os.environ["WORK"] + "/doc.txt", "w").write(tok.decode(ids))
PYEOF
for side in old new; do
  if [ $side = old ]; then export PYTHONPATH=$work/path; else unset PYTHONPATH; fi
  export EMLLM_HOME=$work/$side EMLLM_MODELS=$MODELS HF_HUB_OFFLINE=1
  "$root/.venv/bin/emllm" ingest "$work/doc.txt" --store s --json > "$work/$side.ingest.json"
  for q in "What is this document about?" "Which Python module parses command-line arguments?"; do
    "$root/.venv/bin/emllm" ask "$q" --store s -n 48 --json |
      $PY -c "import json, sys; print(json.dumps(json.load(sys.stdin)['answer']))" >> "$work/$side.answers"
  done
done
unset PYTHONPATH
status=0
if cmp -s "$work/old.answers" "$work/new.answers"; then echo "answers: the same"; else echo "answers: DIFFER"; status=1; fi
n=0
for f in $(cd "$work/new/stores/s" && find layers -type f | sort); do
  n=$((n + 1))
  if ! cmp -s "$work/old/stores/s/$f" "$work/new/stores/s/$f"; then echo "differs: $f"; status=1; fi
done
echo "layer files compared: $n"
exit $status
