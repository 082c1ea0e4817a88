"""Muon: momentum SGD whose update is orthogonalised by a Newton-Schulz iteration (Megatron 0.19's
`--optimizer muon`), with tensor-parallel orthogonalisation and the fused QKV weight split into q, k, v.

Own implementation, not `torch.optim.Muon` or the `emerging-optimizers` package: torch's Muon runs one
fixed coefficient triple in bf16 with its own LR scaling and has no hook between momentum and
orthogonalisation, so it cannot gather a TP-sharded matrix, split QKV or apply Megatron's scale modes;
emerging-optimizers needs Python >= 3.12 (the CPU test hosts run 3.11) and pulls in absl. The math below
follows emerging-optimizers 0.3 (`OrthogonalizedOptimizer`, `newton_schulz_tp`, `get_muon_scale_factor`),
which Megatron 0.19 wraps, so a run here updates a weight as Megatron's does.
"""
from contextlib import contextmanager
from itertools import chain, cycle, islice, repeat
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state

# Newton-Schulz coefficients (a, b, c) of X <- a X + b (X X^T) X + c (X X^T)^2 X, per iteration.
NS_COEFFICIENTS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
    "cans": [(8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
             (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)],
    "aol": [(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)],
}
# Sets tuned as a sequence keep their last triple after running out; the others start over.
_REPEAT_LAST = ("polar_express", "cans")
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
TP_MODES = ("blockwise", "duplicated", "distributed")


def ns_coefficients(coefficient_type: str, steps: int) -> List[Tuple[float, float, float]]:
    sets = NS_COEFFICIENTS[coefficient_type]
    source = chain(sets, repeat(sets[-1])) if coefficient_type in _REPEAT_LAST else cycle(sets)
    return list(islice(source, steps))


def newton_schulz(x: torch.Tensor, steps: int, coefficient_type: str = "quintic", bf16: bool = False,
                  transpose: Optional[bool] = None, tp_group=None, eps: float = 1e-7) -> torch.Tensor:
    """Approximate orthogonal factor U V^T of the fp32 matrix ``x`` = U S V^T.

    Iterates on the wide orientation (rows <= columns) so the Gram matrix X X^T is the small one. With
    ``tp_group``, ``x`` is one shard of a matrix split along the dimension that the Gram sum runs over
    (columns after the optional transpose): the norm and each Gram matrix are all-reduced over the group,
    so every rank iterates its own shard of the whole-matrix result. ``bf16`` runs the iteration in bf16
    (Megatron's default `--muon-fp32-matmul-prec medium`)."""
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    sq = (x * x).sum()
    if tp_group is not None:
        dist.all_reduce(sq, group=tp_group)
    X = x / sq.sqrt().clamp_min(eps)  # Frobenius norm 1 bounds the spectral norm by 1
    if bf16:
        X = X.to(torch.bfloat16)
    for a, b, c in ns_coefficients(coefficient_type, steps):
        A = X @ X.mT
        if tp_group is not None:
            dist.all_reduce(A, group=tp_group)
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.addmm(X, B, X, beta=a, alpha=1.0)  # a X + B X
    X = X.float()
    return X.mT if transpose else X


def muon_scale_factor(size_out: int, size_in: int, mode: str) -> float:
    """Update scale for a [size_out, size_in] matrix: "spectral" sqrt(max dim) (Kimi's, keeps AdamW's
    LR range), "unit_rms_norm" sqrt(out / in), "shape_scaling" sqrt(max(1, out / in)) (Keller Jordan's)."""
    if mode == "spectral":
        return max(size_out, size_in) ** 0.5
    if mode == "unit_rms_norm":
        return (size_out / size_in) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, size_out / size_in) ** 0.5
    raise ValueError(f"--muon-scale-mode {mode}: use one of {', '.join(SCALE_MODES)}")


