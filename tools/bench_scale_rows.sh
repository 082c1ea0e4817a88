#!/bin/bash
# The scale issues' rows in one device call, each side by side (Megatron Core 0.19.2, then ours, same flags,
# `.mref/side_by_side.sh`), or ours alone with MREF=0. Rows run as many at a time as the machine's GPUs allow
# (one-GPU rows on GPUs 0..N-1, two-GPU rows on 0,1 and 2,3, own ports), four-GPU rows one after another. A
# RESULT line per system as each row ends; logs under $OUT. Needs ../shared/megatron_reference copied to .mref/
# with its wheel (see its README); run from the repository root on the GPU machine.
#
#   ROWS="l8_tp2 l8b_dp2 mix_ep2" bash tools/bench_scale_rows.sh        # a chosen few
#   MREF=0 ROWS="mix_ep2_overlap fine_ep2_overlap" bash tools/bench_scale_rows.sh   # ours only
#   TRAIN_ITERS=15 ROWS="l8b_dp4" bash tools/bench_scale_rows.sh   # fewer iterations (the median is of 11+)
#   (with EP, a LOAD line per row gives our log's median `moe max rank load`: the scaling model's moe_rank_load)
#   bash tools/bench_scale_rows.sh --list                                # the rows and their flags
#   EXTRA_OURS="--logging-level 20" MREF=0 ROWS=fine_1gpu bash tools/bench_scale_rows.sh   # flags for ours alone
#   PACK=1 ROWS=... bash tools/bench_scale_rows.sh   # the logs (and traces) packed into one $OUT/logs_<time>.tgz
#   SERIAL=1 ROWS="mix_ep2_overlap fine_ep2_overlap" bash tools/bench_scale_rows.sh   # one row at a time
#   DATA=corpus ROWS="mix_1gpu mix_ep4" bash tools/bench_scale_rows.sh   # the shipped corpus instead of mock data
#   A/B of two commits in one call, runs interleaved on the same GPUs (prepare here, carry `scratch`):
#     mkdir -p scratch/A && git archive REV | tar -x -C scratch/A     (scratch/ ignored by .git/info/exclude)
#     then on the GPU machine: for d in scratch/A . scratch/A .; do (cd $d && OUT=$OUT/$(basename $d)$RANDOM \
#       MREF_DIR=$R/.mref MREF=0 ROWS=l8b_tp2 bash tools/bench_scale_rows.sh); done   (R: the checkout's root)
#   PROFILE=1 MREF=0 ROWS="l8_tp2 nemo_cp2" bash tools/bench_scale_rows.sh   # ours, one profiled step each:
#       --profile --use-pytorch-profiler on step 8, every rank's Chrome trace under $OUT/tb_<row>/ and
#       tools/trace_report.py's summary (GPU busy/idle, longest gaps and their host ops, exposed
#       collectives) appended to the row's log
#
# Rows (LLAMA8B = the 32-layer Llama-3-8B shape; the 32-layer rows on 2 GPUs need H200s' memory):
#   one GPU: l8b_1gpu (8 layers) / g13_1gpu / mix_1gpu / fine_1gpu / cp1_64k / qwen3_1gpu (4 layers, no EP: the
#     shape's compute rate without expert parallelism)
#   two GPUs (issues 38 and 39): l8_tp2 (8 layers) / l8b_tp2 / l8b_dp2 / l8b_pp2 / l8b_pp2_bal / l8b_pp2_vp / l8b_cp2_16k
#     (out of memory on 2 H200s for both systems: CP does not shard the 8 B weights' 16 bytes of optimizer tensors
#     each, 128.5 GB of the 139.8 before any activation) / l16_cp2_16k (the same with 16 layers) /
#     l8_cp2_64k / nemo_cp2 / g13_pp2 / g13_dp2 / mix_ep2 / fine_ep2 / qwen3_ep2 / dsv3_ep2 /
#     l8b_pp2_vp_bal / g13_pp2_bal (the PP=2 rows with a --pipeline-model-parallel-layout that gives the
#     output layer's stage fewer layers: 17 | 15 + output for Llama-3's 128k vocabulary, ~2.1 layers' work; 13 | 11
#     + output for GPT13B's 50k vocabulary at hidden 2048, ~1.9 layers)
#   four GPUs (issues 44 and 45): l8b_dp4 / l8b_tp2dp2 / l8b_tp4 / l8b_pp2dp2 / l8b_pp4_vp / l8b_cp2dp2_16k /
#     nemo_cp2dp2 / cp4_64k / cp4_128k / mix_ep4 / fine_ep4 / mix_ep2dp2 / mix_ep2pp2 / qwen3_ep4 / dsv3_ep4 /
#     mix_ep4_pad (capacity factor 1.0, padded: no routing imbalance, no count exchange; tokens are dropped) /
#     l8b_pp2dp2_bal / l8b_pp4_vp_bal (the pipeline rows with --pipeline-model-parallel-layout giving the last
#     stage fewer layers for the 128k-vocabulary output layer: ~2 layers' work)
#   l8_tp2_graph / mix_1gpu_graph / fine_1gpu_graph (ours only: the row as one CUDA graph per step,
#   --cuda-graph-impl full_iteration; l8_tp2 without the TP overlap the graph refuses);
#   *_overlap (ours only: --overlap-moe-expert-parallel-comm --delay-wgrad-compute, which needs
#   CUDA_DEVICE_MAX_CONNECTIONS > 1 where side_by_side.sh sets 1): mix_ep2_overlap / fine_ep2_overlap /
#   qwen3_ep2_overlap / dsv3_ep2_overlap /
#   mix_ep4_overlap / fine_ep4_overlap / qwen3_ep4_overlap / dsv3_ep4_overlap / mix_ep2dp2_overlap;
#   *_fused: any row with Megatron's MoE recipe flags --moe-permute-fusion --moe-router-fusion (ours only; listed:
#   fine_1gpu_fused, mix_1gpu_fused, qwen3_1gpu_fused, the EP=2 and EP=4 overlap rows + _fused);
#   *_defer: any pipeline row with --defer-embedding-wgrad-compute (ours only: Megatron Core defers only with apex's
#   fused weight-gradient kernel, which the reference runs without; listed: l8b_pp2dp2_bal_defer, l8b_pp4_vp_bal_defer,
#   l8b_pp2_defer);
#   *_dp: the Qwen3 and DeepSeek rows with --use-distributed-optimizer --overlap-grad-reduce (both systems):
#   qwen3_ep4_dp / dsv3_ep4_dp / dsv3_ep2_dp, and with the MoE overlap too (ours): qwen3_ep4_dp_overlap /
#   dsv3_ep4_dp_overlap / dsv3_ep2_dp_overlap
set -u -f  # -f: --moe-layer-freq patterns hold glob characters
R=${MREF_DIR:-$(pwd)/.mref}; OUT=${OUT:-/tmp/scale_rows}
# DATA=corpus: both systems read the shipped corpus (data/corpus.jsonl.gz as BERT WordPiece ids, below every
# config's vocabulary) instead of --mock-data, whose random tokens skew the MoE rows' routing (`moe max rank load`
# 1.2-1.6 at EP=4). Prepared once under $CORPUS_DIR; the configs are rewritten in a copy of the reference folder
# there, which side_by_side.sh then reads. ~0.6 M tokens: the long rows read it for several epochs.
if [ "${DATA:-mock}" = corpus ]; then
  CD=${CORPUS_DIR:-/tmp/bench_corpus}; mkdir -p "$CD" || exit 1
  if [ ! -f "$CD/corpus_text_document.idx" ]; then
    { zcat data/corpus.jsonl.gz > "$CD/corpus.jsonl" && python3 tools/preprocess_data.py --input "$CD/corpus.jsonl" \
        --output-prefix "$CD/corpus" --tokenizer-type BertWordPieceLowerCase --vocab-file data/bert-vocab.txt \
        --append-eod --workers 2 > "$CD/preprocess.log" 2>&1; } \
      || { echo "DATA=corpus: preprocessing the corpus failed, see $CD/preprocess.log" >&2; exit 1; }
  fi
  rm -rf "$CD/mref" && cp -r "$R" "$CD/mref" || exit 1
  sed -i "s|--mock-data|--data-path $CD/corpus_text_document|" "$CD/mref/configs.sh"
  R=$CD/mref
