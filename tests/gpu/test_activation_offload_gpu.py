"""--cpu-offloading-num-layers on CUDA: the offloaded layers' saved activations leave the device (pinned host copies,
non-blocking) and come back for the backward. The gradients equal the run that keeps them (bf16, same kernels), and
the device memory held between forward and backward falls by about the offloaded layers' share.

Both runs use deterministic kernels (`--deterministic-mode`'s attention and torch's deterministic algorithms): by
default attention goes to cuDNN, whose backward adds in a different order from run to run, so two runs' gradients
differ in the last bits whether or not anything is offloaded (measured on H200: the embedding's first), and so does
flash attention's unless deterministic algorithms are enforced (with `warn_only` torch keeps its default)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(offload: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from tests.fixtures.tiny_gpt import single_rank, tiny_config
    single_rank()
    model_parallel_cuda_manual_seed(9)
    cfg = tiny_config(num_layers=4, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096,
                      cpu_offloading_num_layers=offload, bf16=True, params_dtype=torch.bfloat16,
                      deterministic_mode=True)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), 1024, 2048).cuda()
    ids = torch.randint(0, 1024, (4, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    pos = torch.arange(2048, device="cuda").unsqueeze(0).expand(4, -1)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = model(ids, pos, None).float().square().mean()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    torch.cuda.synchronize()
    return held, {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.fixture
def deterministic_algorithms(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    # not warn_only: with it torch keeps flash attention's non-deterministic backward (and says so in a warning)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn_only)


def test_offloaded_activations_leave_the_device_and_train_the_same(deterministic_algorithms):
    held, grads = _run(0)
    off_held, off_grads = _run(3)
    print(f"activations held on the device after the forward: {held / 2**20:.0f} MiB, offloading 3 of 4 layers "
          f"{off_held / 2**20:.0f} MiB")
    assert off_held < 0.5 * held
    for name, g in grads.items():
        torch.testing.assert_close(off_grads[name], g, rtol=0, atol=0, msg=name)
