#!/usr/bin/env bash
# The shaping study (docs/credit-shaping.md): every arm x seed of configs/efficacy_slots_k8.gin, run side by side
# on one GPU, each run's summary copied to $RESULTS as <arm>-s<seed>.json (then experiments/shaping_report.py).
# CONFIG picks another efficacy config (the branching rules need configs/efficacy_treepo.gin: slot trees accept
# only slot-splitting rules that do not prune).
#
#   ARMS="name:extra treejax-train args;name2:..." SEEDS="0 1" bash experiments/shaping_runs.sh
#
# e.g. ARMS="base:;ear:--gin_param='RunConfig.shapers=[@EntropyAdvantageReshaping()]'" SEEDS="0 1 2"
# An H100's 80 GB holds about 4 of these runs at once with RunConfig.micro_batches=2 (EXTRA, added to every arm).
set -u
ARMS=${ARMS:?set ARMS="name:extra args;..."}
SEEDS=${SEEDS:-0 1}
CONFIG=${CONFIG:-configs/efficacy_slots_k8.gin}
EXTRA=${EXTRA:---gin_param=RunConfig.micro_batches=2}
RUNS=${RUNS:-runs/shaping}
RESULTS=${RESULTS:-experiments/results/shaping}
mkdir -p "$RUNS" "$RESULTS"
IFS=';' read -ra LIST <<< "$ARMS"
for A in "${LIST[@]}"; do
  NAME=${A%%:*}; ARGS=${A#*:}
  for S in $SEEDS; do
    eval "treejax-train $CONFIG $EXTRA $ARGS --gin_param=RunConfig.seed=$S \
      --gin_param=\"RunConfig.log_dir='$RUNS/$NAME-s$S'\"" > "$RUNS/$NAME-s$S.log" 2>&1 &
  done
done
wait
for A in "${LIST[@]}"; do
  NAME=${A%%:*}
  for S in $SEEDS; do
    grep -E "treejax run|held-out|Error" "$RUNS/$NAME-s$S.log" | head -3
    cp "$RUNS/$NAME-s$S/summary.json" "$RESULTS/$NAME-s$S.json" 2>/dev/null || echo "$NAME-s$S: no summary"
  done
done
