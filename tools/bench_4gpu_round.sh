#!/bin/bash
# The 4-GPU rows of the scale issues in one device call, each side by side (Megatron Core 0.19.2, then ours, same
# flags, `.mref/side_by_side.sh`), or ours alone with MREF=0. The one-GPU anchors run two at a time on GPUs 0
# and 1 (own ports), then the 4-GPU rows one after another. A RESULT line per system as each row ends; logs
# under $OUT. Needs ../shared/megatron_reference copied to .mref/ with its wheel (see
# its README); run from the repository root on a machine of 4 GPUs.
#
#   ROWS="l8b_tp2dp2 l8b_dp4 mix_ep4" bash tools/bench_4gpu_round.sh        # a chosen few
#   MREF=0 ROWS="mix_ep4_overlap fine_ep4_overlap" bash tools/bench_4gpu_round.sh   # ours only
#   bash tools/bench_4gpu_round.sh --list                                    # the rows and their flags
#
# Rows (issue 44, dense, LLAMA8B = the 32-layer Llama-3-8B shape; issue 45, MoE):
#   l8b_1gpu / l8b_dp4 / l8b_tp2dp2 / l8b_tp4 / l8b_pp2dp2 / l8b_pp4_vp / l8b_cp2dp2_16k / nemo_cp2dp2
#   cp1_64k / cp4_64k / cp4_128k (8 layers, full recompute: per-GPU efficiency of CP=4 against CP=1)
#   mix_1gpu / fine_1gpu / mix_ep4 / fine_ep4 / mix_ep2dp2 / mix_ep2pp2 / qwen3_ep4 / dsv3_ep4
#   mix_ep4_overlap / fine_ep4_overlap (ours only: --overlap-moe-expert-parallel-comm --delay-wgrad-compute,
#   which needs CUDA_DEVICE_MAX_CONNECTIONS > 1 where side_by_side.sh sets 1)
set -u -f  # -f: --moe-layer-freq patterns hold glob characters
R=$(pwd)/.mref; OUT=${OUT:-/tmp/round4}; mkdir -p "$OUT"
source "$R/configs.sh"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OVERLAPS="--overlap-grad-reduce --overlap-param-gather"
L8="--num-layers 8 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
L8="$L8 --no-create-attention-mask-in-dataloader"
OVERLAP_MOE="--overlap-moe-expert-parallel-comm --delay-wgrad-compute"

# row NAME -> "GPUS CONFIG flags..."
row() {
  case $1 in
    l8b_1gpu)        echo "1 LLAMA8B --num-layers 8 --global-batch-size 4" ;;
    l8b_dp4)         echo "4 LLAMA8B --global-batch-size 16 $OVERLAPS" ;;
    l8b_tp2dp2)      echo "4 LLAMA8B --tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap --global-batch-size 8 $OVERLAPS" ;;
    l8b_tp4)         echo "4 LLAMA8B --tensor-model-parallel-size 4 --sequence-parallel --tp-comm-overlap --global-batch-size 4" ;;
    l8b_pp2dp2)      echo "4 LLAMA8B --pipeline-model-parallel-size 2 --global-batch-size 32 $OVERLAPS" ;;
    l8b_pp4_vp)      echo "4 LLAMA8B --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2 --global-batch-size 32" ;;
    l8b_cp2dp2_16k)  echo "4 LLAMA8B --context-parallel-size 2 --seq-length 16384 --max-position-embeddings 16384 --global-batch-size 4 $OVERLAPS" ;;
    nemo_cp2dp2)     echo "4 LLAMA8B --context-parallel-size 2 --global-batch-size 32 --train-iters 14 $OVERLAPS" ;;
    cp1_64k)         echo "1 LLAMA8B $L8 --seq-length 65536 --max-position-embeddings 65536 --global-batch-size 1 --train-iters 14" ;;
    cp4_64k)         echo "4 LLAMA8B $L8 --seq-length 65536 --max-position-embeddings 65536 --global-batch-size 1 --train-iters 14 --context-parallel-size 4" ;;
    cp4_128k)        echo "4 LLAMA8B $L8 --seq-length 131072 --max-position-embeddings 131072 --global-batch-size 1 --train-iters 14 --context-parallel-size 4" ;;
    mix_1gpu)        echo "1 MOE_MIXTRAL" ;;
    fine_1gpu)       echo "1 MOE_FINE" ;;
    mix_ep4)         echo "4 MOE_MIXTRAL --expert-model-parallel-size 4 --global-batch-size 32" ;;
    fine_ep4)        echo "4 MOE_FINE --expert-model-parallel-size 4 --global-batch-size 32" ;;
    mix_ep2dp2)      echo "4 MOE_MIXTRAL --expert-model-parallel-size 2 --global-batch-size 32" ;;
    mix_ep2pp2)      echo "4 MOE_MIXTRAL --expert-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 32" ;;
    qwen3_ep4)       echo "4 QWEN3_30B_A3B" ;;
    dsv3_ep4)        echo "4 DEEPSEEK_V3_PROXY" ;;
    mix_ep4_overlap) echo "4 MOE_MIXTRAL --expert-model-parallel-size 4 --global-batch-size 32 $OVERLAP_MOE" ;;
    fine_ep4_overlap) echo "4 MOE_FINE --expert-model-parallel-size 4 --global-batch-size 32 $OVERLAP_MOE" ;;
    *) return 1 ;;
  esac
}
ALL="l8b_1gpu l8b_dp4 l8b_tp2dp2 l8b_tp4 l8b_pp2dp2 l8b_pp4_vp l8b_cp2dp2_16k nemo_cp2dp2 cp1_64k cp4_64k cp4_128k
mix_1gpu fine_1gpu mix_ep4 fine_ep4 mix_ep2dp2 mix_ep2pp2 qwen3_ep4 dsv3_ep4 mix_ep4_overlap fine_ep4_overlap"
if [ "${1:-}" = "--list" ]; then
  for r in $ALL; do printf '%-18s %s\n' "$r" "$(row "$r")"; done; exit 0
