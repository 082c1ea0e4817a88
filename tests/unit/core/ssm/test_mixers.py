"""Mamba-2 and Gated DeltaNet mixers on one process: Megatron's parameter names and shapes, the TP layout
of the fused in_proj (each section sliced on its own), gradients reaching every parameter, and the
mixer equal to its math written out with the sequential references."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_spec
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.ssm.ops.gated_delta_reference import recurrent_gated_delta_rule_reference
from megatron.core.ssm.ops.ssd_reference import ssd_sequential_reference
from megatron.core.transformer.initialize import local_slice
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.fixtures.tiny_gpt import single_rank


def _config(**kw):
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                normalization="RMSNorm", add_bias_linear=False, mamba_state_dim=8, mamba_head_dim=8,
                mamba_num_groups=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=4, use_cpu_initialization=True)
    base.update(kw)
    return TransformerConfig(**base)


def _mixer(kind):
    spec = get_hybrid_stack_spec().submodules
    if kind == "mamba":
        sub = spec.mamba_layer.submodules.mixer
        return MambaMixer(_config(), sub.submodules, d_model=32, chunk_size=8)
    sub = spec.gdn_layer.submodules.self_attention
    return GatedDeltaNet(_config(), sub.submodules)


def test_mamba_mixer_matches_its_math():
    single_rank()
    if True:
        torch.manual_seed(0)
        m = _mixer("mamba")
        names = {n for n, _ in m.named_parameters()}
        assert names == {"in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                         "out_proj.weight"}
        assert m.in_proj.weight.shape == (2 * 64 + 2 * 2 * 8 + 8, 32)
        x = torch.randn(13, 2, 32)
        out, _ = m(x)
        out.sum().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
        # The same computation, written out with the fp64 sequential recurrence.
        with torch.no_grad():
            proj = (x.double() @ m.in_proj.weight.double().T).transpose(0, 1)  # [b, s, d]
            z, xbc, dt = proj.split([64, 64 + 32, 8], dim=-1)
            xbc = F.silu(F.conv1d(xbc.transpose(1, 2), m.conv1d.weight.double(), m.conv1d.bias.double(),
                                  padding=3, groups=96)[..., :13]).transpose(1, 2)
            xs, B, C = xbc.split([64, 16, 16], dim=-1)
            dt = F.softplus(dt + m.dt_bias.double())
            y, _ = ssd_sequential_reference(xs.reshape(2, 13, 8, 8), dt, -m.A_log.double().exp(),
                                            B.reshape(2, 13, 2, 8), C.reshape(2, 13, 2, 8), D=m.D.double())
            y = y.reshape(2, 13, 64) * F.silu(z)
            y = y.reshape(2, 13, 2, 32)
            y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(2, 13, 64) * m.norm.weight.double()
            ref = (y @ m.out_proj.weight.double().T).transpose(0, 1)
        assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_gated_delta_net_matches_its_math():
    single_rank()
    if True:
        torch.manual_seed(0)
        m = _mixer("gdn")
        names = {n for n, _ in m.named_parameters()}
        assert names == {"in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "out_norm.weight", "out_proj.weight"}
        x = torch.randn(11, 2, 32)
        out, _ = m(x)
        out.sum().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
        with torch.no_grad():
            proj = (x.double() @ m.in_proj.weight.double().T).transpose(0, 1)
            qkv, z, beta, alpha = proj.split([16 + 16 + 32, 32, 4, 4], dim=-1)
            qkv = F.silu(F.conv1d(qkv.transpose(1, 2), m.conv1d.weight.double(), padding=3,
                                  groups=64)[..., :11]).transpose(1, 2)
            q, k, v = qkv.split([16, 16, 32], dim=-1)
            q, k = (t.reshape(2, 11, 2, 8) for t in (q, k))
            q, k = (t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))  # fla's l2norm
            q, k = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
            g = -m.A_log.double().exp() * F.softplus(alpha + m.dt_bias.double())
            o, _ = recurrent_gated_delta_rule_reference(q, k, v.reshape(2, 11, 4, 8), g, beta.sigmoid())
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * m.out_norm.weight.double()
            o = o * F.silu(z.reshape(2, 11, 4, 8))
            ref = (o.reshape(2, 11, 32) @ m.out_proj.weight.double().T).transpose(0, 1)
        assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


class _Sectioned:
    """A stand-in parameter: TP rank r of 2, fused parts of local sizes 3, 1, 2."""

    tensor_model_parallel, partition_dim, partition_stride, allreduce = True, 0, 1, True
    partition_sizes = [3, 1, 2]


def test_local_slice_splits_each_section_over_tp():
    full = torch.arange(12.0)  # global parts: [0..5], [6, 7], [8..11]

    class PG:
        def __init__(self, r):
            self.tp = type("G", (), {"rank": lambda s, r=r: r, "size": lambda s: 2})()
    rank0 = local_slice(full, _Sectioned(), PG(0))
    rank1 = local_slice(full, _Sectioned(), PG(1))
    assert rank0.tolist() == [0, 1, 2, 6, 8, 9] and rank1.tolist() == [3, 4, 5, 7, 10, 11]


def test_context_parallel_needs_whole_groups_per_rank():
    """Mamba-2 under CP gives each CP rank whole B/C groups (the all-to-all splits the groups)."""
    from megatron.core.ssm.mamba_mixer import check_mamba_shapes
    check_mamba_shapes(16, 4, 2, 2)  # 2 groups per TP rank, 1 per CP rank
    with pytest.raises(ValueError, match=r"--mamba-num-groups \(2\) must be divisible by --tensor-model-parallel-size "
                                         r"x --context-parallel-size \(2 x 2\)"):
        check_mamba_shapes(16, 2, 2, 2)


def test_gated_deltanet_context_parallel_needs_whole_key_heads_per_rank():
    from megatron.core.ssm.gated_delta_net import check_gdn_shapes
    check_gdn_shapes(4, 8, 2, 2)  # 2 key heads per TP rank, 1 per CP rank
    with pytest.raises(ValueError, match=r"--linear-num-key-heads \(2\) must be divisible by "
                                         r"--tensor-model-parallel-size x --context-parallel-size \(2 x 2\)"):
        check_gdn_shapes(2, 4, 2, 2)
