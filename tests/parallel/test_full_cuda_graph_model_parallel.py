"""--cuda-graph-impl full_iteration with tensor, pipeline, context and expert parallelism, through pretrain() on
2 gloo ranks (TP=2 with and without sequence parallelism, PP=2 plain and interleaved, CP=2 ring and all-to-all,
MoE at EP=2 padded to capacity). A CUDA graph cannot be captured on CPU,
so the wrapper gets a graph whose replay re-runs the captured function (tests/unit/core/test_full_cuda_graph.py's):
a rank with a data iterator that the step reads (TP rank 0; the first and the last pipeline stage, their first or
last model chunk) then reads every replayed step's micro-batches from the static buffers the wrapper refills, and
TP rank 1, which has none, receives them by the broadcast inside the captured step. The losses equal the eager
run's bitwise. tests/gpu/test_full_cuda_graph_model_parallel_gpu.py runs the same comparisons with real graphs
over NCCL."""
import pytest

from tests.fixtures.tiny_gpt import mock_data_cache, run_pretrain
from tests.parallel.dist_utils import run_distributed

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--vocab-size 128 --make-vocab-size-divisible-by 32 --tokenizer-type NullTokenizer --mock-data --lr 1e-2 "
         "--train-iters 6 --swiglu --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 0 "
         "--eval-interval 1000 --num-workers 0 --global-batch-size 4 --micro-batch-size 2 --seed 1234 "
         "--disable-bias-linear --cuda-graph-warmup-steps 2")
LAYOUTS = {"tp2": "--tensor-model-parallel-size 2",
           "tp2_sp": "--tensor-model-parallel-size 2 --sequence-parallel",
           "pp2": "--pipeline-model-parallel-size 2",
           # Interleaved: 4 layers, 2 model chunks per stage, one data iterator per chunk (only the first chunk's
           # is read on the first stage, only the last chunk's on the last).
           "pp2_vp2": "--pipeline-model-parallel-size 2 --num-layers 4 --num-layers-per-virtual-pipeline-stage 1",
           "cp2": "--context-parallel-size 2",
           "cp2_a2a": "--context-parallel-size 2 --cp-comm-type a2a",
           # MoE with the experts over 2 EP ranks, padded to capacity: fixed all-to-all splits, nothing read on
           # the host, the tokens-per-expert tensor made once on the device before the capture (bf16 and grouped
           # experts, as the graph requires of MoE).
           "ep2_padded": "--num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --moe-token-dispatcher-type "
                         "alltoall --expert-model-parallel-size 2 --moe-expert-capacity-factor 1.0 "
                         "--moe-pad-expert-input-to-capacity --moe-aux-loss-coeff 1e-2 --bf16"}


def _runs(layout):
    import megatron.training.train_step as train_step_module
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from tests.unit.core.test_full_cuda_graph import ReexecutingGraph

    captures = []

    class CountingGraph(ReexecutingGraph):
        def capture(self, fn):
            captures.append(1)
            return super().capture(fn)

    class CpuGraphWrapper(FullCudaGraphWrapper):
        def __init__(self, forward_backward_func, warmup_steps):
            super().__init__(forward_backward_func, warmup_steps, graph_factory=CountingGraph)

    flags = MODEL + " " + LAYOUTS[layout]
    out = {}
    for name, extra in (("eager", ""), ("graph", " --cuda-graph-impl full_iteration")):
        curve = []
        wrapper, set_graph_safe = train_step_module.FullCudaGraphWrapper, CudaRNGStatesTracker.set_graph_safe
        train_step_module.FullCudaGraphWrapper = CpuGraphWrapper
        # Graph-safe RNG states need a CUDA device; with no dropout they change nothing here.
        CudaRNGStatesTracker.set_graph_safe = lambda self, enabled: set_graph_safe(self, False)
        try:
            run_pretrain((flags + extra).split(),
                         lambda model, optimizer, result: curve.append(
                             (float(result[0]["lm loss"]) if result[0] else None, float(result[2]))))
        finally:
            train_step_module.FullCudaGraphWrapper, CudaRNGStatesTracker.set_graph_safe = wrapper, set_graph_safe
        out[name] = curve
    out["captures"] = len(captures)
    return out


@pytest.fixture(scope="module", autouse=True)
def _mock_data_cache(tmp_path_factory):
    yield from mock_data_cache(tmp_path_factory)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_graph_equals_eager(layout):
    ranks = run_distributed(_runs, 2, layout, timeout=600)
    for rank in ranks:
        assert rank["captures"] == 1  # one capture, then 3 replays after the 2 warm-up steps
        assert len(rank["graph"]) == 6 and rank["graph"] == rank["eager"]
    # The losses are reported by the last pipeline stage (both ranks without PP): the replayed steps trained.
    assert len({loss for loss, _ in ranks[-1]["graph"][2:]}) == 4
