"""Megatron-LM's default distributed-optimizer checkpoint format, ``dp_reshardable``, read into our per-param state.

Megatron saves each gradient buffer bucket's flat optimizer state (``param`` = fp32 main param, ``exp_avg``,
``exp_avg_sq``) as one 1-D tensor ``optimizer.distributed.dp_group_idx_<mp rank>.gbuf_idx_<g>.dtype_<dtypes>.
bucket_idx_<b>.<name>`` of the bucket's unpadded size, its param groups as the object ``...optimizer`` and the
bucket sizes as ``...per_bucket_numel_unpadded``. A bucket holds its params in reverse registration order
(Megatron's ``named_parameters`` of the model chunk, trainable only: `megatron_param_order`), each starting at a
multiple of 64 elements; the saved bucket sizes give the boundaries (by ``--ddp-bucket-size``, or a new bucket for
a shared embedding), so the layout does not depend on the DP size. Every rank reads its model-parallel rank's flat
tensors whole and slices them. The slices' main params must equal the loaded weights (rounded to their dtype):
a layout that does not line up fails with one line instead of loading wrong state.
"""
from typing import Dict, List, Tuple

import torch

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

SHARDING_TYPE = "dp_reshardable"
_ALIGN = 64  # Megatron's pad_param_start
_HINT = "resume with --no-load-optim, or re-save it from Megatron-LM with --dist-ckpt-optim-fully-reshardable"


def _prefix(group_idx: int) -> str:
    return f"optimizer.distributed.dp_group_idx_{group_idx}."


def request(tensors_metadata: Dict[str, ShardedTensor], object_keys, group_idx: int, checkpoint_dir: str) -> Dict:
    """The sharded entries that read model-parallel rank ``group_idx``'s flat buckets whole, its param groups and
    bucket sizes (and loss scaler, when saved). ``object_keys``: the checkpoint's object keys."""
    prefix = _prefix(group_idx)
    flats = {k[len(prefix):]: ShardedTensor.from_rank_offsets(k, torch.empty(md.global_shape, dtype=md.dtype))
             for k, md in tensors_metadata.items() if k.startswith(prefix + "gbuf_idx_")}
    if not flats:
        raise ValueError(f"checkpoint {checkpoint_dir}: no dp_reshardable optimizer buffers for model-parallel rank "
                         f"{group_idx} ({prefix}gbuf_idx_*); {_HINT}")
    out = {"flat": flats}
    for name in ("optimizer", "per_bucket_numel_unpadded", "grad_scaler"):
        if prefix + name in object_keys:
            out[name] = ShardedObject(prefix + name, None, (1,), (0,))
    return out


