"""--cuda-graph-impl full_iteration on a GPU: a real CUDA graph of forward + backward reproduces eager
training (same data, same seed). Skipped without CUDA."""
import pytest
import torch

from megatron.core.full_cuda_graph import FullCudaGraphWrapper
from tests.fixtures.tiny_gpt import single_rank
from tests.gpu.benchmark_runs import failure_text
from tests.unit.core.test_full_cuda_graph import train_losses

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype, attention_dropout", [(torch.float32, 0.0), (torch.bfloat16, 0.0),
                                                       (torch.bfloat16, 0.1)])
def test_cuda_graph_reproduces_eager_training(dtype, attention_dropout):
    """Eager with the ordinary RNG tracker against the graph with the graph-safe one: the same numbers."""
    reference = train_losses(8, device="cuda", dtype=dtype, attention_dropout=attention_dropout)
    wrappers = []

    def wrap(f):
        wrappers.append(FullCudaGraphWrapper(f, 3))
        return wrappers[0]
    graphed = train_losses(8, wrap=wrap, device="cuda", dtype=dtype, attention_dropout=attention_dropout,
                           graph_safe_rng=True)
    assert isinstance(wrappers[0].graph.graph, torch.cuda.CUDAGraph)
    # Same kernels on the same inputs; dropout draws from the graph-registered default generator.
    assert graphed == pytest.approx(reference, rel=1e-6, abs=1e-6), (graphed, reference)
    assert len(set(graphed)) == 8


def test_losses_to_host_on_cuda():
    from megatron.training.train_step import _check_losses_finite, _losses_to_host
    single_rank()
    dicts = [{"lm loss": torch.tensor([3.0, 16.0], device="cuda")},
             {"lm loss": torch.tensor([float("nan"), 8.0], device="cuda")}]
    host = _losses_to_host(dicts)()
    assert host[0]["lm loss"].tolist() == [3.0, 16.0] and not host[0]["lm loss"].is_cuda
    with pytest.raises(RuntimeError, match="lm loss of micro-batch 1"):
        _check_losses_finite(host)


def test_graph_safe_rng_tracker_draws_the_same_numbers():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    draws = []
    for graph_safe in (False, True):
        tracker = CudaRNGStatesTracker()
        tracker.set_graph_safe(graph_safe)
        tracker.add("model-parallel-rng", 1234)
        torch.cuda.manual_seed(7)
        out = []
        for _ in range(3):
            with tracker.fork():
                out.append(torch.rand(1000, device="cuda"))
            out.append(torch.rand(1000, device="cuda"))  # the default generator in between
        saved = tracker.get_states()
        draws.append((torch.cat(out), saved["model-parallel-rng"]))
    assert torch.equal(draws[0][0], draws[1][0])
    assert torch.equal(draws[0][1], draws[1][1])  # the checkpointed state is the same bytes


def test_full_iteration_graph_with_default_data_flags():
    """Megatron's defaults build the attention mask in the data loader; a graphed run must still capture."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
             "--micro-batch-size 2 --global-batch-size 2 --train-iters 6 --lr 1e-3 --mock-data --bf16 "
             "--tokenizer-type NullTokenizer --vocab-size 512 --log-interval 1 --eval-iters 0 "
             "--attention-dropout 0 --hidden-dropout 0 --cuda-graph-impl full_iteration --cuda-graph-warmup-steps 2")
    out = subprocess.run([sys.executable, os.path.join(root, "pretrain_gpt.py")] + flags.split(), cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, failure_text(out)
    assert "iteration        6/       6" in out.stdout


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_every_expert_local_graph_follows_eager(dispatcher):
    """MoE with every expert on the one GPU under --cuda-graph-impl full_iteration: router, permutation and one
    grouped GEMM per projection read nothing on the host, so the step captures; its losses follow the eager
    run's (bf16; the dropless router and the padded-capacity router both)."""
    import os
    import re
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    flags = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
             "--micro-batch-size 2 --global-batch-size 4 --train-iters 10 --lr 1e-4 --mock-data --bf16 "
             "--tokenizer-type NullTokenizer --vocab-size 1024 --log-interval 1 --eval-iters 0 --swiglu "
             "--attention-dropout 0 --hidden-dropout 0 --disable-bias-linear --num-experts 8 --moe-router-topk 2 "
             f"--moe-grouped-gemm --moe-token-dispatcher-type {dispatcher} --moe-aux-loss-coeff 1e-2 "
             "--cuda-graph-warmup-steps 2")
    runs = {}
    for name, extra in (("eager", ""), ("graph", " --cuda-graph-impl full_iteration"),
                        ("padded-graph", " --cuda-graph-impl full_iteration --moe-expert-capacity-factor 1.0 "
                                         "--moe-pad-expert-input-to-capacity"),
                        ("padded-eager", " --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity")):
        out = subprocess.run([sys.executable, os.path.join(root, "pretrain_gpt.py")] + (flags + extra).split(),
                             cwd=root, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, name + "\n" + failure_text(out)
        runs[name] = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+)", out.stdout)]
        assert len(runs[name]) == 10, (name, runs[name])
    print(runs)
    assert len(set(runs["graph"][2:])) > 5  # the replayed steps train on new data
    assert runs["graph"] == pytest.approx(runs["eager"], abs=2e-2)
    assert runs["padded-graph"] == pytest.approx(runs["padded-eager"], abs=2e-2)
