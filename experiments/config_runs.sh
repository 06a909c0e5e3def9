#!/usr/bin/env bash
# Short real jobs of several shipped configs at once on one GPU: each config runs `python -m treejax.train` for STEPS
# steps (OptimizerConfig.total_steps with it) and EVAL held-out problems, with the embedded SmolLM2 GGUF, all in
# parallel on the same card (no preallocation: the jobs share its memory, so their seconds are not a benchmark;
# each job's summary.json and log say what it did). Meant to show each config runs end to end on the GPU and what
# it prints; the efficacy comparisons are experiments/efficacy.py's.
#   bash experiments/config_runs.sh SMOLLM2_GGUF OUT_DIR STEPS EVAL CONFIG_NAME...      (config names: configs/NAME.gin)
#   python experiments/config_report.py OUT_DIR        (one table of the summaries)
# Each job is stopped after CONFIG_RUNS_TIMEOUT seconds (default 480); its log is OUT_DIR/NAME.log, rc in NAME.rc.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 5 ] || { echo "usage: $0 SMOLLM2_GGUF OUT_DIR STEPS EVAL CONFIG_NAME..." >&2; exit 2; }
gguf=$1 out=$2 steps=$3 eval=$4; shift 4
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$out"
for name in "$@"; do
  [ -f "configs/$name.gin" ] || { echo "no configs/$name.gin" >&2; exit 2; }
  ( timeout "${CONFIG_RUNS_TIMEOUT:-480}" python -m treejax.train "configs/$name.gin" \
      --gin_param="RunConfig.model='$gguf'" --gin_param="RunConfig.num_steps=$steps" \
      --gin_param="OptimizerConfig.total_steps=$steps" --gin_param="EvalConfig.num_problems=$eval" \
      --gin_param="RunConfig.checkpoint_every=0" --gin_param="RunConfig.log_dir='$out/$name'" \
      > "$out/$name.log" 2>&1 < /dev/null; echo $? > "$out/$name.rc" ) &
done
wait