elif [ "${DATA:-mock}" != mock ]; then
  echo "DATA=${DATA}: use mock (the default) or corpus" >&2; exit 1
fi
source "$R/configs.sh"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OVERLAPS="--overlap-grad-reduce --overlap-param-gather"
L8="--num-layers 8 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
L8="$L8 --no-create-attention-mask-in-dataloader"
OVERLAP_MOE="--overlap-moe-expert-parallel-comm --delay-wgrad-compute"
# The EP rows' dense weights (attention, dense layers, embeddings: ~3.6 B on the DeepSeek proxy) are reduced over
# the whole DP group after the last backward, exposed without these (60-66 ms of the proxy's EP=4 step, profiled).
DIST_REDUCE="--use-distributed-optimizer --overlap-grad-reduce"
# Megatron's MoE recipe flags for the permutation and the router (Triton kernels here; Transformer Engine's there,
# so Megatron Core's side cannot run them without it): the *_fused rows, ours alone.
FUSED_MOE="--moe-permute-fusion --moe-router-fusion"

# row NAME -> "GPUS CONFIG flags..."
row() {
  case $1 in
    l8b_1gpu)        echo "1 LLAMA8B --num-layers 8 --global-batch-size 4" ;;
    g13_1gpu)        echo "1 GPT13B" ;;
    l8_tp2)          echo "2 LLAMA8B --num-layers 8 --tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap" ;;
    l8_tp2_graph)    echo "2 LLAMA8B --num-layers 8 --tensor-model-parallel-size 2 --sequence-parallel --cuda-graph-impl full_iteration" ;;
    l8b_tp2)         echo "2 LLAMA8B --tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap" ;;
    l8b_dp2)         echo "2 LLAMA8B --global-batch-size 8 $OVERLAPS" ;;
    l8b_pp2)         echo "2 LLAMA8B --pipeline-model-parallel-size 2 --global-batch-size 16" ;;
    l8b_pp2_bal)     echo "2 LLAMA8B --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*17|t*15L --global-batch-size 16" ;;
    l8b_pp2_vp)      echo "2 LLAMA8B --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 4 --global-batch-size 16" ;;
    l8b_pp2_vp_bal)  echo "2 LLAMA8B --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*4|t*4|t*4|t*4|t*5|t*4|t*4|t*3L --global-batch-size 16" ;;
    l8b_cp2_16k)     echo "2 LLAMA8B --context-parallel-size 2 --seq-length 16384 --max-position-embeddings 16384 --global-batch-size 2" ;;
    l16_cp2_16k)     echo "2 LLAMA8B --num-layers 16 --context-parallel-size 2 --seq-length 16384 --max-position-embeddings 16384 --global-batch-size 2" ;;
    l8_cp2_64k)      echo "2 LLAMA8B $L8 --seq-length 65536 --max-position-embeddings 65536 --global-batch-size 1 --train-iters 14 --context-parallel-size 2" ;;
    nemo_cp2)        echo "2 LLAMA8B --context-parallel-size 2 --global-batch-size 32 --train-iters 14" ;;
    nemo_cp2_a2a)    echo "2 LLAMA8B --context-parallel-size 2 --cp-comm-type a2a --global-batch-size 32 --train-iters 14" ;;
    nemo_cp2_ag)     echo "2 LLAMA8B --context-parallel-size 2 --cp-comm-type allgather --global-batch-size 32 --train-iters 14" ;;
    g13_pp2)         echo "2 GPT13B --pipeline-model-parallel-size 2 --global-batch-size 32" ;;
    g13_pp2_bal)     echo "2 GPT13B --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*13|t*11L --global-batch-size 32" ;;
    g13_dp2)         echo "2 GPT13B --global-batch-size 8 --use-distributed-optimizer $OVERLAPS" ;;
    mix_ep2)         echo "2 MOE_MIXTRAL --expert-model-parallel-size 2 --global-batch-size 16" ;;
    fine_ep2)        echo "2 MOE_FINE --expert-model-parallel-size 2 --global-batch-size 16" ;;
    qwen3_ep2)       echo "2 QWEN3_30B_A3B --num-layers 8 --expert-model-parallel-size 2 --global-batch-size 8" ;;
    dsv3_ep2)        echo "2 DEEPSEEK_V3_PROXY --num-layers 3 --moe-layer-freq ([0]*1+[1]*2) --expert-model-parallel-size 2 --global-batch-size 8" ;;
    mix_ep2_overlap) echo "2 MOE_MIXTRAL --expert-model-parallel-size 2 --global-batch-size 16 $OVERLAP_MOE" ;;
    fine_ep2_overlap) echo "2 MOE_FINE --expert-model-parallel-size 2 --global-batch-size 16 $OVERLAP_MOE" ;;
    qwen3_ep2_overlap) echo "2 QWEN3_30B_A3B --num-layers 8 --expert-model-parallel-size 2 --global-batch-size 8 $OVERLAP_MOE" ;;
    dsv3_ep2_overlap) echo "2 DEEPSEEK_V3_PROXY --num-layers 3 --moe-layer-freq ([0]*1+[1]*2) --expert-model-parallel-size 2 --global-batch-size 8 $OVERLAP_MOE" ;;
    l8b_dp4)         echo "4 LLAMA8B --global-batch-size 16 $OVERLAPS" ;;
    l8b_tp2dp2)      echo "4 LLAMA8B --tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap --global-batch-size 8 $OVERLAPS" ;;
    l8b_tp4)         echo "4 LLAMA8B --tensor-model-parallel-size 4 --sequence-parallel --tp-comm-overlap --global-batch-size 4" ;;
    l8b_pp2dp2)      echo "4 LLAMA8B --pipeline-model-parallel-size 2 --global-batch-size 32 $OVERLAPS" ;;
    l8b_pp4_vp)      echo "4 LLAMA8B --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2 --global-batch-size 32" ;;
    l8b_pp2dp2_bal)  echo "4 LLAMA8B --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*17|t*15L --global-batch-size 32 $OVERLAPS" ;;
    l8b_pp4_vp_bal)  echo "4 LLAMA8B --pipeline-model-parallel-size 4 --pipeline-model-parallel-layout Et*5|t*4|t*4|t*3|t*4|t*5|t*5|t*2L --global-batch-size 32" ;;
    # Megatron Core's side of l8b_cp2dp2_16k runs out of memory on 139.8 GB H200s (also with expandable segments,
    # where NCCL's own allocation then fails): its row reports the failure, ours runs.
    l8b_cp2dp2_16k)  echo "4 LLAMA8B --context-parallel-size 2 --seq-length 16384 --max-position-embeddings 16384 --global-batch-size 4 $OVERLAPS" ;;
    nemo_cp2dp2)     echo "4 LLAMA8B --context-parallel-size 2 --global-batch-size 32 --train-iters 14 $OVERLAPS" ;;
    cp1_64k)         echo "1 LLAMA8B $L8 --seq-length 65536 --max-position-embeddings 65536 --global-batch-size 1 --train-iters 14" ;;
    cp4_64k)         echo "4 LLAMA8B $L8 --seq-length 65536 --max-position-embeddings 65536 --global-batch-size 1 --train-iters 14 --context-parallel-size 4" ;;
    cp4_128k)        echo "4 LLAMA8B $L8 --seq-length 131072 --max-position-embeddings 131072 --global-batch-size 1 --train-iters 14 --context-parallel-size 4" ;;
    mix_1gpu)        echo "1 MOE_MIXTRAL" ;;
    qwen3_1gpu)      echo "1 QWEN3_30B_A3B --num-layers 4 --expert-model-parallel-size 1 --global-batch-size 4" ;;
    fine_1gpu)       echo "1 MOE_FINE" ;;
    mix_1gpu_graph)  echo "1 MOE_MIXTRAL --cuda-graph-impl full_iteration" ;;
    fine_1gpu_graph) echo "1 MOE_FINE --cuda-graph-impl full_iteration" ;;
    mix_ep4)         echo "4 MOE_MIXTRAL --expert-model-parallel-size 4 --global-batch-size 32" ;;
    fine_ep4)        echo "4 MOE_FINE --expert-model-parallel-size 4 --global-batch-size 32" ;;
    mix_ep2dp2)      echo "4 MOE_MIXTRAL --expert-model-parallel-size 2 --global-batch-size 32" ;;
    mix_ep2pp2)      echo "4 MOE_MIXTRAL --expert-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 32" ;;
    mix_ep2dp2_overlap) echo "4 MOE_MIXTRAL --expert-model-parallel-size 2 --global-batch-size 32 $OVERLAP_MOE" ;;
    qwen3_ep4)       echo "4 QWEN3_30B_A3B" ;;
    dsv3_ep4)        echo "4 DEEPSEEK_V3_PROXY" ;;
    mix_ep4_pad)     echo "4 MOE_MIXTRAL --expert-model-parallel-size 4 --global-batch-size 32 --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity" ;;
    mix_ep4_overlap) echo "4 MOE_MIXTRAL --expert-model-parallel-size 4 --global-batch-size 32 $OVERLAP_MOE" ;;
    fine_ep4_overlap) echo "4 MOE_FINE --expert-model-parallel-size 4 --global-batch-size 32 $OVERLAP_MOE" ;;
    qwen3_ep4_overlap) echo "4 QWEN3_30B_A3B $OVERLAP_MOE" ;;
    dsv3_ep4_overlap) echo "4 DEEPSEEK_V3_PROXY $OVERLAP_MOE" ;;
    qwen3_ep4_dp)    echo "4 QWEN3_30B_A3B $DIST_REDUCE" ;;
    dsv3_ep4_dp)     echo "4 DEEPSEEK_V3_PROXY $DIST_REDUCE" ;;
    dsv3_ep2_dp)     echo "2 DEEPSEEK_V3_PROXY --num-layers 3 --moe-layer-freq ([0]*1+[1]*2) --expert-model-parallel-size 2 --global-batch-size 8 $DIST_REDUCE" ;;
    qwen3_ep4_dp_overlap) echo "4 QWEN3_30B_A3B $DIST_REDUCE $OVERLAP_MOE" ;;
    dsv3_ep4_dp_overlap) echo "4 DEEPSEEK_V3_PROXY $DIST_REDUCE $OVERLAP_MOE" ;;
    dsv3_ep2_dp_overlap) echo "2 DEEPSEEK_V3_PROXY --num-layers 3 --moe-layer-freq ([0]*1+[1]*2) --expert-model-parallel-size 2 --global-batch-size 8 $DIST_REDUCE $OVERLAP_MOE" ;;
    *_fused)         local base; base=$(row "${1%_fused}") || return 1; echo "$base $FUSED_MOE" ;;
    *_defer)         local base; base=$(row "${1%_defer}") || return 1; echo "$base --defer-embedding-wgrad-compute" ;;
    *) return 1 ;;
  esac
}
ALL="l8b_1gpu g13_1gpu l8_tp2 l8_tp2_graph l8b_tp2 l8b_dp2 l8b_pp2 l8b_pp2_vp l8b_pp2_vp_bal l8b_cp2_16k l16_cp2_16k l8_cp2_64k nemo_cp2 nemo_cp2_a2a nemo_cp2_ag g13_pp2 g13_pp2_bal g13_dp2
mix_ep2 fine_ep2 qwen3_ep2 dsv3_ep2 mix_ep2_overlap fine_ep2_overlap qwen3_ep2_overlap dsv3_ep2_overlap l8b_dp4 l8b_tp2dp2 l8b_tp4 l8b_pp2dp2 l8b_pp4_vp l8b_pp2_bal l8b_pp2dp2_bal l8b_pp4_vp_bal l8b_cp2dp2_16k nemo_cp2dp2 cp1_64k cp4_64k cp4_128k
mix_1gpu fine_1gpu qwen3_1gpu mix_1gpu_graph fine_1gpu_graph mix_ep4 fine_ep4 mix_ep2dp2 mix_ep2pp2 qwen3_ep4 dsv3_ep4 mix_ep4_pad mix_ep4_overlap fine_ep4_overlap
qwen3_ep4_overlap dsv3_ep4_overlap mix_ep2dp2_overlap qwen3_ep4_dp dsv3_ep4_dp dsv3_ep2_dp qwen3_ep4_dp_overlap
dsv3_ep4_dp_overlap dsv3_ep2_dp_overlap
fine_1gpu_fused mix_1gpu_fused qwen3_1gpu_fused mix_ep2_overlap_fused fine_ep2_overlap_fused qwen3_ep2_overlap_fused
dsv3_ep2_dp_overlap_fused mix_ep4_overlap_fused fine_ep4_overlap_fused qwen3_ep4_dp_overlap_fused dsv3_ep4_dp_overlap_fused
l8b_pp2_defer l8b_pp2dp2_bal_defer l8b_pp4_vp_bal_defer"
if [ "${1:-}" = "--list" ]; then
  for r in $ALL; do printf '%-18s %s\n' "$r" "$(row "$r")"; done; exit 0
