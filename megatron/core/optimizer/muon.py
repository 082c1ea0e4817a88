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
from typing import Dict, List, NamedTuple, Optional, Tuple

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
NS_EPS = 1e-7  # floor of the Frobenius norm that Newton-Schulz divides by


def ns_coefficients(coefficient_type: str, steps: int) -> List[Tuple[float, float, float]]:
    sets = NS_COEFFICIENTS[coefficient_type]
    source = chain(sets, repeat(sets[-1])) if coefficient_type in _REPEAT_LAST else cycle(sets)
    return list(islice(source, steps))


def newton_schulz(x: torch.Tensor, steps: int, coefficient_type: str = "quintic", bf16: bool = False,
                  transpose: Optional[bool] = None, tp_group=None, eps: float = NS_EPS) -> torch.Tensor:
    """Approximate orthogonal factor U V^T of the fp32 matrix ``x`` = U S V^T, or of each matrix of a batch
    ``x`` [n, rows, cols] (one Frobenius norm per matrix; batched GEMMs, so same-shaped weights share launches).

    Iterates on the wide orientation (rows <= columns) so the Gram matrix X X^T is the small one. With
    ``tp_group``, ``x`` is one shard of a matrix split along the dimension that the Gram sum runs over
    (columns after the optional transpose): the norm and each Gram matrix are all-reduced over the group
    (once per iteration for a whole batch), so every rank iterates its own shard of the whole-matrix result.
    ``bf16`` runs the iteration in bf16 (Megatron's default `--muon-fp32-matmul-prec medium`)."""
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    sq = (x * x).sum(dim=(-2, -1), keepdim=True)  # [1, 1] or [n, 1, 1]
    if tp_group is not None:
        dist.all_reduce(sq, group=tp_group)
    norm = sq.sqrt().clamp_min(eps)  # Frobenius norm 1 bounds the spectral norm by 1
    # With bf16 the division writes bf16 directly (the values of a divide then a cast, in one pass).
    X = torch.div(x, norm, out=torch.empty_like(x, dtype=torch.bfloat16)) if bf16 else x / norm
    X = ns_iterations(X, steps, coefficient_type, tp_group).float()
    return X.mT if transpose else X


def ns_iterations(X: torch.Tensor, steps: int, coefficient_type: str = "quintic", tp_group=None) -> torch.Tensor:
    """The Newton-Schulz iterations on ``X`` [rows, cols] or [n, rows, cols] (rows <= cols), already scaled to
    Frobenius norm <= 1 and in the iteration's dtype; with ``tp_group`` each Gram matrix is all-reduced."""
    addmm = torch.addmm if X.dim() == 2 else torch.baddbmm
    for a, b, c in ns_coefficients(coefficient_type, steps):
        A = X @ X.mT
        if tp_group is not None:
            dist.all_reduce(A, group=tp_group)
        B = addmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = addmm(X, B, X, beta=a, alpha=1.0)  # a X + B X
    return X


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


