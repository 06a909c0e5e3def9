#!/usr/bin/env bash
# The long-regime runs of docs/long-regime.md (1.5B model), on a host with 4 GPUs (H200s here), each job in
# the background (setsid) with its log in ~/long_regime_out, so that a leased machine can take files in other calls meanwhile.
#   bash experiments/long_regime_runs.sh benches        # random weights: rollout seconds vs tokens (P = 8 on GPU 0,
#                                                       # P = 64 on GPU 1), decode profile at 8 / 128 rows (GPU 2),
#                                                       # the decode step with XLA command buffers for loops (GPU 3)
#   bash experiments/long_regime_runs.sh front GGUF     # 7 arms x seeds 0-2, 12 steps, one run per GPU at 90% of
#                                                       # its memory (two per GPU at 45% ran out of memory);
#                                                       # PARALLEL, DEVICES, SEEDS, MEM_FRACTION override
#   bash experiments/long_regime_runs.sh front_mt GGUF  # the same front plus multi-turn code tool, independent
#                                                       # episodes vs trees of turns (3 seeds each, 12 steps)
#   bash experiments/long_regime_runs.sh fill GGUF NAME:SEED ...  # front runs round-robin over the GPUs, one at a
#                                                       # time per GPU at 90% of its memory (a 1.5B update does
#                                                       # not fit two per H200); NGPU overrides the GPU count
#   bash experiments/long_regime_runs.sh extra GGUF     # GPU 3: the task screen, then the 1.5B code-tool check
#   bash experiments/long_regime_runs.sh collect DIR    # the report and one archive of logs and summaries in DIR
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
LR=${LONG_OUT:-$HOME/long_regime_out}
RUNS=${LONG_RUNS:-$HOME/runs}
mkdir -p "$LR" "$RUNS"
bg() {  # bg GPU LOG CMD...: run in its own session, output to $LR/LOG
  local gpu=$1 log=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu setsid nohup bash -c "$*" > "$LR/$log" 2>&1 < /dev/null &
}
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
case "$1" in
  benches)
    R="python experiments/bench_rollout_seconds.py --preset qwen2.5-1.5b --segment 64 --max-tokens 512 --mean-length 185 --slots 2 4 8 --row-buckets 4"
    bg 0 rs_p8.log "$R --prompts 8 --repeats 3 --json $LR/rs_p8.json"
    bg 1 rs_p64.log "$R --prompts 64 --repeats 2 --json $LR/rs_p64.json"
    D="python experiments/bench_sampler.py --preset qwen2.5-1.5b --rows 8 32 128 --context 768 --no-tree --steps 64"
    bg 2 decode.log "$D --profile $LR/prof; python experiments/trace_summary.py $LR/prof --top 25 > $LR/prof_summary.txt 2>&1"
    bg 3 decode_cb.log "XLA_FLAGS=$CB $D; XLA_FLAGS=$CB $R --prompts 8 --repeats 3 --json $LR/rs_p8_cb.json"
    ;;
  front|front_mt)
    MT=""
    [ "$1" = front_mt ] && MT="configs/multiturn_code_tool_qwen15.gin configs/multiturn_code_tool_tree_qwen15.gin"
    M="RunConfig.model='$2'"
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.9}
    setsid nohup python experiments/efficacy.py run --seeds ${SEEDS:-0 1 2} --out "$RUNS/front" --parallel "${PARALLEL:-4}" \
      --devices ${DEVICES:-0 1 2 3} \
      --stop_after "${STOP_AFTER:-420}" --gin_param="$M" --gin_param=RunConfig.num_steps=12 \
      --gin_param=OptimizerConfig.total_steps=12 --gin_param=RunConfig.eval_every=6 \
      --gin_param=RunConfig.save_final=False \
      configs/qwen15_grpo16.gin configs/qwen15_grpo12.gin configs/qwen15_grpo8.gin configs/qwen15_slots_k2.gin \
      configs/qwen15_slots_k4.gin configs/qwen15_slots_k8.gin configs/qwen15_auto_shape.gin $MT \
      > "$LR/front.log" 2>&1 < /dev/null &
    ;;
  fill)
    # Round-robin over the host's GPUs (NGPU overrides); each GPU runs its share one after another, sharing one
    # persistent compilation cache so that the later runs skip most of the first step's compiles.
    gguf=$2; shift 2; ngpu=${NGPU:-$(nvidia-smi -L | wc -l)}; i=0
    declare -a queue
    for item in "$@"; do
      name=${item%%:*}; seed=${item##*:}; dir="$RUNS/front/$name/seed$seed"; mkdir -p "$(dirname "$dir")"
      g=$((i % ngpu)); i=$((i + 1))
      queue[$g]="${queue[$g]:-true}; XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 JAX_COMPILATION_CACHE_DIR=$HOME/jax_cache \
        python -m treejax.train configs/$name.gin \
        --gin_param=\"RunConfig.model='$gguf'\" --gin_param=RunConfig.num_steps=12 --gin_param=OptimizerConfig.total_steps=12 \
        --gin_param=RunConfig.eval_every=6 --gin_param=RunConfig.save_final=False --gin_param=RunConfig.seed=$seed \
        --gin_param=\"RunConfig.log_dir='$dir'\" > $dir.log 2>&1"
    done
    for g in "${!queue[@]}"; do bg "$g" "fill_gpu$g.log" "${queue[$g]}"; done
    ;;
  extra)
    M="RunConfig.model='$2'"
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.45}
    bg "${EXTRA_GPU:-3}" extra.log "python experiments/screen_tasks.py --model $2 --only basic_arithmetic_5x2/rg --only basic_arithmetic_5x2/rg_tags --num_problems 128 --k 4 --max_new_tokens 512 --segment_length 64 --json $LR/screen_qwen15.json; python -m treejax.train configs/multiturn_code_tool_qwen15.gin --gin_param=\"$M\" --gin_param=RunConfig.num_steps=3 --gin_param=OptimizerConfig.total_steps=3 --gin_param=EvalConfig.num_problems=64 --gin_param=RunConfig.save_final=False --gin_param=RunConfig.log_dir=\"'$RUNS/mt'\" --overwrite"
    ;;
  collect)
    python experiments/efficacy.py report --runs "$RUNS/front" --out "$LR/front" --baseline qwen15_grpo16 \
      > "$LR/report.log" 2>&1 || tail -n 3 "$LR/report.log"
    tar czf "$2/long_regime.tgz" --exclude=checkpoints --exclude='events.out*' --exclude=prof -C "$HOME" \
      "$(basename "$LR")" "$(basename "$RUNS")" 2>/dev/null
    ls -la "$2"
    ;;
  *) echo "usage: $0 benches | front GGUF | front_mt GGUF | fill GGUF NAME:SEED... | extra GGUF | collect DIR" >&2; exit 2 ;;
esac
