"""Run by test_fla_interpreted.py with TRITON_INTERPRET=1: fla 0.6.0's Triton kernels executed by Triton's CPU
interpreter, so the fla path with the PyTorch dq/dk/dw/dg step is checked end to end without a GPU.

Three shims make the interpreter run fla's kernels (test-only; they touch nothing outside this process): autotuning
picks a config without timing it (no GPU to time on); a one-element interpreter value converts to an index; and
a kernel's ``for i in range(n)`` yields interpreter scalars, as the compiler's loop variables are (fla calls
``i.to(tl.int64)`` on them). Prints one line per comparison: name, max relative error, tolerance."""
import builtins
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
import triton.language as tl
import triton.runtime.autotuner as autotuner
import triton.runtime.interpreter as interpreter

assert os.environ.get("TRITON_INTERPRET") == "1"
ROOT = os.path.abspath(__file__).rsplit(os.sep, 5)[0]  # <root>/tests/unit/core/ssm/this.py
sys.path.insert(0, ROOT)
autotuner.Autotuner._bench = lambda self, *args, config=None, **kwargs: [0.0, 0.0, 0.0]
_patch_tensor, _grid_call, _running = interpreter._patch_lang_tensor, interpreter.GridExecutor.__call__, [0]


def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


def _grid_executor_call(self, *args, **kwargs):
    _running[0] += 1
    try:
        return _grid_call(self, *args, **kwargs)
    finally:
        _running[0] -= 1


def _kernel_range(*args):
    if not _running[0]:  # host code of the same module
        return builtins.range(*args)
    bounds = [int(a.handle.data.item()) if isinstance(a, tl.tensor) else int(a) for a in args]
    return (tl.tensor(interpreter.TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)
            for i in builtins.range(*bounds))


interpreter._patch_lang_tensor = _patch_lang_tensor
interpreter.GridExecutor.__call__ = _grid_executor_call

import fla.ops.common.chunk_delta_h  # noqa: E402
import fla.ops.common.chunk_o  # noqa: E402
from fla.ops.common.chunk_o import chunk_bwd_dqkwg  # noqa: E402
from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402
from fla.ops.utils import chunk_local_cumsum  # noqa: E402

from megatron.core.ssm.ops._fla_gated_delta import (  # noqa: E402
    chunk_gated_delta_rule_torch_dqkwg,
    unsupported_reason,
)
from megatron.core.ssm.ops.gated_delta_dqkwg import chunk_bwd_dqkwg_torch  # noqa: E402
from megatron.core.ssm.ops.gated_delta_reference import chunk_gated_delta_rule_torch  # noqa: E402

fla.ops.common.chunk_delta_h.range = fla.ops.common.chunk_o.range = _kernel_range


def report(name, got, ref, tol):
    err = ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-12)).item()
    print(f"{name} {err:.3e} {tol:g}", flush=True)


def dqkwg_vs_fla_kernel(B, T, H, HV, K, V, state_v_first):
    """The PyTorch step against fla's own Triton ``chunk_bwd_dqkwg`` on the same random inputs."""
    gen = torch.Generator().manual_seed(T)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v, do, dv, w = (torch.randn(B, T, HV, d, generator=gen) for d in (V, V, V, K))
    g = chunk_local_cumsum(F.logsigmoid(torch.randn(B, T, HV, generator=gen)), chunk_size=64, scale=1 / np.log(2))
    layout = (V, K) if state_v_first else (K, V)
    h, dh = (torch.randn(B, -(-T // 64), HV, *layout, generator=gen) for _ in range(2))
    ref = chunk_bwd_dqkwg(q=q, k=k, v=v, w=w, g=g, h=h, dv=dv, do=do, dh=dh, scale=0.3, state_v_first=state_v_first,
                          chunk_size=64)
    got = chunk_bwd_dqkwg_torch(q, k, v, w, g, h, dv, do, dh, 0.3, chunk_size=64, state_v_first=state_v_first)
    for name, a, b in zip("dq dk dw dg".split(), got, ref):
        report(f"dqkwg[B={B},T={T},HV={HV},v_first={state_v_first}].{name}", a, b, 1e-5)


def composed_vs(B, T, H, HV, K, V, reference, tol):
    """Forward output, final state and every input gradient (with an initial state) of the composed path."""
    gen = torch.Generator().manual_seed(B * T)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g, beta = F.logsigmoid(torch.randn(B, T, HV, generator=gen)), torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen)
    results = []
    for fn in (chunk_gated_delta_rule_torch_dqkwg, reference):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
        qq, kk = leaves[:2]
        if fn is chunk_gated_delta_rule_torch:  # the eager scan takes one key head per value head
            qq, kk = qq.repeat_interleave(HV // H, 2), kk.repeat_interleave(HV // H, 2)
        o, state = fn(qq, kk, *leaves[2:5], initial_state=leaves[5], output_final_state=True)
        (o.pow(2).sum() + state.pow(2).sum()).backward()
        results.append([o, state] + [t.grad for t in leaves])
    for name, a, b in zip("o final q k v g beta h0".split(), *results):
        report(f"vs_{reference.__name__}[B={B},T={T},HV={HV}].{name}", a, b, tol)


assert not unsupported_reason(), unsupported_reason()
dqkwg_vs_fla_kernel(2, 100, 2, 4, 16, 32, False)
dqkwg_vs_fla_kernel(1, 70, 1, 1, 32, 16, True)
composed_vs(2, 100, 1, 2, 16, 32, chunk_gated_delta_rule, 1e-5)  # fla's own chunk_gated_delta_rule
# the eager scan in fp32: chunk-by-chunk solves vs fla's blocked inverse differ by fp32 rounding, ~1e-6
composed_vs(2, 128, 2, 2, 16, 16, chunk_gated_delta_rule_torch, 1e-4)
composed_vs(2, 100, 1, 2, 16, 32, chunk_gated_delta_rule_torch, 1e-4)