class _Piece(NamedTuple):
    """One matrix to orthogonalise: a param's update [out, in], or one q/k/v part of a fused QKV param's
    (``part`` = (query groups, rows per group, first row of the part in a group, rows of the part))."""
    param: torch.Tensor
    lr: float
    nesterov_momentum: Optional[float]  # None: the update is the momentum buffer itself
    part: Optional[Tuple[int, int, int, int]]

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """This piece of a param-shaped tensor: [out, in], or the part's rows [groups, rows, in] (a view)."""
        if self.part is None:
            return t
        groups, total, first, rows = self.part
        return t.view(groups, total, t.size(1))[:, first:first + rows]

    def shape(self) -> Tuple[int, int]:
        if self.part is None:
            return tuple(self.param.shape)
        return self.part[0] * self.part[3], self.param.size(1)


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
    Expert params (`allreduce` False) use the expert-TP group.

    Matrices of one shape, dtype and TP split (e.g. every layer's k and v parts) run one batched Newton-Schulz
    on their stack: fewer, larger GEMMs and one TP collective per iteration for the stack. A stack holds at
    most `ns_batch_elements` elements (it copies the updates; a bigger group runs as several stacks);
    0 orthogonalises one matrix at a time. Both give the same update (summation order aside)."""

    def __init__(self, params, lr: float = 3e-4, momentum: float = 0.95, nesterov: bool = False,
                 weight_decay: float = 0.01, split_qkv: bool = True, fp32_matmul_prec: str = "medium",
                 coefficient_type: str = "quintic", num_ns_steps: int = 5, scale_mode: str = "spectral",
                 extra_scale_factor: float = 1.0, tp_mode: str = "blockwise", tp_group=None, expert_tp_group=None,
                 ns_batch_elements: int = 2 ** 28):
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
        if ns_batch_elements < 0:
            raise ValueError(f"TensorParallelMuon(ns_batch_elements={ns_batch_elements}): use 0 (one matrix at "
                             "a time) or the most elements of one stacked Newton-Schulz batch")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov))
        self.split_qkv, self.fp32_matmul_prec = split_qkv, fp32_matmul_prec
        self.coefficient_type, self.num_ns_steps = coefficient_type, num_ns_steps
        self.scale_mode, self.extra_scale_factor, self.tp_mode = scale_mode, extra_scale_factor, tp_mode
        self._tp_group, self._expert_tp_group = tp_group, expert_tp_group
        self.ns_batch_elements = ns_batch_elements

    def init_state(self, p: torch.Tensor) -> None:
        """Zero momentum (what the first step would create), so the state can be saved or loaded into."""
        if "momentum_buffer" not in self.state[p]:
            self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("TensorParallelMuon.step: closures are not supported")
        pieces: List[_Piece] = []
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
                if self.ns_batch_elements == 0:
                    update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                    p.add_(self.orthogonalize(p, update), alpha=-lr)
                else:  # the update is formed when its stack is, so only one stack's copies exist at a time
                    pieces += self._pieces(p, lr, momentum if group["nesterov"] else None)
        with _fp32_matmul_precision(self.fp32_matmul_prec):
            for (shape, _, _, group, dim), members in self._batches(pieces).items():
                for chunk in self._chunks(members, shape, group, dim):
                    self._orthogonalize_stack(chunk, group, dim)
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

    def _qkv_parts(self, p: torch.Tensor) -> Optional[List[Tuple[int, int, int, int]]]:
        """(groups, rows per group, first row, rows) of each q/k/v part, or None to orthogonalise p whole."""
        shapes = getattr(p, "qkv_split_shapes", None)
        if not (self.split_qkv and getattr(p, "is_qkv", False) and shapes):
            return None
        total = sum(shapes)
        firsts = [sum(shapes[:i]) for i in range(len(shapes))]
        return [(p.size(0) // total, total, first, rows) for first, rows in zip(firsts, shapes)]

    def _pieces(self, p, lr: float, nesterov_momentum: Optional[float]) -> List[_Piece]:
        return [_Piece(p, lr, nesterov_momentum, part) for part in (self._qkv_parts(p) or [None])]

    def _batches(self, pieces: List[_Piece]) -> Dict[tuple, List[_Piece]]:
        """Pieces by what one batched iteration needs equal: shape, dtype, device, TP group and split dim (the
        q/k/v part need not match: the k and v parts of every layer share a stack). In first-seen order,
        which every TP peer shares, so the collectives of the stacks pair up."""
        batches: Dict[tuple, List[_Piece]] = {}
        for piece in pieces:
            group, dim = self._tp(piece.param)
            key = (piece.shape(), piece.param.dtype, piece.param.device, group, dim)
            batches.setdefault(key, []).append(piece)
        return batches

    def _chunks(self, members: List[_Piece], shape, group, dim) -> List[List[_Piece]]:
        """Members split into near-equal stacks of at most `ns_batch_elements` elements each (counting the
        gathered matrix in duplicated mode); a matrix larger than that runs alone."""
        elements = shape[0] * shape[1]
        if dim is not None and self.tp_mode == "duplicated":
            elements *= dist.get_world_size(group)
        per_stack = max(1, self.ns_batch_elements // elements)
        stacks = -(-len(members) // per_stack)
        size = -(-len(members) // stacks)
        return [members[i:i + size] for i in range(0, len(members), size)]

    def _orthogonalize_stack(self, chunk: List[_Piece], group, dim: Optional[int]) -> None:
        """Orthogonalise the pieces of ``chunk`` (one shape) as one [n, rows, cols] batch and apply them."""
        if dim is not None and self.tp_mode == "duplicated":
            out = self._scaled_ns(self._stacked_updates(chunk), group, dim)  # gathers the whole matrices
        else:
            out = self._scaled_stack_ns(chunk, group, dim)
        for piece, o in zip(chunk, out):
            target = piece.view(piece.param)
            target.add_(o.view_as(target), alpha=-piece.lr)

    def _stacked_updates(self, chunk: List[_Piece]) -> torch.Tensor:
        """[n, rows, cols] fp32 copy of the pieces' updates: the momentum, or with nesterov lerp(g, m, momentum)
        written straight into the stack (elementwise, so per piece it equals the whole-param update's values)."""
        first = chunk[0].param
        x = torch.empty((len(chunk), *chunk[0].shape()), dtype=first.dtype, device=first.device)
        for piece, slot in zip(chunk, x):  # a q/k/v part's [groups, rows, in] fills its [groups * rows, in]
            buf = piece.view(self.state[piece.param]["momentum_buffer"])
            slot = slot.view(buf.shape)
            if piece.nesterov_momentum is None:
                slot.copy_(buf)
            else:
                torch.lerp(piece.view(piece.param.grad), buf, piece.nesterov_momentum, out=slot)
        return x

    def _scaled_stack_ns(self, chunk: List[_Piece], group, dim: Optional[int]) -> torch.Tensor:
        """`_scaled_ns` of the pieces' stacked updates (local, or distributed over ``group``), building the
        stack as the normalised matrices themselves: the momentum is read straight into it, not copied first."""
        rows, cols = chunk[0].shape()
        if any(piece.nesterov_momentum is not None for piece in chunk):
            stack = self._stacked_updates(chunk)  # the nesterov update exists only once written somewhere
            updates = [slot.view(piece.view(piece.param).shape) for piece, slot in zip(chunk, stack)]
        else:
            updates = [piece.view(self.state[piece.param]["momentum_buffer"]) for piece in chunk]
        sq = torch.stack([(u * u).sum() for u in updates])  # each matrix's own reduction, as one at a time
        if group is not None:
            dist.all_reduce(sq, group=group)  # the whole matrices' norms: pairs with every TP peer's stack
        norms = sq.sqrt().clamp_min(NS_EPS)
        bf16 = self.fp32_matmul_prec == "medium"
        X = torch.empty((len(chunk), rows, cols), dtype=torch.bfloat16 if bf16 else updates[0].dtype,
                        device=updates[0].device)
        for u, norm, slot in zip(updates, norms, X):
            torch.div(u, norm, out=slot.view(u.shape))  # normalise, cast and stack in one pass
        del updates
        transpose = dim == 0 if group is not None else rows > cols
        X = ns_iterations(X.mT if transpose else X, self.num_ns_steps, self.coefficient_type, group).float()
        size = [rows, cols]
        if group is not None:
            size[dim] *= dist.get_world_size(group)
        return (X.mT if transpose else X) * (muon_scale_factor(*size, self.scale_mode) * self.extra_scale_factor)

    def orthogonalize(self, p: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """The scaled orthogonal update of ``p`` (its fp32 main param) from ``update`` [out, in] (local),
        one matrix at a time (the step's path with `ns_batch_elements` 0)."""
        group, dim = self._tp(p)
        with _fp32_matmul_precision(self.fp32_matmul_prec):
            parts = self._qkv_parts(p)
            if parts is None:
                return self._scaled_ns(update, group, dim)
            # Rows are [q, k, v] per query group: [groups, q + k + v, in] -> three [groups * part, in].
            pieces = [_Piece(p, 0.0, None, part) for part in parts]
            outs = [self._scaled_ns(piece.view(update).reshape(piece.shape()), group, dim).view_as(piece.view(update))
                    for piece in pieces]
            return torch.cat(outs, dim=1).view_as(update)

    def _scaled_ns(self, x: torch.Tensor, group, dim: Optional[int]) -> torch.Tensor:
        """Scaled NS of ``x``: one local matrix [rows, cols] or a stack [n, rows, cols] of same-shaped ones,
        split over ``group`` along matrix dim ``dim`` (None: not split)."""
        size = list(x.shape[-2:])
        kwargs = dict(steps=self.num_ns_steps, coefficient_type=self.coefficient_type,
                      bf16=self.fp32_matmul_prec == "medium")
        if dim is None:
            out = newton_schulz(x, **kwargs)
        else:
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            size[dim] *= world
            axis = dim - 2  # the split dim counted from the end: the same for a matrix and a stack
            if self.tp_mode == "duplicated":
                shards = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(shards, x.contiguous(), group=group)  # pairs with every TP peer's step
                out = newton_schulz(torch.cat(shards, dim=axis), **kwargs).chunk(world, dim=axis)[rank]
            else:  # distributed: the split dim must be the one the Gram matrices sum over
                out = newton_schulz(x, transpose=dim == 0, tp_group=group, **kwargs)
        return out * (muon_scale_factor(size[0], size[1], self.scale_mode) * self.extra_scale_factor)