fi

T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee "$OUT/device.txt"
port=29700
run_row() {  # run_row NAME [CUDA_VISIBLE_DEVICES]
  local name=$1 devices=${2:-0,1,2,3} spec n cfg flags seq gbs
  spec=$(row "$name") || { echo "RESULT $name: unknown row (--list)"; return; }
  read -r n cfg flags <<< "$spec"
  port=$((port + 2))
  if [[ "$name" == *_overlap ]] || [ "${MREF:-1}" = 0 ]; then  # ours alone
    seq=$(echo ${!cfg} $flags | grep -oE -- '--seq-length [0-9]+' | tail -1 | awk '{print $2}')
    gbs=$(echo ${!cfg} $flags | grep -oE -- '--global-batch-size [0-9]+' | tail -1 | awk '{print $2}')
    CUDA_VISIBLE_DEVICES=$devices CUDA_DEVICE_MAX_CONNECTIONS=8 timeout "${MREF_TIMEOUT:-300}" torchrun \
      --nproc_per_node "$n" --master_port "$port" pretrain_gpt.py ${!cfg} $flags > "$OUT/ours_$name.log" 2>&1
    python3 "$R/res.py" "ours_$name" "$gbs" "$n" "$OUT/ours_$name.log" "$seq" 0
  else
    CUDA_VISIBLE_DEVICES=$devices PORT=$port OUT=$OUT bash "$R/side_by_side.sh" "$name" "$n" "$cfg" $flags
  fi
  echo "[t+$(( $(date +%s) - T0 ))s] $name done" >> "$OUT/steps.txt"
}
ones=(); fours=()
for r in ${ROWS:-$ALL}; do
  spec=$(row "$r") || { echo "RESULT $r: unknown row (--list)"; continue; }
  if [ "${spec%% *}" = 1 ]; then ones+=("$r"); else fours+=("$r"); fi
done
# One-GPU anchors two at a time on GPUs 0 and 1.
for ((i = 0; i < ${#ones[@]}; i += 2)); do
  run_row "${ones[$i]}" 0 &
  [ $((i + 1)) -lt ${#ones[@]} ] && run_row "${ones[$((i + 1))]}" 1 &
  wait
done
for r in "${fours[@]}"; do run_row "$r"; done
echo "round: ${#ones[@]} one-GPU and ${#fours[@]} four-GPU rows in $(( $(date +%s) - T0 )) s; logs in $OUT"
