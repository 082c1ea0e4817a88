"""DDP's grad hook, and the fused weight-gradient GEMM of the linears, write a parameter's first gradient of an
iteration into the zeroed main_grad instead of adding it (no read of the fp32 buffer) and add every later one:
main_grad equals the plain autograd sum over the micro-batches for every parameter, the tied embedding (a GEMM's
write, then the lookup's gradient added by the hook) included, and exactly the first write of each parameter per
iteration overwrites."""
import torch

import megatron.core.distributed.distributed_data_parallel as ddp_module
import megatron.core.tensor_parallel.weight_grad as weight_grad_module
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.fusions.grad_accumulation import accumulate_into_main_grad
from tests.fixtures.tiny_gpt import single_rank, tiny_config, tiny_gpt

V, S, B = 64, 16, 2


def _loss(model, tokens):
    return model(tokens, torch.arange(S)[None].expand(B, S), None, labels=tokens).sum()


def test_overwrite_writes_and_add_accumulates():
    main = torch.full((4,), 5.0)
    g = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    assert torch.equal(accumulate_into_main_grad(main, g, overwrite=True), g.float())
    assert torch.equal(accumulate_into_main_grad(main, g), 2 * g.float())


def test_main_grad_equals_the_autograd_sum_over_micro_batches(monkeypatch):
    single_rank()
    torch.manual_seed(0)
    config = tiny_config(gradient_accumulation_fusion=True)
    plain = tiny_gpt(config, vocab_size=V)  # tied embedding: the output layer's fused wgrad and the lookup's .grad
    twin = tiny_gpt(config, vocab_size=V)
    twin.load_state_dict(plain.state_dict())
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), twin)
    calls = []
    real = ddp_module.accumulate_into_main_grad

    def record(main_grad, grad, overwrite=False):
        calls.append((main_grad.data_ptr(), overwrite))
        return real(main_grad, grad, overwrite=overwrite)

    monkeypatch.setattr(ddp_module, "accumulate_into_main_grad", record)
    gemm_calls = []
    real_gemm = weight_grad_module._accumulate_weight_grad

    def record_gemm(main_grad, g2d, x2d, overwrite=False):
        gemm_calls.append((main_grad.data_ptr(), overwrite))
        return real_gemm(main_grad, g2d, x2d, overwrite=overwrite)

    monkeypatch.setattr(weight_grad_module, "_accumulate_weight_grad", record_gemm)
    batches = [torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    for step in range(2):  # two iterations of three micro-batches: the buffer is reset in between
        model.zero_grad_buffer()
        plain.zero_grad()
        calls.clear()
        gemm_calls.clear()
        for tokens in batches[3 * step:3 * step + 3]:
            _loss(model, tokens).backward()
            _loss(plain, tokens).backward()
        by_param = {}
        for ptr, overwrite in calls:
            by_param.setdefault(ptr, []).append(overwrite)
        fused = {p.main_grad.data_ptr() for p in model.module.parameters() if p.grad_added_to_main_grad}
        # a param a fused wgrad GEMM wrote to (the tied embedding: the output layer's GEMM, then the lookup's
        # .grad) only adds; every other param overwrites exactly once, at its first gradient
        odd = {ptr: flags for ptr, flags in by_param.items()
               if flags != ([False] * len(flags) if ptr in fused else [True] + [False] * (len(flags) - 1))}
        assert by_param and fused & set(by_param) and not odd, odd
        # the fused weight-gradient GEMMs: the first of the iteration writes (beta = 0), the others add
        by_weight = {}
        for ptr, overwrite in gemm_calls:
            by_weight.setdefault(ptr, []).append(overwrite)
        assert set(by_weight) == fused and all(f == [True] + [False] * (len(f) - 1) for f in by_weight.values())
        named = dict(model.module.named_parameters())
        for name, p in plain.named_parameters():
            torch.testing.assert_close(named[name].main_grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
