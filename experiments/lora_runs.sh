#!/usr/bin/env bash
# The 7B LoRA / QLoRA jobs of issue 45 on ONE GPU (docs/lora.md): treejax-train with configs/scale_qwen7b_lora.gin
# (Qwen2.5-7B's shape, random weights, the tokenizer of TOKENIZER), one run after the other in the background
# (setsid), logs and summaries in ~/lora_out, one persistent compilation cache.
#   bash experiments/lora_runs.sh start TOKENIZER [NAME ...]   # default all: lora_bf16_merged lora_bf16_unmerged
#                                                              # qlora_nf4_merged qlora_int8_merged; lora_resume
#   bash experiments/lora_runs.sh report [DIR]         # the table (python experiments/lora_report.py)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${LORA_OUT:-$HOME/lora_out}
mkdir -p "$OUT"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$HOME/jax_cache}
case "$1" in
  start)
    M="RunConfig.model='random:qwen2.5-7b@$2'"
    run() {  # run NAME BINDINGS...: one treejax-train job, its summary copied to $OUT/NAME.json
      local name=$1; shift
      local gp=(--gin_param="$M" --gin_param="RunConfig.log_dir='$HOME/runs/$name'")
      for b in "$@"; do gp+=(--gin_param="$b"); done
      echo "=== $name $(date +%T)"
      python -m treejax.train --gin_file=configs/scale_qwen7b_lora.gin "${gp[@]}" ${RESUME:-} > "$OUT/$name.log" 2>&1
      echo "exit $? $(date +%T)"
      cp "$HOME/runs/$name/summary.json" "$OUT/$name.json" 2>/dev/null
      du -sb "$HOME/runs/$name/checkpoints" 2>/dev/null | cut -f1 > "$OUT/$name.ckpt_bytes"
      tail -14 "$OUT/$name.log"
    }
    shift 2
    names=${*:-lora_bf16_merged lora_bf16_unmerged qlora_nf4_merged qlora_int8_merged}
    jobs=""
    for n in $names; do
      case $n in
        lora_bf16_merged) jobs+="run $n; " ;;
        lora_bf16_unmerged) jobs+="run $n \"LoRAConfig.sampler_weights='unmerged'\"; " ;;
        qlora_nf4_merged) jobs+="run $n \"LoRAConfig.base_dtype='nf4'\"; " ;;
        qlora_int8_merged) jobs+="run $n \"LoRAConfig.base_dtype='int8'\"; " ;;
        lora_resume)  # 2 steps with a checkpoint each step, then --resume to 3: the adapters-only restore at 7B
          jobs+="run $n RunConfig.num_steps=2 RunConfig.checkpoint_every=1; "
          jobs+="RESUME=--resume run $n RunConfig.num_steps=3; grep -h 'checkpoint step\\|resumed\\|loading\\|new run' \$OUT/$n.log; " ;;
        *) echo "unknown run $n" >&2; exit 2 ;;
      esac
    done
    setsid nohup bash -c "$(declare -f run); M=\"$M\"; OUT=$OUT; $jobs echo ALL DONE" > "$OUT/driver.log" 2>&1 < /dev/null &
    ;;
  report)
    python experiments/lora_report.py "${2:-$OUT}"
    ;;
esac
