#!/bin/bash
# Loss-curve agreement and cross-layout resume on one node of 4 GPUs, gpt-125m shape, bf16, mock data.
#  1. 200 iterations on 1 GPU and at TP=2 x PP=2 (+SP, distributed optimizer, overlapped grad reduce and
#     param gather): the curves agree within bf16 noise.
#  2. The TP=2 x PP=2 run saves at iteration 100; a TP=4 run resumes from it and continues on the curve.
# About 6 minutes on 4 H200s.   OUT=/tmp/consistency bash examples/parallel_consistency_4gpu.sh
set -u
OUT=${OUT:-/tmp/consistency}; mkdir -p "$OUT"; CKPT=${CKPT:-/tmp/consistency-ckpt}; rm -rf "$CKPT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
MODEL="--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024
  --micro-batch-size 4 --global-batch-size 32 --train-iters 200 --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine
  --lr-warmup-iters 20 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --mock-data
  --tokenizer-type NullTokenizer --vocab-size 50303 --attention-dropout 0 --hidden-dropout 0
  --log-interval 1 --eval-iters 0 --seed 1234"
PAR="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
torchrun --nproc-per-node 1 pretrain_gpt.py $MODEL > "$OUT/1gpu.log" 2>&1; echo "1gpu exit $?"
torchrun --nproc-per-node 4 pretrain_gpt.py $MODEL $PAR --save "$CKPT" --save-interval 100 \
  > "$OUT/tp2pp2.log" 2>&1; echo "tp2pp2 exit $?"
# Resume the iteration-100 checkpoint at TP=4 (the final iteration-200 save is removed first).
rm -rf "$CKPT/iter_0000200"; echo 100 > "$CKPT/latest_checkpointed_iteration.txt"
torchrun --nproc-per-node 4 pretrain_gpt.py $MODEL --tensor-model-parallel-size 4 --sequence-parallel \
  --use-distributed-optimizer --load "$CKPT" > "$OUT/tp4-resumed.log" 2>&1; echo "tp4 resume exit $?"
grep -E "successfully loaded|Error" "$OUT/tp4-resumed.log" | head -3
python tools/compare_loss_curves.py "$OUT/1gpu.log" "$OUT/tp2pp2.log"
python tools/compare_loss_curves.py "$OUT/tp2pp2.log" "$OUT/tp4-resumed.log" --from-iter 101
