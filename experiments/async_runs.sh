#!/usr/bin/env bash
# Asynchronous vs synchronous rollouts on a 2-GPU machine (docs/async.md): for each seed, the slot
# tree of configs/efficacy_slots_k8.gin as
#   sync1     synchronous, 1 GPU                      (CUDA_VISIBLE_DEVICES=0)
#   async1    sampler and learner threads on 1 GPU    (CUDA_VISIBLE_DEVICES=1, beside sync1)
#   sync2     synchronous, both GPUs (the default mesh: fsdp = 2)
#   async2    GPU 0 samples, GPU 1 learns, max_staleness = 1
#   async2tis async2 with decoupled PPO's behaviour weight (configs/efficacy_slots_k8_async.gin, tis_cap = 2)
# while nvidia-smi samples each GPU's utilization every 250 ms; then the table and each run's GPU busy fraction:
#   bash experiments/async_runs.sh OUT SEED [arm ...] [--gin_param=...]   (default arms: all five)
#   python experiments/async_report.py OUT --baseline sync2
#   python experiments/gpu_busy.py OUT
set -u
OUT=$1; SEED=$2; shift 2
ARMS=(); EXTRA=()
for a in "$@"; do case $a in --*) EXTRA+=("$a") ;; *) ARMS+=("$a") ;; esac; done
[ ${#ARMS[@]} -eq 0 ] && ARMS=(async2 async2tis sync2 pair)
mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=timestamp,index,utilization.gpu --format=csv,noheader,nounits -lms 250 \
  >> "$OUT/util-s$SEED.csv" &
SMI=$!
run() {  # run NAME CONFIG [bindings...]
  local name=$1 config=$2; shift 2
  python3 -m treejax.train --gin_file="$config" --gin_param="RunConfig.seed=$SEED" \
    --gin_param="RunConfig.log_dir='$OUT/logs/$name-s$SEED'" --gin_param="RunConfig.log_dir_mode='overwrite'" \
    "${EXTRA[@]}" "$@" > "$OUT/$name-s$SEED.log" 2>&1
  echo "$name seed $SEED: exit $?"
  cp "$OUT/logs/$name-s$SEED/summary.json" "$OUT/$name-s$SEED.json" 2>/dev/null
}
ASYNC=(--gin_param="RunConfig.async_rollouts=@AsyncConfig()" --gin_param="AsyncConfig.enabled=True"
       --gin_param="AsyncConfig.max_staleness=1")
for arm in "${ARMS[@]}"; do
  case $arm in
    async2) run async2 configs/efficacy_slots_k8.gin "${ASYNC[@]}" --gin_param="AsyncConfig.sampler_devices=1" ;;
    async2tis) run async2tis configs/efficacy_slots_k8_async.gin ;;
    sync2) run sync2 configs/efficacy_slots_k8.gin ;;
    pair) (CUDA_VISIBLE_DEVICES=0 run sync1 configs/efficacy_slots_k8.gin) & P1=$!
          (CUDA_VISIBLE_DEVICES=1 run async1 configs/efficacy_slots_k8.gin "${ASYNC[@]}") & P2=$!
          wait $P1 $P2 ;;
    *) echo "unknown arm $arm"; exit 2 ;;
  esac
done
kill $SMI
