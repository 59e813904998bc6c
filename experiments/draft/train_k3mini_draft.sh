#!/usr/bin/env bash
# Train the DSpark draft for the shipped k3-mini (k3jax/assets/k3-mini-stdlib) on the data that model was trained on:
# the default `k3 train` corpus, the first 4 MiB of the sorted Python stdlib sources with the last 5% held out, in
# windows of 64 bytes (its training context). The target is frozen; only the draft (2 layers, width 384, K = 7, taps
# at layers 0, 2, 4, 6, 8: DraftConfig.for_target's defaults but the depth, 3.26M parameters) trains. The shipped
# draft's stage 1 (stage 2, train_k3mini_draft_greedy.sh, starts from it) is this script's default run.
#
#   bash experiments/draft/train_k3mini_draft.sh [OUT_DIR] [STEPS] [LAYERS]   # default /work/runs/k3mini-draft,
#                                                                            # 1500 steps, 2 draft layers
#   bash experiments/draft/train_k3mini_draft.sh /tmp/d 3              # a seconds-scale check of the command
#
# Sizing: ~0.75 steps/s (batch 16 x 64 tokens, 16 blocks per row) on the 2-core CPU alone, with the target's MXFP4
# experts dequantized (--target-dense; packed they ran an XLA loop that doubled the step): 1500 steps ~35 min alone.
# A line every 10 steps on stderr (loss, tokens/s, eta, the batch's greedy acceptance); every 100 steps the held-out
# draft loss, KL to the target, greedy accepted tokens per block and slot-1 agreement (also in OUT_DIR/metrics.jsonl).
# The draft lands in OUT_DIR/export (config.json + model.safetensors, DSpark layout).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-/work/runs/k3mini-draft}"
STEPS="${2:-1500}"
LAYERS="${3:-2}"
mkdir -p "$OUT"
exec .venv/bin/k3 train --draft-for k3jax/assets/k3-mini-stdlib --target-dense --draft-layers "$LAYERS" \
    --steps "$STEPS" --batch 16 --seq-len 64 --lr 3e-3 --seed 0 \
    --eval-at-start --eval-every 100 --log-every 10 \
    --metrics "$OUT/metrics.jsonl" --export "$OUT/export" --overwrite
