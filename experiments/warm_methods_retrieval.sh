#!/usr/bin/env bash
# The retrieval world's methods from the warm-started model (docs/worlds.md, "From the warm start"): treejax-sft's
# expert-episode config (configs/sft_retrieval_expert.gin, 40 steps), then, from its export, all at once on one GPU
# (no preallocation: the jobs share its memory, so their seconds are not a benchmark), 40 RL steps each with
# RunConfig.micro_batches=2: GRPO on independent episodes (efficacy_retrieval), Search-R2, CoSearch, TreePS-RAG's
# trees of turns and MatchTIR. A job stopped by SECONDS checkpoints on SIGTERM; the same treejax-train command with
# the same log_dir continues it (an unfinished run resumes:
# treejax/run_dir.py); so does this script, run again (a job with OUT_DIR/NAME/summary.json is skipped).
#   bash experiments/warm_methods_retrieval.sh SMOLLM2_GGUF OUT_DIR SECONDS
#   python experiments/config_report.py OUT_DIR     (one table; "with tools" is the held-out greedy episode's accuracy)
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 3 ] || { echo "usage: $0 SMOLLM2_GGUF OUT_DIR SECONDS" >&2; exit 2; }
G=$1 o=$2 T=$3
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$o"
[ -f "$o/sft/hf_export/config.json" ] ||
  python3 -m treejax.sft configs/sft_retrieval_expert.gin --gin_param="SFTConfig.model='$G'" \
    --gin_param="SFTConfig.log_dir='$o/sft'" > "$o/sft.txt" 2>&1 < /dev/null
[ -f "$o/sft/hf_export/config.json" ] || { echo "treejax-sft wrote no export: see $o/sft.txt" >&2; exit 1; }
rl=(--gin_param="RunConfig.model='$o/sft/hf_export'" --gin_param="RunConfig.num_steps=40"
  --gin_param="OptimizerConfig.total_steps=40" --gin_param="RunConfig.checkpoint_every=0"
  --gin_param="RunConfig.tree_picture_every=0" --gin_param="RunConfig.eval_every=20" --gin_param="RunConfig.micro_batches=2")
for nc in warm_grpo:efficacy_retrieval search_r2:multiturn_retrieval_search_r2 cosearch:multiturn_retrieval_cosearch \
          treeps:multiturn_retrieval_treeps matchtir:multiturn_retrieval_matchtir; do
  n=${nc%%:*} c=${nc#*:}
  [ -f "$o/$n/summary.json" ] && continue
  ( timeout -s TERM -k 20 "$T" python3 -m treejax.train "configs/$c.gin" "${rl[@]}" \
      --gin_param="RunConfig.log_dir='$o/$n'" >> "$o/$n.log" 2>&1 < /dev/null; echo $? > "$o/$n.rc" ) &
done
wait
python3 experiments/config_report.py "$o" | tee "$o/table.md"
