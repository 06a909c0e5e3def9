#!/usr/bin/env bash
# A tool world's methods from the warm-started model (docs/worlds.md, "From the warm start"): treejax-sft on the
# world's expert episodes (configs/sft_WORLD_expert.gin), then, from its export, all at once on one GPU (no
# preallocation: the jobs share its memory, so their seconds are not a benchmark), RL_STEPS (40) steps each with
# RunConfig.micro_batches=2, and GRPO from the untaught model beside them:
#   retrieval: GRPO on independent episodes (efficacy_retrieval), Search-R2, CoSearch, TreePS-RAG, MatchTIR
#   shell:     GRPO on independent episodes (efficacy_shell), A3's trees of turns (multiturn_shell_a3)
#   travel:    GRPO on independent episodes (multiturn_travel), DeepTravel (multiturn_travel_deeptravel)
# A job stopped by SECONDS checkpoints on SIGTERM; running the script again continues it (an unfinished run in the
# same log_dir resumes: treejax/run_dir.py) and skips the finished ones (OUT_DIR/NAME/summary.json).
#   bash experiments/warm_methods.sh WORLD SMOLLM2_GGUF OUT_DIR SECONDS [RL_STEPS [SFT_GIN_PARAM...]]
#   JOBS="warm_grpo untaught" bash experiments/warm_methods.sh ...   (only these jobs)
#   python experiments/config_report.py OUT_DIR     (one table; "with tools" is the held-out greedy episode's accuracy)
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 4 ] || { echo "usage: $0 WORLD SMOLLM2_GGUF OUT_DIR SECONDS [RL_STEPS [SFT_GIN_PARAM...]]" >&2; exit 2; }
W=$1 G=$2 o=$3 T=$4 steps=${5:-40}; shift $(( $# < 5 ? $# : 5 ))
case $W in
  retrieval) base=efficacy_retrieval; methods="search_r2:multiturn_retrieval_search_r2 cosearch:multiturn_retrieval_cosearch
             treeps:multiturn_retrieval_treeps matchtir:multiturn_retrieval_matchtir" ;;
  shell)     base=efficacy_shell; methods="a3:multiturn_shell_a3" ;;
  travel)    base=multiturn_travel; methods="deeptravel:multiturn_travel_deeptravel" ;;
  *) echo "no world $W (worlds with expert episodes: retrieval shell travel)" >&2; exit 2 ;;
esac
sft=(); for p in "$@"; do sft+=(--gin_param="$p"); done
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$o"
rl=(--gin_param="RunConfig.num_steps=$steps" --gin_param="OptimizerConfig.total_steps=$steps"
  --gin_param="RunConfig.checkpoint_every=0" --gin_param="RunConfig.tree_picture_every=0"
  --gin_param="RunConfig.eval_every=$(( steps >= 40 ? 20 : 0 ))" --gin_param="RunConfig.micro_batches=2")
job() {  # NAME CONFIG MODEL
  [ -z "${JOBS:-}" ] || [[ " $JOBS " == *" $1 "* ]] || return 0
  [ -f "$o/$1/summary.json" ] && return 0
  ( timeout -s TERM -k 20 "$T" python3 -m treejax.train "configs/$2.gin" "${rl[@]}" --gin_param="RunConfig.model='$3'" \
      --gin_param="RunConfig.log_dir='$o/$1'" >> "$o/$1.log" 2>&1 < /dev/null; echo $? > "$o/$1.rc" ) &
}
job untaught "$base" "$G"
[ -f "$o/sft/hf_export/config.json" ] ||
  python3 -m treejax.sft "configs/sft_${W}_expert.gin" --gin_param="SFTConfig.model='$G'" "${sft[@]}" \
    --gin_param="SFTConfig.log_dir='$o/sft'" > "$o/sft.txt" 2>&1 < /dev/null
if [ -f "$o/sft/hf_export/config.json" ]; then
  job warm_grpo "$base" "$o/sft/hf_export"
  for nc in $methods; do job "${nc%%:*}" "${nc#*:}" "$o/sft/hf_export"; done
else
  echo "treejax-sft wrote no export: see $o/sft.txt" >&2
fi
wait
tail -3 "$o/sft.txt"
python3 experiments/config_report.py "$o" | tee "$o/table.md"
