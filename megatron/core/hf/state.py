"""Stream a model family's tensors between the HF layout and our global (TP=PP=1) state dict."""
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, Iterator, List, Tuple

import torch

from .dist_io import LazyTensor
from .family import Family, Rule
from .layout import Dims
from .moe import expected_shape as expert_shape
from .moe import group_experts


@dataclass(frozen=True)
class Shapes:
    """Global tensor shapes implied by the flags (used to reject weights that do not match config.json)."""
    layers: int
    hidden: int
    ffn: int
    glu: bool
    positions: int
    dims: Dims
    experts: int = 0
    moe_ffn: int = 0
    grouped_experts: bool = False  # --moe-grouped-gemm: GroupedMLP's stacked [E, ...] expert tensors


def shapes_from_flags(flags: List[Tuple[str, object]], vocab_size: int, padded_vocab_size: int) -> Shapes:
    f = dict(flags)
    heads = int(f["--num-attention-heads"])
    hidden = int(f["--hidden-size"])
    dims = Dims(heads, int(f.get("--num-query-groups", heads)), int(f.get("--kv-channels", hidden // heads)),
                vocab_size, padded_vocab_size)
    ffn = int(f["--ffn-hidden-size"])
    return Shapes(int(f["--num-layers"]), hidden, ffn, "--swiglu" in f, int(f["--max-position-embeddings"]), dims,
                  int(f.get("--num-experts") or 0), int(f.get("--moe-ffn-hidden-size", ffn)), "--moe-grouped-gemm" in f)


def expected_shape(name: str, s: Shapes) -> Tuple[int, ...]:
    d = s.dims
    qkv = (d.num_heads + 2 * d.num_groups) * d.head_dim
    table = {"word_embeddings.weight": (d.padded_vocab_size, s.hidden),
             "output_layer.weight": (d.padded_vocab_size, s.hidden),
             "position_embeddings.weight": (s.positions, s.hidden), "linear_qkv.weight": (qkv, s.hidden),
             "linear_qkv.bias": (qkv,), "linear_proj.weight": (s.hidden, d.num_heads * d.head_dim),
             "linear_proj.bias": (s.hidden,), "linear_fc1.weight": ((2 if s.glu else 1) * s.ffn, s.hidden),
             "linear_fc1.bias": ((2 if s.glu else 1) * s.ffn,), "linear_fc2.weight": (s.hidden, s.ffn),
             "linear_fc2.bias": (s.hidden,), "q_layernorm.weight": (d.head_dim,), "k_layernorm.weight": (d.head_dim,)}
    for suffix, shape in table.items():
        if name.endswith(suffix):
            return shape
    return (s.hidden,)  # the norms


def _named_rules(family: Family, cfg: dict, shapes: Shapes) -> Iterator[Tuple[int, Rule, str, List[str]]]:
    """(layer or -1, rule, our name, HF names) in file order: embeddings, layers, final norm / head."""
    glob, layer = family.rules(cfg)
    first = [r for r in glob if r.ours.startswith("embedding.")]
    for r in first:
        yield -1, r, r.ours, list(r.hf)
    for i in range(shapes.layers):
        rules = [Rule(r.ours.format(i=i), tuple(n.format(i=i) for n in r.hf), r.transform, r.stride)
                 for r in (layer(i) if callable(layer) else layer)]
        for r in (group_experts(rules) if shapes.grouped_experts else rules):
            yield i, r, r.ours, list(r.hf)
    for r in glob:
        if r not in first:
            yield -1, r, r.ours, list(r.hf)


def _want(family: Family, cfg: dict, name: str, s: Shapes) -> Tuple[int, ...]:
    shape = expert_shape(name, s.experts, s.moe_ffn, s.hidden, s.glu) if s.experts else None
    if shape is not None:
        return shape
    if family.expected_shape:
        return family.expected_shape(name, cfg, s.hidden, s.dims.padded_vocab_size)
    return expected_shape(name, s)


def hf_to_ours(family: Family, cfg: dict, shapes: Shapes, reader, where: str) -> List[LazyTensor]:
    """(our global name, shape, dtype, stride, make) per tensor. Shapes are checked up front on meta
    tensors (header only); ``make()`` reads the HF tensors and builds ours when the writer needs it."""
    out = []
    for _, rule, name, hf_names in _named_rules(family, cfg, shapes):
        metas = [reader.meta(n) for n in hf_names]
        want = _want(family, cfg, name, shapes)
        try:
            result, detail = rule.transform.to_ours(metas, shapes.dims), ""
        except (RuntimeError, ValueError) as e:
            result, detail = None, str(e).splitlines()[0]
        if result is None or tuple(result.shape) != want:
            got = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(hf_names, metas))
            if len(hf_names) > 4:  # stacked experts: name the range and the shapes seen
                got = (f"{hf_names[0]} .. {hf_names[-1]} (shapes "
                       f"{', '.join(str(x) for x in sorted({tuple(t.shape) for t in metas}))})")
            raise ValueError(
                f"{where}: {got} do not match config.json (expected {name} of shape {want}) {detail}".strip())
        make = partial(_make, rule.transform, hf_names, reader.get, shapes.dims)
        out.append((name, want, result.dtype, rule.stride, make))
    return out


def _make(transform, hf_names, get, dims):
    return transform.to_ours([get(n) for n in hf_names], dims)


def ours_to_hf(family: Family, cfg: dict, shapes: Shapes,
               get_layer: Callable[[List[Tuple[str, int]]], Dict[str, torch.Tensor]]
               ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor); ``get_layer([(name, stride)])`` reads one layer's (or the globals') tensors."""
    batches: Dict[int, list] = {}
    for i, rule, name, hf_names in _named_rules(family, cfg, shapes):
        batches.setdefault(i, []).append((rule, name, hf_names))
    for i in [-1] + list(range(shapes.layers)):
        items = batches.get(i, [])
        tensors = get_layer([(name, rule.stride) for rule, name, _ in items])
        # An HF tensor named by several rules (a fused projection we store part by part, e.g. Mamba's
        # in_proj [z; x; B; C; dt]) is joined from their outputs: each part comes as [groups, rows, ...] and
        # the HF tensor holds, group after group, every part's rows in rule order (groups = 1: plain
        # concatenation; Qwen3-Next's in_proj_qkvz interleaves [q; k; v; z] per key head).
        wanted = Counter(n for _, _, hf_names in items for n in hf_names)
        parts: Dict[str, List[torch.Tensor]] = {}
        for rule, name, hf_names in items:
            for hf_name, out in zip(hf_names, rule.transform.to_hf(tensors.pop(name), shapes.dims)):
                if wanted[hf_name] == 1:
                    yield hf_name, out
                    continue
                parts.setdefault(hf_name, []).append(out)
                if len(parts[hf_name]) == wanted[hf_name]:
                    joined = torch.cat(parts.pop(hf_name), dim=1)  # [groups, rows of all parts, ...]
                    yield hf_name, joined.reshape(-1, *joined.shape[2:])
