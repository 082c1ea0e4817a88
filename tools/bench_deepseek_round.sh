#!/bin/bash
# One 2-GPU call: the DeepSeek-V3-shaped model of examples/deepseek_v3/train_deepseek_v3_2gpu.sh at EP=2,
# Megatron Core 0.19.2 (its local spec with MLA and MTP, SDPA as core attention: tools/bench_mcore_driver.py)
# then ours, the same flags (permute fusion off for both: Megatron's needs Transformer Engine). Logs under $OUT.
# Needs ../shared/megatron_reference copied to .mref/ with the megatron-core wheel (its README); run from the
# repository root on a 2-GPU machine: bash tools/bench_deepseek_round.sh
set -u
R=$(pwd)/.mref; OUT=${OUT:-/tmp/r2}; mkdir -p $OUT
source $R/configs.sh
[ -d /tmp/mref_site/megatron ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mref_site $R/whl/megatron_core-*.whl
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=4
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a $OUT/steps.txt; }
DS=$(sed -n '/^MODEL_ARGS=(/,/^torchrun/p' examples/deepseek_v3/train_deepseek_v3_2gpu.sh | grep -v "^torchrun" | sed 's/^[A-Z_]*=(//; s/^)$//; s/)$//' | tr -d '"\\' | tr '\n' ' ')
DS=${DS/--moe-permute-fusion/}  # Megatron's permute fusion needs Transformer Engine: off for both
echo "$DS" > $OUT/ds_flags.txt
DSX="--train-iters 20 --log-throughput --no-rope-fusion"
BENCH_SDPA=1 PYTHONPATH=/tmp/mref_site timeout 170 torchrun --nproc_per_node 2 --master_port 29704 tools/bench_mcore_driver.py $DS $DSX $MCORE_ONLY > $OUT/mcore_ds.log 2>&1; el mcore_ds
python3 $R/res.py megatron_ds 16 2 $OUT/mcore_ds.log 4096 0
timeout 150 torchrun --nproc_per_node 2 --master_port 29706 pretrain_gpt.py $DS $DSX > $OUT/ours_ds.log 2>&1; el ours_ds
python3 $R/res.py ours_ds 16 2 $OUT/ours_ds.log 4096 0
grep -h "mtp\|MFU\|throughput" $OUT/ours_ds.log | tail -2 | cut -c1-400
