"""--cuda-graph-impl full_iteration on a GPU: a real CUDA graph of forward + backward reproduces eager
training (same data, same seed). Skipped without CUDA."""
import pytest
import torch

from megatron.core.full_cuda_graph import FullCudaGraphWrapper
from tests.unit.test_full_cuda_graph import train_losses

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_reproduces_eager_training(dtype):
    reference = train_losses(8, device="cuda", dtype=dtype)
    wrappers = []

    def wrap(f):
        wrappers.append(FullCudaGraphWrapper(f, 3))
        return wrappers[0]
    graphed = train_losses(8, wrap=wrap, device="cuda", dtype=dtype)
    assert isinstance(wrappers[0].graph.graph, torch.cuda.CUDAGraph)
    # Same kernels on the same inputs; dropout draws from the graph-registered default generator.
    assert graphed == pytest.approx(reference, rel=1e-6, abs=1e-6), (graphed, reference)
    assert len(set(graphed)) == 8


def test_losses_to_host_on_cuda():
    from megatron.training.train_step import _check_losses_finite, _losses_to_host
    from tests.unit.test_full_cuda_graph import _single_rank
    _single_rank()
    dicts = [{"lm loss": torch.tensor([3.0, 16.0], device="cuda")},
             {"lm loss": torch.tensor([float("nan"), 8.0], device="cuda")}]
    host = _losses_to_host(dicts)()
    assert host[0]["lm loss"].tolist() == [3.0, 16.0] and not host[0]["lm loss"].is_cuda
    with pytest.raises(RuntimeError, match="lm loss of micro-batch 1"):
        _check_losses_finite(host)


def test_fused_adam_step_graphs_match_eager():
    """The optimizer step replayed from CUDA graphs (lr changing every step, clip on and off, a state
    reload in the middle) gives the same params as the eager fused AdamW."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.unit.test_full_cuda_graph import _single_rank
    _single_rank()
    runs = []
    for graphs in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).cuda().bfloat16()
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, bf16=True), [model])
        if graphs:
            assert opt.enable_step_graphs()
        gen = torch.Generator(device="cuda").manual_seed(1)
        for step in range(8):
            for group in opt.param_groups:
                group["lr"] = 1e-2 / (step + 1)  # what the scheduler does between steps
            scale = 10.0 if step % 2 else 1e-3  # clip active on odd steps
            for p in model.parameters():
                p.grad = torch.randn(p.shape, device="cuda", generator=gen).bfloat16() * scale
            assert opt.step()[0]
            if step == 4:
                opt.load_state_dict(opt.state_dict())  # replaces the state tensors: graphs recaptured
        if graphs:
            assert set(opt._step_graphs.graphs) == {True, False}
        runs.append([p.detach().float().clone() for p in opt.get_parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
