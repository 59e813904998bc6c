#!/usr/bin/env bash
# Stage 2 of the shipped k3-mini draft: fine-tune the stage-1 draft (train_k3mini_draft.sh: distillation on the
# k3-mini's training text) on the k3-mini's own greedy continuations, the contexts speculative decoding shows it.
#
#   1. greedy_data.py: 4,096 windows of 64 bytes from the training split (a quarter with bytes shuffled per row),
#      each continued by 64 greedy tokens of the k3-mini  -> OUT/greedy.jsonl (one 128-byte document a line)
#   2. k3 tokenize --seq-len 128: 129-token rows of the document stream (the last 5% held out); documents are
#      separated, so a row holds the end of one and the start of the next, kept apart by segment ids
#   3. k3 train --draft-for ... --init STAGE1 on those rows: the same distillation objective, every position of a
#      document (prompt and continuation) an anchor candidate.
#
#   bash experiments/draft/train_k3mini_draft_greedy.sh [OUT_DIR] [STEPS] [INIT]
#       default /work/runs/k3mini-draft-greedy, 600 steps, init /work/runs/k3mini-draft/export (stage 1's default
#       output; the shipped draft is stage 2's result, so it is not the init)
#
# The shipped draft (k3jax/assets/k3-mini-stdlib/draft) is this script's default run. Sizing (2-core CPU, shared with
# other jobs): step 1 ~20 min (the decode loop at batch 128 keeps about one core busy), step 3 300-620 tokens/s at
# batch 8 x 128 tokens (600 steps ~25 min). The draft lands in OUT_DIR/export; its records in OUT_DIR/metrics.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-/work/runs/k3mini-draft-greedy}"
STEPS="${2:-600}"
INIT="${3:-/work/runs/k3mini-draft/export}"
mkdir -p "$OUT"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
[ -s "$OUT/greedy.jsonl" ] || .venv/bin/python experiments/draft/greedy_data.py "$OUT/greedy.jsonl" --rows 4096 \
    --batch 128 --seed 1 > "$OUT/greedy.json"
.venv/bin/k3 tokenize --data "$OUT/greedy.jsonl" --out "$OUT/shards" --preset k3-mini --seq-len 128 --overwrite
exec .venv/bin/k3 train --draft-for k3jax/assets/k3-mini-stdlib --init "$INIT" --target-dense \
    --data "$OUT/shards" --steps "$STEPS" --batch 8 --seq-len 128 --lr 1e-3 --seed 0 \
    --eval-at-start --eval-every 100 --log-every 10 \
    --metrics "$OUT/metrics.jsonl" --export "$OUT/export" --overwrite
