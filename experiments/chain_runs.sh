#!/usr/bin/env bash
# The rollout chain's real jobs on a GPU (docs/ARCHITECTURE.md "Rollout sources"): a planner with a wrapper
# (DOTS + replay on the efficacy task, 10 steps), trees of turns with the code tool (5 steps) and multi-turn + SPEAR
# (a planner with a wrapper over turn forests, 5 steps), with the embedded SmolLM2-135M, in the background on one
# GPU (GPU env var, default 0), logs and summaries in ~/chain_out.
#   bash experiments/chain_runs.sh SMOLLM2_GGUF [GPU]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${CHAIN_OUT:-$HOME/chain_out}; mkdir -p "$out"
m="RunConfig.model='$1'"
run() {  # run NAME CONFIG STEPS
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 setsid nohup python -m treejax.train "configs/$2.gin" \
    --gin_param="$m" --gin_param="RunConfig.num_steps=$3" --gin_param="OptimizerConfig.total_steps=$3" \
    --gin_param="RunConfig.log_dir='$out/$1'" > "$out/$1.log" 2>&1 < /dev/null &
}
gpu=${2:-0}
CUDA_VISIBLE_DEVICES=$gpu; export CUDA_VISIBLE_DEVICES
run dots_replay efficacy_dots_replay 10
run multiturn_tree multiturn_code_tool_tree 5
run multiturn_spear multiturn_code_tool_spear 5
