"""--cuda-graph-impl full_iteration with model parallelism on two GPUs over NCCL. TP=2 + SP: TP rank 0's batch
broadcast, the sequence-parallel all-gathers / reduce-scatters and the vocab-parallel loss captured in one graph
per step; PP=2: the pipeline's sends and receives, 1F1B and interleaved (overlapped p2p); CP=2: the K/V ring; MoE
at EP=2 padded to capacity: the all-to-all with fixed splits. The losses follow the eager run's of the same
layout, and each run's ms/iteration is printed (the graph's gain).
tests/parallel/test_full_cuda_graph_model_parallel.py proves the data flow bitwise on CPU. Needs two CUDA
devices."""
import pytest
import torch

from tests.gpu.benchmark_runs import run_two_gpus

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

LAYOUTS = {"tp2_sp": "--tensor-model-parallel-size 2 --sequence-parallel --global-batch-size 8",
           "pp2": "--pipeline-model-parallel-size 2 --global-batch-size 16",
           "pp2_vp2": "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3 "
                      "--global-batch-size 16",
           "cp2": "--context-parallel-size 2 --global-batch-size 8",
           "ep2_padded": "--num-experts 8 --moe-router-topk 2 --moe-grouped-gemm --moe-token-dispatcher-type "
                         "alltoall --expert-model-parallel-size 2 --moe-expert-capacity-factor 4.0 "
                         "--moe-pad-expert-input-to-capacity --disable-bias-linear --global-batch-size 16"}


# The MoE layout pads every expert's input to its capacity (fixed all-to-all splits, what the graph needs) at
# capacity factor 4.0 = experts / top-k: an expert's capacity is every token, so none is dropped (at 1.0 the dropped
# tokens made the curve chaotic: a graph run once ended 0.154 from its eager run at step 11). Without drops the
# routing still flips where bf16 noise moves a token's top-2 scores past each other: on two H200s two eager runs
# differed by up to 0.045 over 14 steps and the graph run lay within 0.044 of either, so MoE gets twice the band
# two eager runs span. Token dropping itself is proven bitwise on CPU
# (tests/parallel/test_full_cuda_graph_model_parallel.py).
TOL = {"ep2_padded": 0.09}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_graph_follows_eager(tmp_path, layout):
    # lr 1e-4 (the benchmark's is 3e-4): at 3e-4 gpt-125m's loss spikes near step 9 and the step after it
    # amplifies bf16 noise tenfold (see the DP graph test), which failed tp2_sp once in two runs.
    lr = "1e-4"
    eager = run_two_gpus(tmp_path, f"{layout}-eager", LAYOUTS[layout], "--lr", lr, iters=10)
    graph = run_two_gpus(tmp_path, f"{layout}-graph", LAYOUTS[layout], "--lr", lr, "--cuda-graph-impl",
                         "full_iteration", iters=10)
    assert len(set(graph["losses"])) > 5  # the replayed steps train on new data
    # bf16 with the same kernels; cuDNN attention and the embedding backward are not bitwise deterministic, so
    # the curves agree within the spread the DP graph test allows.
    assert graph["losses"] == pytest.approx(eager["losses"], abs=TOL.get(layout, 2e-2))
