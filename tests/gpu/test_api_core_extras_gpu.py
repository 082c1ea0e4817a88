"""The CUDA paths of Megatron Core names that CPU tests cannot reach: graph-safe RNG state conversion,
recompute-without-output under the CUDA generator, the cross-entropy steps on bf16 logits, and the
integrity-checked async save from device tensors. Skipped without CUDA."""
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def test_convert_cuda_rng_state_round_trip():
    from megatron.core.tensor_parallel import convert_cuda_rng_state, is_graph_safe_cuda_rng_tracker
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    state = torch.cuda.get_rng_state()
    generator = convert_cuda_rng_state(state, to_graphable=True)
    assert isinstance(generator, torch.Generator)
    assert torch.equal(convert_cuda_rng_state(generator), state)
    assert is_graph_safe_cuda_rng_tracker(CudaRNGStatesTracker(use_cudagraphable_rng=True))
    assert not is_graph_safe_cuda_rng_tracker(CudaRNGStatesTracker())


def test_checkpoint_without_output_on_cuda():
    from megatron.core.tensor_parallel import CheckpointWithoutOutput
    x = torch.randn(64, 32, device="cuda", requires_grad=True)
    w = torch.randn(32, 32, device="cuda", requires_grad=True)

    def f(a, b):
        return F.dropout(torch.tanh(a @ b), 0.2)

    torch.cuda.manual_seed(3)
    ref = torch.autograd.grad((f(x, w) ** 3).sum(), (x, w))
    torch.cuda.manual_seed(3)
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(f, x, w)
    z = y ** 3
    ckpt.discard_output_and_register_recompute(z)
    got = torch.autograd.grad(z.sum(), (x, w))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # same kernels, same dropout mask


def test_vocab_parallel_cross_entropy_bf16_on_cuda():
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    logits = torch.randn(16, 2, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 1000, (16, 2), device="cuda")
    loss = vocab_parallel_cross_entropy(logits, target)
    ref_logits = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, 1000), target.view(-1), reduction="none").view(16, 2)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)  # both compute in fp32
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad, rtol=0, atol=4e-3)  # bf16 rounding of the grad


def test_async_save_of_device_tensors_with_integrity(tmp_path):
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import AsyncCallsQueue, ShardedTensor
    w = torch.randn(8, 4, device="cuda")
    queue = AsyncCallsQueue(persistent=True)
    request = dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, str(tmp_path / "c"), async_sharded_save=True,
                      verify_integrity=True)
    queue.schedule_async_request(request)
    queue.close()
    out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty_like(w))}, str(tmp_path / "c"),
                  verify_integrity=True)
    assert torch.equal(out["w"], w)