@contextmanager
def _fp32_matmul_precision(precision: str):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class TensorParallelMuon(torch.optim.Optimizer):
    """Muon for 2-D weights (Megatron's name). Per step, for each param p with grad g:
    p <- p (1 - lr wd); m <- lerp(m, g, 1 - momentum); u = lerp(g, m, momentum) with nesterov else m;
    p <- p - lr * extra_scale * scale(shape) * NS(u).

    TP (`tp_mode`, Megatron's `--muon-tp-mode`): "blockwise" orthogonalises each rank's shard on its own
    (the update depends on the TP size, as in Megatron, whose default it is); "duplicated" all-gathers the
    shard over TP, orthogonalises the whole matrix on every rank and keeps its own slice; "distributed"
    iterates on the shards, all-reducing the small Gram matrices. The last two equal TP=1.
    A param tagged `is_qkv` with `qkv_split_shapes` [q, k, v] rows per query group (`split_qkv`) is
    orthogonalised as three matrices: every group's q rows, every group's k rows, every group's v rows.
    Expert params (`allreduce` False) use the expert-TP group."""

    def __init__(self, params, lr: float = 3e-4, momentum: float = 0.95, nesterov: bool = False,
                 weight_decay: float = 0.01, split_qkv: bool = True, fp32_matmul_prec: str = "medium",
                 coefficient_type: str = "quintic", num_ns_steps: int = 5, scale_mode: str = "spectral",
                 extra_scale_factor: float = 1.0, tp_mode: str = "blockwise", tp_group=None, expert_tp_group=None):
        if num_ns_steps < 1:
            raise ValueError(f"--muon-num-ns-steps must be >= 1, got {num_ns_steps}")
        if coefficient_type not in NS_COEFFICIENTS:
            raise ValueError(f"--muon-coefficient-type {coefficient_type}: use one of {', '.join(NS_COEFFICIENTS)}")
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"--muon-scale-mode {scale_mode}: use one of {', '.join(SCALE_MODES)}")
        if tp_mode not in TP_MODES:
            raise ValueError(f"--muon-tp-mode {tp_mode}: use one of {', '.join(TP_MODES)}")
        if fp32_matmul_prec not in ("medium", "high"):
            raise ValueError(f"--muon-fp32-matmul-prec {fp32_matmul_prec}: use medium (bf16 Newton-Schulz) or "
                             "high (fp32, TF32 on CUDA); torch has no lower fp32 matmul precision")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov))
        self.split_qkv, self.fp32_matmul_prec = split_qkv, fp32_matmul_prec
        self.coefficient_type, self.num_ns_steps = coefficient_type, num_ns_steps
        self.scale_mode, self.extra_scale_factor, self.tp_mode = scale_mode, extra_scale_factor, tp_mode
        self._tp_group, self._expert_tp_group = tp_group, expert_tp_group

    def init_state(self, p: torch.Tensor) -> None:
        """Zero momentum (what the first step would create), so the state can be saved or loaded into."""
        if "momentum_buffer" not in self.state[p]:
            self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("TensorParallelMuon.step: closures are not supported")
        for group in self.param_groups:
            lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() != 2:
                    raise ValueError(f"Muon updates 2-D weights only; got a param of shape {tuple(p.shape)}")
                self.init_state(p)
                buf = self.state[p]["momentum_buffer"]
                if wd != 0.0:
                    p.mul_(1.0 - lr * wd)  # decoupled weight decay, before the update
                buf.lerp_(p.grad, 1.0 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                p.add_(self.orthogonalize(p, update), alpha=-lr)
        return None

    def _tp(self, p) -> Tuple[Optional[object], Optional[int]]:
        """(TP group, dim the param is split along over it), or (None, None) for a whole local matrix."""
        if self.tp_mode == "blockwise" or not getattr(p, "tensor_model_parallel", False):
            return None, None
        expert = not getattr(p, "allreduce", True)
        if expert:
            group = self._expert_tp_group or parallel_state.get_expert_tensor_parallel_group()
        else:
            group = self._tp_group or parallel_state.get_tensor_model_parallel_group()
        dim = getattr(p, "partition_dim", -1)
        if group is None or dist.get_world_size(group) == 1 or dim not in (0, 1):
            return None, None
        return group, dim

    def orthogonalize(self, p: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """The scaled orthogonal update of ``p`` (its fp32 main param) from ``update`` [out, in] (local)."""
        group, dim = self._tp(p)
        shapes = getattr(p, "qkv_split_shapes", None)
        with _fp32_matmul_precision(self.fp32_matmul_prec):
            if not (self.split_qkv and getattr(p, "is_qkv", False) and shapes):
                return self._scaled_ns(update, group, dim)
            # Rows are [q, k, v] per query group: [groups, q + k + v, in] -> three [groups * part, in].
            groups, cols = update.size(0) // sum(shapes), update.size(1)
            parts = torch.split(update.view(groups, sum(shapes), cols), list(shapes), dim=1)
            outs = [self._scaled_ns(part.reshape(-1, cols), group, dim).view(groups, -1, cols) for part in parts]
            return torch.cat(outs, dim=1).view_as(update)

    def _scaled_ns(self, x: torch.Tensor, group, dim: Optional[int]) -> torch.Tensor:
        size = list(x.shape)
        kwargs = dict(steps=self.num_ns_steps, coefficient_type=self.coefficient_type,
                      bf16=self.fp32_matmul_prec == "medium")
        if dim is None:
            out = newton_schulz(x, **kwargs)
        else:
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            size[dim] *= world
            if self.tp_mode == "duplicated":
                shards = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(shards, x.contiguous(), group=group)  # pairs with every TP peer's step
                out = newton_schulz(torch.cat(shards, dim=dim), **kwargs).chunk(world, dim=dim)[rank]
            else:  # distributed: the split dim must be the one the Gram matrices sum over
                out = newton_schulz(x, transpose=dim == 0, tp_group=group, **kwargs)
        return out * (muon_scale_factor(size[0], size[1], self.scale_mode) * self.extra_scale_factor)
