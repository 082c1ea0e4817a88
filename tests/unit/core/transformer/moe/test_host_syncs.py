"""The MoE layer's forward and backward read no device value on the host when no token can be dropped
and the experts run the grouped GEMM (the GPU fast path; torch runs _grouped_mm on CPU in fp32 here).
On the GPU each counted call below (``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero``, a tensor in an
``if``) waits for the device. These are the single-rank paths; with expert parallelism the all-to-all
dispatcher reads its token counts once per layer on purpose (NCCL's all-to-all takes its split sizes on
the host; docs/moe.md lists the reads that remain and why)."""
import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_moe_module_spec
from megatron.core.transformer.moe import experts as experts_module
from megatron.core.transformer.spec_utils import build_module
from tests.fixtures.tiny_gpt import tiny_config

H, E = 32, 4
_READS = ("item", "tolist", "cpu", "nonzero", "__bool__", "__int__", "__float__", "numpy")


@pytest.fixture
def host_reads(monkeypatch):
    calls = []
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def _layer(dispatcher, **kw):
    torch.manual_seed(1)
    config = tiny_config(hidden_size=H, num_moe_experts=E, moe_router_topk=2, gated_linear_unit=True,
                         activation_func=torch.nn.functional.silu, add_bias_linear=False,
                         moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_grouped_gemm=True,
                         moe_token_dispatcher_type=dispatcher, **kw)
    return build_module(get_moe_module_spec(num_experts=E, moe_grouped_gemm=True), config=config)


@pytest.mark.parametrize("dispatcher,kw", [
    ("alltoall", {}),
    ("allgather", {}),
    ("alltoall", {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                  "moe_router_load_balancing_type": "seq_aux_loss"}),
    ("alltoall", {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}),
    ("alltoall", {"delay_wgrad_compute": True}),
])
def test_forward_and_backward_read_nothing_on_the_host(monkeypatch, host_reads, dispatcher, kw):
    layer = _layer(dispatcher, **kw)
    x = torch.randn(8, 2, H, requires_grad=True)
    try:
        torch._grouped_mm(torch.randn(4, 8), torch.randn(1, 8, 8), offs=torch.tensor([4], dtype=torch.int32))
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        pytest.skip(f"_grouped_mm not available on CPU in this torch: {e}")
    monkeypatch.setattr(experts_module, "grouped_mm_available", lambda *a: True)
    del host_reads[:]
    out, _ = layer(x)
    out.sum().backward()
    assert host_reads == []
    assert x.grad is not None and layer.experts.weight1.grad is not None


def test_the_counter_sees_a_host_read(host_reads):
    """Without the grouped GEMM the experts' loop splits by counts read on the host: the counter sees it."""
    layer = _layer("allgather")
    del host_reads[:]
    layer(torch.randn(8, 2, H))
    assert "tolist" in host_reads