fi
if [ "${1:-}" = "--flags" ]; then  # --flags ROW: its GPU count, then every flag ours receives (configs expanded)
  spec=$(row "${2:-}") || { echo "unknown row '${2:-}' (--list)" >&2; exit 1; }
  read -r n cfg flags <<< "$spec"; echo $n ${!cfg} $flags; exit 0
fi
mkdir -p "$OUT"

# Megatron Core asserts a vp_stage for every model chunk under interleaving, and a --pipeline-model-parallel-layout
# places each chunk's layers by it; the reference driver builds GPTModel without one, so Megatron's interleaved
# rows failed at start-up. Pass it as Megatron's own pretrain_gpt.py does (once, in this ignored copy).
if [ "${MREF:-1}" != 0 ] && [ -f "$R/mcore_driver.py" ] && ! grep -q "vp_stage=vp_stage" "$R/mcore_driver.py"; then
  python3 - "$R/mcore_driver.py" <<'PY' || exit 1
import sys
path = sys.argv[1]
text = open(path).read()
call = "        rotary_base=args.rotary_base,\n    )"
if call not in text:
    sys.exit(f"{path}: its GPTModel(...) call is not the one expected; add vp_stage=vp_stage to it by hand")
open(path, "w").write(text.replace(call, "        rotary_base=args.rotary_base,\n        vp_stage=vp_stage,\n    )", 1))
print(f"{path}: GPTModel gets vp_stage (interleaved and layout rows)")
PY
fi

