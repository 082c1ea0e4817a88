"""The chunked eager scans (what CPU runs, and what GPU kernels are tested against) equal the
step-by-step recurrences: fp32 chunked vs fp64 sequential, outputs, final states and gradients.
Tolerance 1e-5 relative: fp32 rounding over a few dozen steps of products of exp decays is ~1e-7."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.ssm.ops.gated_delta_reference import (
    chunk_gated_delta_rule_torch,
    recurrent_gated_delta_rule_reference,
)
from megatron.core.ssm.ops.ssd_reference import ssd_chunk_scan_torch, ssd_sequential_reference

RTOL = 1e-5


def _close(a, ref):
    assert (a.double() - ref).abs().max().item() <= RTOL * ref.abs().max().item(), (a, ref)


def _ssd_inputs(seed, b=2, l=37, h=4, p=8, g=2, n=6):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, h, p, generator=gen)
    dt = F.softplus(torch.randn(b, l, h, generator=gen))
    A = -(torch.rand(h, generator=gen) * 3 + 0.5)
    B, C = torch.randn(b, l, g, n, generator=gen), torch.randn(b, l, g, n, generator=gen)
    D, s0 = torch.randn(h, generator=gen), torch.randn(b, h, p, n, generator=gen)
    return x, dt, A, B, C, D, s0


@pytest.mark.parametrize("chunk", [8, 16, 64])  # 37 tokens: padded last chunk, several chunks, one chunk
def test_ssd_chunked_equals_recurrence_forward_and_backward(chunk):
    inputs = _ssd_inputs(0)
    f32 = [t.clone().requires_grad_() for t in inputs]
    f64 = [t.double().requires_grad_() for t in inputs]
    x, dt, A, B, C, D, s0 = f32
    y, state = ssd_chunk_scan_torch(x, dt, A, B, C, chunk, D=D, initial_states=s0, return_final_states=True)
    x2, dt2, A2, B2, C2, D2, s02 = f64
    y_ref, state_ref = ssd_sequential_reference(x2, dt2, A2, B2, C2, D=D2, initial_states=s02)
    _close(y, y_ref)
    _close(state, state_ref)
    weight = torch.randn(y_ref.shape, dtype=y_ref.dtype, generator=torch.Generator().manual_seed(1))  # not global RNG
    ((y * weight.float()).sum() + state.sum()).backward()
    ((y_ref * weight).sum() + state_ref.sum()).backward()
    for a, r in zip(f32, f64):
        _close(a.grad, r.grad)


def test_ssd_per_channel_d_and_no_initial_state():
    x, dt, A, B, C, _, _ = _ssd_inputs(1, h=2, p=4, g=1)
    D = torch.randn(2 * 4)
    y = ssd_chunk_scan_torch(x, dt, A, B, C, 16, D=D)
    y_ref, _ = ssd_sequential_reference(*(t.double() for t in (x, dt, A, B, C)), D=D.double())
    _close(y, y_ref)


def _gdn_inputs(seed, b=2, l=37, h=4, dk=8, dv=6):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, l, h, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(b, l, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, l, h, dv, generator=gen)
    g = -torch.rand(b, l, h, generator=gen) * 2
    beta = torch.rand(b, l, h, generator=gen)
    return q, k, v, g, beta, torch.randn(b, h, dk, dv, generator=gen)


@pytest.mark.parametrize("chunk", [8, 16, 64])
def test_gated_delta_chunked_equals_recurrence_forward_and_backward(chunk):
    inputs = _gdn_inputs(0)
    f32 = [t.clone().requires_grad_() for t in inputs]
    f64 = [t.double().requires_grad_() for t in inputs]
    q, k, v, g, beta, s0 = f32
    o, state = chunk_gated_delta_rule_torch(q, k, v, g, beta, chunk_size=chunk, initial_state=s0,
                                            output_final_state=True)
    o_ref, state_ref = recurrent_gated_delta_rule_reference(*f64[:5], initial_state=f64[5])
    _close(o, o_ref)
    _close(state, state_ref)
    weight = torch.randn(o_ref.shape, dtype=o_ref.dtype, generator=torch.Generator().manual_seed(1))  # not global RNG
    ((o * weight.float()).sum() + state.sum()).backward()
    ((o_ref * weight).sum() + state_ref.sum()).backward()
    for a, r in zip(f32, f64):
        _close(a.grad, r.grad)


def test_fla_refused_where_its_backward_is_wrong(monkeypatch):
    """fla's gated-delta backward is wrong with Triton 3.4.0-3.7.0 on Hopper (it raises mid-backward); the kernel
    picker says so up front and the eager scan runs instead. Other GPUs, other Triton versions or tilelang: no
    objection."""
    import sys
    import types

    from megatron.core.ssm.ops import kernels

    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: None)  # no tilelang
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "Triton 3.6.0 on a Hopper GPU" in kernels._fla_unsafe_here(torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.7.1+git"))
    assert kernels._fla_unsafe_here(torch.device("cpu")) == ""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    assert kernels._fla_unsafe_here(torch.device("cpu")) == ""
