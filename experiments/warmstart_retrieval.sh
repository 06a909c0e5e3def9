#!/usr/bin/env bash
# The retrieval world's warm start (docs/sft.md, "Expert episodes"): treejax-sft on the expert episodes, then
# treejax-train's GRPO from its export, beside GRPO from the untaught model, on one GPU (no preallocation).
#   bash experiments/warmstart_retrieval.sh SMOLLM2_GGUF OUT_DIR [RL_STEPS [SFT_GIN_PARAM...]]
#     e.g. ... OUT_DIR 40 "SFTConfig.num_steps=128" "OptimizerConfig.total_steps=128" "OptimizerConfig.learning_rate=3e-5"
#   NO_UNTAUGHT=1 bash ...   (skip the untaught baseline, e.g. for a second SFT setting beside a first run's)
#   python experiments/config_report.py OUT_DIR        (the two RL jobs; the SFT summary is OUT_DIR/sft/summary.json)
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 SMOLLM2_GGUF OUT_DIR [RL_STEPS [SFT_GIN_PARAM...]]" >&2; exit 2; }
G=$1 o=$2 steps=${3:-40}; shift $(( $# < 3 ? $# : 3 ))
sft=(); for p in "$@"; do sft+=(--gin_param="$p"); done
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$o"
rl=(--gin_param="RunConfig.num_steps=$steps" --gin_param="OptimizerConfig.total_steps=$steps"
    --gin_param="RunConfig.checkpoint_every=0" --gin_param="RunConfig.tree_picture_every=0")
[ -n "${NO_UNTAUGHT:-}" ] ||
( python3 -m treejax.train configs/efficacy_retrieval.gin "${rl[@]}" --gin_param="RunConfig.model='$G'" \
    --gin_param="RunConfig.log_dir='$o/untaught'" > "$o/untaught.log" 2>&1 < /dev/null; echo $? > "$o/untaught.rc" ) &
python3 -m treejax.sft configs/sft_retrieval_expert.gin --gin_param="SFTConfig.model='$G'" "${sft[@]}" \
    --gin_param="SFTConfig.log_dir='$o/sft'" > "$o/sft.txt" 2>&1 < /dev/null
echo $? > "$o/sft.rc"
if [ -f "$o/sft/hf_export/config.json" ]; then
  python3 -m treejax.train configs/efficacy_retrieval.gin "${rl[@]}" --gin_param="RunConfig.model='$o/sft/hf_export'" \
      --gin_param="RunConfig.log_dir='$o/warm'" > "$o/warm.log" 2>&1 < /dev/null; echo $? > "$o/warm.rc"
fi
wait
tail -4 "$o/sft.txt"
python3 experiments/config_report.py "$o" | tee "$o/table.md"
