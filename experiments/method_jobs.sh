#!/usr/bin/env bash
# The 40-step real jobs of the second-model methods (docs/judges.md, "The 40-step jobs on one H200") and of MOSAIC
# (docs/worlds.md) beside GRPO, all at once on one GPU (no preallocation: the jobs share its memory, so their seconds
# are not a benchmark). Each job checkpoints every 10 steps and on SIGTERM; one stopped by SECONDS is continued with
# --resume when the script runs again (a finished job, one with OUT_DIR/NAME/summary.json, is skipped).
#   bash experiments/method_jobs.sh SMOLLM2_GGUF OUT_DIR SECONDS [agree]   (agree: also the 256-problem judge agreement)
#   MB=2 bash experiments/method_jobs.sh ...                               (RunConfig.micro_batches=2 for every job)
#   JOBS="grpo prm_steps" bash experiments/method_jobs.sh ...              (only these jobs; default: all below)
#   python experiments/config_report.py OUT_DIR                            (one table of the summaries)
# The GRPO baseline without dynamic sampling (the setting of the judge configs) is efficacy_grpo with
# --gin_param="RunConfig.dynamic_sampling=False" (and "RunConfig.seed=1" for a second seed).
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 3 ] || { echo "usage: $0 SMOLLM2_GGUF OUT_DIR SECONDS [agree]" >&2; exit 2; }
G=$1 o=$2 T=$3 agree=${4:-}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$o"
common=(--gin_param="RunConfig.model='$G'" --gin_param="RunConfig.num_steps=40" --gin_param="OptimizerConfig.total_steps=40"
  --gin_param="EvalConfig.num_problems=256" --gin_param="RunConfig.checkpoint_every=10" --gin_param="RunConfig.eval_every=20"
  --gin_param="RunConfig.tree_picture_every=0")
[ -n "${MB:-}" ] && common+=(--gin_param="RunConfig.micro_batches=$MB")
S=(--gin_param="ScorerConfig.model='$G'")
all="grpo fapo ssl slate mapo ets scope r3l spa_rl oprl mosaic prm_steps retrieval search_r2 cosearch"
for n in ${JOBS:-$all}; do [[ " $all " == *" $n "* ]] || { echo "no job $n (jobs: $all)" >&2; exit 2; }; done
job() {  # NAME CONFIG extra-gin-params...
  local n=$1 c=$2; shift 2
  [[ " ${JOBS:-$all} " == *" $n "* ]] || return
  [ -f "$o/$n/summary.json" ] && return
  local flag=(); [ -d "$o/$n/checkpoints" ] && flag=(--resume)
  ( timeout -s TERM -k 100 "$T" python3 -m treejax.train "configs/$c.gin" "${common[@]}" "$@" \
      --gin_param="RunConfig.log_dir='$o/$n'" "${flag[@]}" >> "$o/$n.log" 2>&1 < /dev/null; echo $? > "$o/$n.rc" ) &
}
job grpo efficacy_grpo
job fapo efficacy_fapo "${S[@]}"
job ssl efficacy_ssl "${S[@]}"
job slate efficacy_slate "${S[@]}"
job mapo efficacy_mapo "${S[@]}"
job ets efficacy_ets
job scope efficacy_scope "${S[@]}" --gin_param="RefinerConfig.model='$G'"
job r3l efficacy_r3l "${S[@]}"
job spa_rl efficacy_spa_rl
job oprl efficacy_oprl
job mosaic multiturn_user_mosaic --gin_param="RunConfig.task_options={
    'size': 1024, 'eval_size': 256, 'seed': 0, 'revealed': 1, 'unsafe': 0.25, 'user': 'model', 'user_model': '$G',
    'user_max_tokens': 32, 'user_temperature': 0.0, 'user_seed': 0, 'system_prompt': None, 'extraction': 'answer_line'}"
job prm_steps efficacy_prm_steps "${S[@]}"
job retrieval efficacy_retrieval                                   # the retrieval world's GRPO baseline
job search_r2 multiturn_retrieval_search_r2
job cosearch multiturn_retrieval_cosearch
if [ "$agree" = agree ] && [ ! -f "$o/agree.json" ]; then
  ( timeout -k 30 "$T" python3 experiments/judge_agreement.py --gin_file configs/efficacy_fapo.gin --problems 256 \
      --gin_param="RunConfig.model='$G'" "${S[@]}" --out "$o/agree.json" > "$o/agree.txt" 2>&1 ) &
fi
wait
python3 experiments/config_report.py "$o" | tee "$o/table.md"