# side_by_side.sh installs the wheel under `set -f`, where its glob does not expand: install it here.
[ "${MREF:-1}" = 0 ] || [ -d /tmp/mref_site/megatron ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/mref_site $(set +f; echo "$R"/whl/megatron_core-*.whl) || exit 1
T0=$(date +%s)
# Stopped from outside (`timeout` on this script, Ctrl-C), take the rows' processes down too: a torchrun left
# running holds its GPUs' memory and slows or kills whatever the warm machine runs next. `timeout` signals its
# whole process group, so the rows' shells die at once and orphan their torchruns: those are found by the tag
# every process of this round inherits. Bash runs the trap only between commands, so rows run in the background
# and the script waits for them.
export BENCH_SCALE_ROUND="bench_scale_rows_$$_$T0"
kill_round() {
  local e p
  for e in /proc/[0-9]*/environ; do
    p=${e#/proc/}; p=${p%/environ}
    [ "$p" != $$ ] && grep -qxz "BENCH_SCALE_ROUND=$BENCH_SCALE_ROUND" "$e" 2>/dev/null && kill -TERM "$p" 2>/dev/null
  done
}
trap 'trap - TERM INT; kill_round; exit 143' TERM INT
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee "$OUT/device.txt"
port=${PORT:-29700}
free_ports() {  # free_ports N: the first P >= N with P and P + 1 both free to listen on (a port still held by a
  # process of an earlier call on a warm machine made a row fail at its rendezvous)
  python3 - "$1" <<'PY'
import socket, sys
p = int(sys.argv[1])
while True:
    try:
        for q in (p, p + 1):
            with socket.socket() as s:
                s.bind(("", q))
        break
    except OSError:
        p += 2
print(p)
PY
}
rank_load() {  # rank_load NAME LOG: with EP, the median `moe max rank load` of iterations 11+ (the scaling
  # model's moe_rank_load for this row), one LOAD line; nothing for rows without it
  python3 - "$1" "$2" <<'PY'
import re, statistics, sys
name, path = sys.argv[1], sys.argv[2]
try:
    text = open(path, errors="replace").read()
except OSError:
    sys.exit()
loads = [float(m.group(2)) for m in re.finditer(r"iteration\s+(\d+)/.*?moe max rank load: ([\d.E+-]+)", text)
         if int(m.group(1)) > 10]
if loads:
    print(f"LOAD ours_{name}: moe max rank load median {statistics.median(loads):.3f} over {len(loads)} iterations")
PY
}
run_row() {  # run_row NAME CUDA_VISIBLE_DEVICES PORT (rendezvous ports PORT and PORT + 1)
  local name=$1 devices=$2 port=$3 spec n cfg flags seq gbs
  spec=$(row "$name") || { echo "RESULT $name: unknown row (--list)"; return; }
  read -r n cfg flags <<< "$spec"
  # Megatron Core's DP=2 row at 32 layers fills the H200's 139.8 GB in its second iteration (137.7 GB in use,
  # 4.5 GB of it fragments); its users' remedy, expandable segments, for both systems (rows run in subshells).
  case $name in l8b_dp2) export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} ;; esac
  [ -n "${TRAIN_ITERS:-}" ] && flags="$flags --train-iters $TRAIN_ITERS"  # both systems; the last flag wins
  if [[ "$name" == *_overlap || "$name" == *_graph || "$name" == *_fused ]] || [ "${MREF:-1}" = 0 ] || [ "${PROFILE:-0}" = 1 ]; then  # ours alone
    seq=$(echo ${!cfg} $flags | grep -oE -- '--seq-length [0-9]+' | tail -1 | awk '{print $2}')
    gbs=$(echo ${!cfg} $flags | grep -oE -- '--global-batch-size [0-9]+' | tail -1 | awk '{print $2}')
    local prof=""
    if [ "${PROFILE:-0}" = 1 ]; then
      rm -rf "$OUT/tb_$name"
      prof="--profile --use-pytorch-profiler --profile-step-start 8 --profile-step-end 9 --profile-ranks $(seq -s ' ' 0 $((n - 1))) --tensorboard-dir $OUT/tb_$name"
    fi
    CUDA_VISIBLE_DEVICES=$devices CUDA_DEVICE_MAX_CONNECTIONS=8 timeout "${MREF_TIMEOUT:-300}" torchrun \
      --nproc_per_node "$n" --master_port "$port" pretrain_gpt.py ${!cfg} $flags $prof ${EXTRA_OURS:-} > "$OUT/ours_$name.log" 2>&1
    python3 "$R/res.py" "ours_$name" "$gbs" "$n" "$OUT/ours_$name.log" "$seq" 0
    if [ -n "$prof" ]; then
      python3 tools/trace_report.py $(set +f; ls "$OUT/tb_$name"/*.pt.trace.json 2>/dev/null) --top 8 --kernels 25 \
        >> "$OUT/ours_$name.log" 2>&1 || echo "trace_report: no trace for $name" >> "$OUT/ours_$name.log"
    fi
  else
    CUDA_VISIBLE_DEVICES=$devices PORT=$port OUT=$OUT bash "$R/side_by_side.sh" "$name" "$n" "$cfg" $flags
  fi
  rank_load "$name" "$OUT/ours_$name.log"
  echo "[t+$(( $(date +%s) - T0 ))s] $name done" >> "$OUT/steps.txt"
}
# GPUS=2,3 confines a round to those GPUs, so two rounds (own PORT, own OUT) can run at once on disjoint GPUs.
IFS=, read -r -a devs <<< "${GPUS:-$(seq -s, 0 $(( $(nvidia-smi -L | wc -l) - 1 )))}"
ngpu=${#devs[@]}
four_devs=$(IFS=,; echo "${devs[*]:0:4}")
ones=(); twos=(); fours=()
for r in ${ROWS:-$ALL}; do
  spec=$(row "$r") || { echo "RESULT $r: unknown row (--list)"; continue; }
  case "${spec%% *}" in 1) ones+=("$r") ;; 2) twos+=("$r") ;; *) fours+=("$r") ;; esac
done
# Rows of one and two GPUs as many at a time as the GPUs allow, each on its own GPUs. SERIAL=1: one row at a time
# (a host-bound row, the overlapped EP rows, lost 4% beside another row on the same host: rows quoted against a
# bar run alone).
width=$ngpu; [ "${SERIAL:-0}" = 1 ] && width=1
for ((i = 0; i < ${#ones[@]}; i += width)); do
  for ((g = 0; g < width && i + g < ${#ones[@]}; g++)); do port=$(free_ports $((port + 2))); run_row "${ones[$((i + g))]}" "${devs[$g]}" $port & done
  wait
done
pairs=$((ngpu / 2)); [ "${SERIAL:-0}" = 1 ] && [ "$pairs" -gt 1 ] && pairs=1
if [ ${#twos[@]} -gt 0 ] && [ "$pairs" -lt 1 ]; then
  echo "RESULT ${twos[*]}: need 2 GPUs, this machine has $ngpu"; twos=()
fi
for ((i = 0; i < ${#twos[@]}; i += pairs)); do
  for ((g = 0; g < pairs && i + g < ${#twos[@]}; g++)); do port=$(free_ports $((port + 2)))
    run_row "${twos[$((i + g))]}" "${devs[$((2 * g))]},${devs[$((2 * g + 1))]}" $port &
  done
  wait
done
if [ ${#fours[@]} -gt 0 ] && [ "$ngpu" -lt 4 ]; then
  echo "RESULT ${fours[*]}: need 4 GPUs, this machine has $ngpu"; fours=()
fi
for r in "${fours[@]}"; do port=$(free_ports $((port + 2))); run_row "$r" "$four_devs" $port & wait $!; done
echo "round: ${#ones[@]} one-GPU, ${#twos[@]} two-GPU and ${#fours[@]} four-GPU rows in $(( $(date +%s) - T0 )) s; logs in $OUT"
# PACK=1: the round's logs and traces as one archive, $OUT/logs_<round>.tgz (a remote runner that returns few files)
if [ "${PACK:-0}" = 1 ]; then
  (cd "$OUT" && set +f && tar czf "logs_$T0.tgz" --remove-files $(ls -d *.log tb_* 2>/dev/null)) && echo "packed: $OUT/logs_$T0.tgz"
fi