def bucket_offsets(numels: List[Tuple[str, int]], bucket_sizes: List[int]) -> Dict[str, Tuple[int, int, int]]:
    """{key: (bucket, start, end)} for params ``numels`` in Megatron's buffer order (reverse registration), given
    the buffer's unpadded bucket sizes. Offsets are bucket-relative (a bucket starts at a multiple of 64)."""
    out, bucket, pos = {}, 0, 0
    for key, numel in numels:
        pos = -(-pos // _ALIGN) * _ALIGN
        if bucket < len(bucket_sizes) and pos >= bucket_sizes[bucket] and pos > 0:
            bucket, pos = bucket + 1, 0  # a bucket closed before this param (a shared embedding's own bucket)
        if bucket >= len(bucket_sizes) or pos + numel > bucket_sizes[bucket]:
            raise ValueError(f"the dp_reshardable buckets (unpadded sizes {bucket_sizes}) do not hold this model's "
                             f"parameters in Megatron's order (at '{key}', {numel} elements); {_HINT}")
        out[key] = (bucket, pos, pos + numel)
        pos += numel
        if pos == bucket_sizes[bucket]:
            bucket, pos = bucket + 1, 0
    if bucket != len(bucket_sizes):
        raise ValueError(f"the dp_reshardable buckets (unpadded sizes {bucket_sizes}) hold more than this model's "
                         f"parameters; {_HINT}")
    return out


def megatron_param_order(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """``module``'s trainable params in Megatron's registration order (its ``named_parameters``): ours, except
    that Megatron's attention builds core attention and ``linear_proj`` before its input projections."""
    out, seen = [], set()

    def visit(m):
        for p in m.parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        children = list(m.named_children())
        if hasattr(m, "linear_proj") and hasattr(m, "core_attention"):
            first = [c for c in children if c[0] in ("core_attention", "linear_proj")]
            children = first + [c for c in children if c not in first]
        for _, child in children:
            visit(child)

    visit(module)
    return out


def _buckets(flats: Dict[str, ShardedTensor], gbuf: int) -> Dict[int, Dict[str, torch.Tensor]]:
    """{bucket index: {state name: flat tensor}} of gradient buffer ``gbuf``."""
    out = {}
    for key, st in flats.items():
        head, _, name = key.rpartition(".")
        g = int(head.split(".", 1)[0][len("gbuf_idx_"):])
        if g == gbuf:
            out.setdefault(int(head.rpartition(".bucket_idx_")[2]), {})[name] = st
    return out


def to_our_state(loaded: Dict, our_request: Dict, key_to_param: Dict, model_chunks, megatron_names: Dict):
    """(our optimizer state's param_state, {key: fp32 main param}) from the loaded ``request`` entries.
    ``our_request``: our optimizer's sharded state dict (its param_state names the states to fill);
    ``key_to_param``: our sharded key of each optimizer param; ``model_chunks``: the unwrapped model chunks, one
    gradient buffer each; ``megatron_names``: our state name -> Megatron's, where they differ."""
    sizes = loaded.get("per_bucket_numel_unpadded")
    if sizes is None or len(sizes) != len(model_chunks) or any(len(s) != 1 for s in sizes):
        raise ValueError(f"the dp_reshardable optimizer state has {len(sizes or [])} gradient buffers of bucket "
                         f"sizes {sizes}; only one dense buffer per model chunk (one parameter dtype, no experts) "
                         f"is read here; {_HINT}")
    param_to_key = {id(p): k for k, p in key_to_param.items()}
    param_state, main = {}, {}
    for gbuf, chunk in enumerate(model_chunks):
        params = [p for p in megatron_param_order(chunk) if id(p) in param_to_key]
        order = [(param_to_key[id(p)], p.numel()) for p in reversed(params)]
        offsets = bucket_offsets(order, list(sizes[gbuf].values())[0])
        buckets = _buckets(loaded["flat"], gbuf)
        for key, (b, start, end) in offsets.items():
            param = key_to_param[key]
            flat = buckets.get(b, {})
            entry = {}
            for name, wanted in our_request["param_state"][key].items():
                theirs = megatron_names.get(name, name)
                if theirs not in flat:
                    raise ValueError(f"the dp_reshardable optimizer state has no '{theirs}' (it has {sorted(flat)});"
                                     f" {_HINT}")
                dtype = getattr(wanted, "dtype", None) or param.dtype
                entry[name] = flat[theirs][start:end].view(param.shape).to(dtype).clone()
            param_state[key] = entry
            if "param" in flat:
                main[key] = flat["param"][start:end].view(param.shape)
    return param_state, main


def check_main_params(main: Dict[str, torch.Tensor], key_to_param: Dict, checkpoint_dir: str) -> None:
    """One line when a reconstructed fp32 main param is not its loaded weight (rounded to the weight's dtype)."""
    for key, tensor in main.items():
        weight = key_to_param[key].detach()
        if not torch.equal(tensor.to(weight.dtype), weight.to(tensor.device)):
            raise ValueError(f"checkpoint {checkpoint_dir}: the dp_reshardable optimizer state does not line up with "
                             f"this model's parameters (the main param read for '{key}' is not its saved weight: "
                             f"a different parameter order or bucket layout); {_HINT}")
