#!/usr/bin/env bash
# Trains the bundled demo pair on one GPU (H200) from the running interpreter's standard library:
# byte-level BPE tokenizer, Qwen3.5 target, DFlash drafter; then reloads the exported folders and
# prints their figures (held-out loss, teacher-forced acceptance per draft slot). The bundled pair
# also went through a self-distillation fine-tune of the drafter (`deltaflash train generate`, then
# PART draft with DRAFT_INIT and DRAFT_DATA): deltaflash/assets/demo/README.md has the exact commands.
#
# Usage: bench/train_demo_pair.sh OUT_DIR [BLOCK_SIZE=8] [PART=all]   (PYTHON=... picks the interpreter)
#   PART all    : everything (about 15 minutes)
#   PART target : tokenizer + target (about 6.5 minutes with MAX_MINUTES=7 on an H200)
#   PART draft  : drafter + final evaluation (about 7.5 minutes), on the OUT_DIR a `target` run left
# Writes OUT_DIR/{tokenizer,target,draft}/ (each with training.json) and OUT_DIR/logs/*.log.
# Each training stage's --max-minutes covers its data loading, training, final evaluation and export.
# Environment: MAX_MINUTES (per training stage, default 6.5), LABELS (drafter labels: target or data,
# default target), DRAFT_DIR (drafter folder, default OUT_DIR/draft; lets two block sizes train side by side),
# LR (default 2e-3), DRAFT_INIT (drafter folder to start from), DRAFT_DATA (space-separated streams written by
# `deltaflash train generate`, trained on together with the corpus; a stream named twice counts twice).
set -euo pipefail

out=${1:?usage: bench/train_demo_pair.sh OUT_DIR [BLOCK_SIZE] [all|target|draft]}
block=${2:-8}
part=${3:-all}
py=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1
labels=${LABELS:-target}
draft_dir=${DRAFT_DIR:-$out/draft}
loop_args=(--device cuda --max-minutes "${MAX_MINUTES:-6.5}" --steps 6000 --batch-size 32 --seq-len 512 --lr "${LR:-2e-3}"
           --warmup 200
           --eval-every 500 --seed 0)

stage() {  # stage NAME LOG ARGS...: python -m deltaflash.train NAME ARGS..., logged to OUT_DIR/logs/LOG.log
  local name=$1 log=$2
  shift 2
  echo "=== $name: $*"
  "$py" -m deltaflash.train "$name" "$@" 2>&1 | tee "$out/logs/$log.log"
}

train_target() {
  stage tokenizer tokenizer --out "$out/tokenizer" --vocab-size 8192
  # GDN kernels: transformers' torch chunked form. fla-core 0.6's backward refuses to run on Hopper with
  # Triton >= 3.4, < 3.7.1 ("incorrect results for gated chunk_bwd_dqkwg", fla #640); the H200 machine
  # has Triton 3.6 (seen 2026-11-29). Set GDN_KERNEL=auto to use fla where its backward is allowed.
  local gdn=${GDN_KERNEL:-torch}
  stage target target --tokenizer "$out/tokenizer" --out "$out/target" "${loop_args[@]}" --gdn-kernel "$gdn"
  echo "$gdn" > "$out/gdn_kernel"
}

train_draft() {
  local gdn
  gdn=$(cat "$out/gdn_kernel")
  local log extra=()
  log=$(basename "$draft_dir")
  [[ -n ${DRAFT_INIT:-} ]] && extra+=(--init "$DRAFT_INIT")
  # shellcheck disable=SC2206  # word splitting is the point: one path per word
  [[ -n ${DRAFT_DATA:-} ]] && extra+=(--data $DRAFT_DATA)
  stage draft "$log" --target "$out/target" --out "$draft_dir" "${loop_args[@]}" --gdn-kernel "$gdn" \
    --block-size "$block" --labels "$labels" "${extra[@]}"
  stage evaluate "$log-evaluate" --target "$out/target" --draft "$draft_dir" --device cuda --gdn-kernel "$gdn"
}

"$py" -c 'import sys, torch, transformers, tokenizers; assert torch.cuda.is_available(), "no CUDA device";
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      "tokenizers", tokenizers.__version__, torch.cuda.get_device_name())'
"$py" -c 'import fla; print("fla", getattr(fla, "__version__", "?"))' 2>/dev/null \
  || echo "fla not importable: GDN runs on transformers' torch path"

SECONDS=0
case $part in
  all) train_target; train_draft ;;
  target) train_target ;;
  draft) train_draft ;;
  *) echo "PART must be all, target or draft (got $part)" >&2; exit 2 ;;
esac
echo "done in ${SECONDS}s: $out"
