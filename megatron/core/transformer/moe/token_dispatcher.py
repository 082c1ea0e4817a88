"""Token dispatchers: bring each token to the ranks holding its experts, and the outputs back.

Every rank of the expert-tensor x expert-model parallel group (tp_ep) holds its own tokens (MoELayer
splits them over TP). Experts are laid out contiguously: EP rank m holds experts
[m * E_local, (m + 1) * E_local); expert-TP ranks hold column/row slices of the same experts and return
partial sums, so every combine ends in a sum over the expert-TP ranks.

- MoEAllGatherTokenDispatcher: all-gather every token of the tp_ep group, run the local experts on the
  tokens routed to them, reduce-scatter the partial outputs back.
- MoEAlltoAllTokenDispatcher: sort tokens by expert, all-to-all over EP with the exact split sizes (one
  host read of the token counts per layer), all-gather over expert-TP, and the mirror image to combine.
"""
import threading
from typing import List

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.process_groups_config import get_pg
from megatron.core.tensor_parallel.mappings import (
    _all_to_all,
    _gather_along_first_dim,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.launch_order import backward_turn, forward_turn
from megatron.core.transformer.moe.moe_utils import (
    _permute,
    _PermuteRows,
    _unpermute,
    chunk_sort_indices,
    fused_permute_fns,
    get_capacity,
)


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _gather_v(x, group, sizes: List[int]):
    """All-gather rows of different counts (``sizes[r]`` from rank r), as an all-to-all."""
    n = len(sizes)
    return _all_to_all(torch.cat([x] * n), group, sizes, [x.shape[0]] * n)


def _reduce_scatter_v(x, group, sizes: List[int]):
    """Sum ``x`` [sum(sizes), ...] over ``group``; rank r keeps rows of block r."""
    n, mine = len(sizes), sizes[_rank(group)]
    out = _all_to_all(x, group, [mine] * n, sizes)
    return out.view(n, mine, *x.shape[1:]).sum(dim=0)


class _GatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        with forward_turn():
            return _gather_v(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        with backward_turn():
            return _reduce_scatter_v(grad, ctx.group, ctx.sizes), None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        with forward_turn():
            return _reduce_scatter_v(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        with backward_turn():
            return _gather_v(grad, ctx.group, ctx.sizes), None, None


class _ExpertAllToAll(torch.autograd.Function):
    """The dispatch / combine all-to-all over EP. Its backward exchange runs on ``bwd_group``: the forward
    group itself, or its twin under --overlap-moe-expert-parallel-comm, where one micro-batch's backward
    runs beside the next one's forward and the two must not share a communicator. Given a
    ``wgrad_store`` with parked expert weight gradients (--delay-wgrad-compute), the backward exchange is
    launched asynchronously and those GEMMs run while it is in flight."""

    @staticmethod
    def forward(ctx, x, group, bwd_group, output_splits, input_splits, wgrad_store):
        ctx.bwd_group, ctx.output_splits, ctx.input_splits, ctx.wgrad_store = (bwd_group, output_splits,
                                                                                input_splits, wgrad_store)
        with forward_turn():
            return _all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        store = ctx.wgrad_store
        if store is None or not store.pending or _size(ctx.bwd_group) == 1:
            with backward_turn():
                out = _all_to_all(grad, ctx.bwd_group, ctx.input_splits, ctx.output_splits)
            if store is not None:
                store.flush()
            return out, None, None, None, None, None
        grad = grad.contiguous()
        out = grad.new_empty((sum(ctx.input_splits),) + tuple(grad.shape[1:]))
        with backward_turn():
            work = dist.all_to_all_single(out, grad, output_split_sizes=ctx.input_splits,
                                          input_split_sizes=ctx.output_splits, group=ctx.bwd_group, async_op=True)
        store.flush()  # the experts' weight-gradient GEMMs, while the exchange is in flight
        work.wait()
        return out, None, None, None, None, None


class _FlushWgrad(torch.autograd.Function):
    """Identity on the experts' input; its backward runs the parked weight gradients where no all-to-all
    backward does (no expert parallelism, the all-gather dispatcher)."""

    @staticmethod
    def forward(ctx, x, wgrad_store):
        ctx.wgrad_store = wgrad_store
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.wgrad_store.flush()
        return grad, None


def flush_wgrad_on_backward(x, wgrad_store):
    """``x`` unchanged; the backward through it flushes ``wgrad_store`` (when given)."""
    return x if wgrad_store is None else _FlushWgrad.apply(x, wgrad_store)


_BACKWARD_TWINS = {}


def backward_twin_group(group):
    """A second communicator over ``group``'s ranks (one per group, made by its members only), for the
    backward exchanges of --overlap-moe-expert-parallel-comm."""
    if group not in _BACKWARD_TWINS:
        _BACKWARD_TWINS[group] = dist.new_group(dist.get_process_group_ranks(group), use_local_synchronization=True)
    return _BACKWARD_TWINS[group]


class MoETokenDispatcher:
    """Common state: the expert groups, ep, expt_tp and tp_ep (an explicit ``pg_collection``'s, else
    parallel_state's)."""

    def __init__(self, config, pg_collection=None):
        self.config = config
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        if pg_collection is None:
            self.ep_group = parallel_state.get_expert_model_parallel_group()
            self.etp_group = parallel_state.get_expert_tensor_parallel_group()
            self.tp_ep_group = parallel_state.get_expert_tensor_and_model_parallel_group()
        else:
            owner = type(self).__name__
            self.ep_group = get_pg(pg_collection, "ep", owner)
            self.etp_group = get_pg(pg_collection, "expt_tp", owner)
            self.tp_ep_group = get_pg(pg_collection, "tp_ep", owner)
        self.ep_size, self.ep_rank = _size(self.ep_group), _rank(self.ep_group)
        self.etp_size, self.etp_rank = _size(self.etp_group), _rank(self.etp_group)
        self.tp_ep_size = _size(self.tp_ep_group)
        fused = config.moe_permute_fusion
        self._permute, self._unpermute = fused_permute_fns() if fused else (_permute, _unpermute)
        # True (MoELayer sets it): the experts scale each row by its routing prob (``expert_probs``, in
        # the experts' row order), Megatron's place for it; unpermutation then only sums the rows. False
        # (a dispatcher used on its own): unpermutation applies the probs.
        self.probs_to_experts = False
        self.expert_probs = None
        # The experts' parked weight gradients (--delay-wgrad-compute; MoELayer sets it), flushed by the
        # backward of the dispatch all-to-all (or of the permutation where there is none).
        self.wgrad_store = None
        self.ep_bwd_group = self.ep_group
        if getattr(config, "overlap_moe_expert_parallel_comm", False) and self.ep_size > 1:
            self.ep_bwd_group = backward_twin_group(self.ep_group)

    def _unpermute_probs(self):
        return None if self.probs_to_experts else self.permuted_probs

    def _release_probs(self):
        """Drop the micro-batch's routing probabilities once combined. Held on, they keep the step's autograd
        graph alive into the next step, and with it the AccumulateGrad nodes of every parameter before
        them: a CUDA graph capture would then reuse nodes made during the eager warm-up."""
        self.permuted_probs = self.expert_probs = None

    def _exact_topk(self, local_experts_only: bool = False):
        """k when every token gets exactly k rows from the permutation (the map holds all experts and no
        token is dropped or padded), else None."""
        c = self.config
        if local_experts_only or c.moe_expert_capacity_factor is not None or c.moe_pad_expert_input_to_capacity:
            return None
        return self.topk

    def _num_out_tokens(self, num_tokens: int):
        """Rows after permutation when known without reading the map: T * k with no dropping, E * capacity
        when padded to capacity; None (count on the host) when tokens may be dropped."""
        c = self.config
        if c.moe_expert_capacity_factor is None:
            return num_tokens * self.topk
        if c.moe_pad_expert_input_to_capacity:
            cap = min(get_capacity(num_tokens * self.topk, self.num_experts, c.moe_expert_capacity_factor),
                      num_tokens)
            return cap * self.num_experts
        return None


class _LocalExpertsDispatcher(MoETokenDispatcher):
    """A dispatcher for the local experts ``local_expert_indices`` (contiguous global expert ids)."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config, pg_collection=None):
        super().__init__(config, pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)


class MoEAllGatherTokenDispatcher(_LocalExpertsDispatcher):
    def token_permutation(self, hidden_states, probs, routing_map):
        """hidden [s, b, h] -> (tokens for the local experts grouped by expert [N, h], tokens_per_expert)."""
        self.hidden_shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_shape[-1])
        if self.tp_ep_size > 1:
            x = gather_from_sequence_parallel_region(x, group=self.tp_ep_group)  # [T * tp_ep, h]
            probs = gather_from_sequence_parallel_region(probs, group=self.tp_ep_group)
            routing_map = _gather_along_first_dim(routing_map.to(torch.uint8), self.tp_ep_group).bool()
        self.gathered_shape = x.shape
        lo, hi = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        local_map = routing_map[:, lo:hi]
        num_out = None
        if self.num_local_experts == self.num_experts:
            num_out = self._num_out_tokens(x.shape[0])
        self.exact_topk = self._exact_topk(self.num_local_experts != self.num_experts)
        permuted, self.permuted_probs, self.sorted_indices = self._permute(
            x, local_map, probs[:, lo:hi], num_out_tokens=num_out, topk=self.exact_topk)
        self.expert_probs = self.permuted_probs
        return flush_wgrad_on_backward(permuted, self.wgrad_store), local_map.sum(dim=0)

    def token_unpermutation(self, expert_output, bias=None):
        out = self._unpermute(expert_output, self.sorted_indices, self.gathered_shape,
                              probs=self._unpermute_probs(), topk=self.exact_topk)
        self._release_probs()
        if self.tp_ep_size > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, group=self.tp_ep_group)  # sum over EP x ETP
        return out.view(self.hidden_shape), None


class MoEAlltoAllTokenDispatcher(_LocalExpertsDispatcher):
    def _start_counts(self, routing_map):
        """Launch the gather of C[u][j][e] (tokens that the rank at expert-TP u, EP j routes to expert e) and
        its copy to the host (non-blocking on CUDA: pinned memory and an event), so the host can queue more
        GPU work before it must read them (`_read_counts`, the one host read per layer). Returns (host copy,
        its event or None, the counts on the device)."""
        counts = routing_map.sum(dim=0).to(torch.int64)  # [E]
        if self.ep_size > 1:
            out = counts.new_empty(self.ep_size * self.num_experts)
            with forward_turn():
                dist.all_gather_into_tensor(out, counts, group=self.ep_group)
            counts = out
        if self.etp_size > 1:
            out = counts.new_empty(self.etp_size * counts.numel())
            with forward_turn():
                dist.all_gather_into_tensor(out, counts, group=self.etp_group)
            counts = out
        if not counts.is_cuda:
            return counts, None, counts
        # One pinned buffer per host thread, allocated once: a pinned allocation synchronises the device,
        # which under --overlap-moe-expert-parallel-comm would wait on the other thread's all-to-all.
        buffers = self.__dict__.setdefault("_count_buffers", {})  # (host thread, size) -> pinned copy
        key = (threading.get_ident(), counts.numel())
        host = buffers.get(key)
        if host is None:
            host = buffers[key] = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event, counts

    def _static_counts(self, num_tokens: int):
        """C[u][j][e] without communication when the router pads every expert to capacity
        (--moe-pad-expert-input-to-capacity): each rank sends each expert exactly its capacity, which depends
        only on the rank's token count, the same on every rank of the EP group (as Megatron's drop-and-pad
        all-to-all assumes, with its equal splits). None when the counts must be exchanged and read."""
        c = self.config
        if not c.moe_pad_expert_input_to_capacity or c.moe_expert_capacity_factor is None:
            return None
        cap = self._num_out_tokens(num_tokens) // self.num_experts
        return [[[cap] * self.num_experts for _ in range(self.ep_size)] for _ in range(self.etp_size)]

    def _read_counts(self, pending) -> List:
        host, event, _ = pending
        if event is not None:
            event.synchronize()
        return host.view(self.etp_size, self.ep_size, self.num_experts).tolist()

    def token_permutation(self, hidden_states, probs, routing_map):
        self.hidden_shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_shape[-1])
        self.local_only = self.ep_size * self.etp_size == 1
        self.exact_topk = self._exact_topk()
        if self.local_only:  # every expert is here: no exchange, and no host read of the counts
            permuted, self.permuted_probs, self.sorted_indices = self._permute(
                x, routing_map, probs, num_out_tokens=self._num_out_tokens(x.shape[0]), topk=self.exact_topk)
            self.expert_probs = self.permuted_probs
            return flush_wgrad_on_backward(permuted, self.wgrad_store), routing_map.sum(dim=0)
        t, m, El, ep = self.etp_rank, self.ep_rank, self.num_local_experts, self.ep_size
        C = self._static_counts(x.shape[0])
        static = C is not None
        pending = None if static else self._start_counts(routing_map)
        if static:  # padded to capacity: every count is known, nothing travels or is read
            mine = C[t][m]
            permuted, self.permuted_probs, self.sorted_indices = self._permute(
                x, routing_map, probs, num_out_tokens=sum(mine), topk=self.exact_topk)
        elif self.exact_topk is not None:
            # Without dropping the permutation's size is T * k: queue it before the host waits for the
            # counts, so the GPU permutes while the counts travel (the wait no longer idles the GPU).
            permuted, self.permuted_probs, self.sorted_indices = self._permute(
                x, routing_map, probs, num_out_tokens=x.shape[0] * self.topk, topk=self.exact_topk)
            C = self._read_counts(pending)
            mine = C[t][m]
        else:
            C = self._read_counts(pending)
            mine = C[t][m]
            permuted, self.permuted_probs, self.sorted_indices = self._permute(
                x, routing_map, probs, num_out_tokens=sum(mine), topk=self.exact_topk)
        self.input_splits = [sum(mine[j * El:(j + 1) * El]) for j in range(ep)]
        self.output_splits = [sum(C[t][j][m * El:(m + 1) * El]) for j in range(ep)]
        self.etp_sizes = [sum(sum(C[u][j][m * El:(m + 1) * El]) for j in range(ep)) for u in range(self.etp_size)]
        # Regroup the chunks expert-major: [l][u][j].
        self.chunk_sizes = [C[u][j][m * El + l] for u in range(self.etp_size) for j in range(ep) for l in range(El)]
        self.sorted_idxs = [(u * ep + j) * El + l for l in range(El) for u in range(self.etp_size) for j in range(ep)]
        self.chunk_gather = None
        if El > 1:
            self.chunk_gather = self._chunk_gather(None if static else pending[2], x.device)
        y = self._to_experts(permuted, self.wgrad_store)
        self.expert_probs = None
        if self.probs_to_experts and self.permuted_probs is not None:
            self.expert_probs = self._to_experts(self.permuted_probs)  # the rows' probs travel with them
        tokens_per_expert = [sum(C[u][j][m * El + l] for u in range(self.etp_size) for j in range(ep))
                             for l in range(El)]
        if static:  # the same every step: one device copy, made outside any CUDA-graph capture (warm-up)
            key = (tuple(tokens_per_expert), y.device)
            cached = self.__dict__.setdefault("_static_tokens_per_expert", {})
            if key not in cached:
                cached[key] = torch.tensor(tokens_per_expert, dtype=torch.int64, device=y.device)
            return y, cached[key]
        return y, torch.tensor(tokens_per_expert, dtype=torch.int64)

    def _chunk_gather(self, counts, device):
        """(gather, inverse) row indices that regroup the received chunks [u][j][l] expert-major (``chunk_sort_
        indices``), from the device copy of the counts (``counts``, [etp * ep * E]) so nothing waits on the
        host, or, padded to capacity (``counts`` None), from the static sizes, made once per shape."""
        cache = self.__dict__.setdefault("_chunk_index_cache", {})
        key = ("order", self.num_local_experts, self.ep_size, self.etp_size, device)  # sorted_idxs' inputs
        if key not in cache:
            cache[key] = torch.tensor(self.sorted_idxs, dtype=torch.int64, device=device)
        order = cache[key]
        total = sum(self.chunk_sizes)
        if counts is None:
            key = ("static", tuple(self.chunk_sizes), device)
            if key not in cache:
                sizes = torch.tensor(self.chunk_sizes, dtype=torch.int64, device=device)
                cache[key] = chunk_sort_indices(sizes, order, total)
            return cache[key]
        El, m = self.num_local_experts, self.ep_rank
        sizes = counts.view(self.etp_size, self.ep_size, self.num_experts)[:, :, m * El:(m + 1) * El].reshape(-1)
        return chunk_sort_indices(sizes, order, total)

    def _to_experts(self, rows, wgrad_store=None):
        """This rank's permuted rows (or their probs) -> the local experts' rows, expert-major. The rows'
        exchange (not the probs') flushes ``wgrad_store`` in its backward: it comes after the experts'."""
        y = _ExpertAllToAll.apply(rows, self.ep_group, self.ep_bwd_group, self.output_splits, self.input_splits,
                                  wgrad_store)  # chunks [ep j][l]
        if self.etp_size > 1:
            y = _GatherV.apply(y, self.etp_group, self.etp_sizes)  # chunks [etp u][ep j][l]
        if self.num_local_experts > 1:
            y = _PermuteRows.apply(y, *self.chunk_gather)
        return y

    def token_unpermutation(self, expert_output, bias=None):
        y = expert_output
        if self.local_only:
            pass
        elif self.num_local_experts > 1:
            gather, inverse = self.chunk_gather
            y = _PermuteRows.apply(y, inverse, gather)  # back to [u][j][l]
        if self.etp_size > 1:
            y = _ReduceScatterV.apply(y, self.etp_group, self.etp_sizes)  # sum the expert-TP partials
        if not self.local_only:
            y = _ExpertAllToAll.apply(y, self.ep_group, self.ep_bwd_group, self.input_splits, self.output_splits,
                                      None)
        num_tokens = self.hidden_shape.numel() // self.hidden_shape[-1]
        out = self._unpermute(y, self.sorted_indices, (num_tokens, self.hidden_shape[-1]),
                              probs=self._unpermute_probs(), topk=self.exact_topk)
        self._release_probs()
        return out.view(self.hidden_shape), None
