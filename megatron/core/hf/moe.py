"""Routed experts between Hugging Face and ours, shared by the MoE families (Mixtral, Qwen3-MoE, DeepSeek-V3).

HF stores each expert as a small gated MLP (gate / up / down, names differ per family). Ours, per
expert implementation:
- SequentialMLP (default): ``mlp.experts.local_experts.{e}.linear_fc1.weight`` = [gate_e; up_e] [2f, h] and
  ``...linear_fc2.weight`` = down_e [h, f], like a dense MLP;
- GroupedMLP (``--moe-grouped-gemm``): ``mlp.experts.weight1`` [E, 2, f, h] (expert e's [gate_e; up_e] rows
  as [2, f, h], the torch_dist layout of a strided fc1) and ``mlp.experts.weight2`` [E, h, f].
torch_dist keys hold all E experts (the global index), so either checkpoint loads under any EP layout.
The families write SequentialMLP rules; ``group_experts`` turns them into GroupedMLP rules.

Routing (ours is Megatron's ``topk_routing_with_score_function``, softmax scores):
- HF softmax over all E, top-k, renormalised (Mixtral; Qwen3-MoE ``norm_topk_prob=true``) equals a
  softmax over the k largest logits: Megatron's default;
- softmax over all E, top-k, not renormalised (Qwen3-MoE ``norm_topk_prob=false``): ``--moe-router-pre-softmax``.
"""
import re
from typing import List

import torch

from megatron.core.transformer.moe.moe_utils import moe_layer_pattern

from .family import Rule
from .layout import GATE_UP, Transform

_EXPERT = re.compile(r"(.*\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED = {"linear_fc1": "weight1", "linear_fc2": "weight2"}


def mlp_rules(ours: str, gate: str, up: str, down: str) -> List[Rule]:
    """A gated MLP (dense or one expert): fc1 = [gate; up] (stored [2, f, h] in torch_dist), fc2 = down."""
    return [Rule(ours + "linear_fc1.weight", (gate, up), GATE_UP, stride=2), Rule(ours + "linear_fc2.weight", (down,))]


def routed_rules(num_experts: int, hf_expert: str, names=("gate_proj", "up_proj", "down_proj")) -> List[Rule]:
    """Router-less expert rules under ``mlp.``; ``hf_expert`` holds ``{e}``, e.g. ``mlp.experts.{e}.``."""
    rules = []
    for e in range(num_experts):
        hf = hf_expert.format(e=e)
        rules += mlp_rules(f"mlp.experts.local_experts.{e}.", *(f"{hf}{n}.weight" for n in names))
    return rules


def in_layer(rules: List[Rule]) -> List[Rule]:
    """Layer-relative rules -> rules under ``decoder.layers.{i}.`` / ``model.layers.{i}.``."""
    return [Rule("decoder.layers.{i}." + r.ours, tuple("model.layers.{i}." + n for n in r.hf), r.transform, r.stride)
            for r in rules]


def group_experts(rules: List[Rule]) -> List[Rule]:
    """SequentialMLP expert rules -> one GroupedMLP rule per fc (in the place of expert 0's)."""
    out, groups = [], {}
    for r in rules:
        m = _EXPERT.match(r.ours)
        if m is None:
            out.append(r)
            continue
        key = (m.group(1), m.group(3))
        if key not in groups:
            groups[key] = []
            out.append(key)
        assert int(m.group(2)) == len(groups[key]), f"experts out of order at {r.ours}"
        groups[key].append(r)
    return [x if isinstance(x, Rule) else _stacked(x[0] + _GROUPED[x[1]], groups[x]) for x in out]


def _stacked(name: str, rules: List[Rule]) -> Rule:
    """E per-expert rules -> one [E, ...] tensor; a strided fc1 [2f, h] becomes [2, f, h] per expert."""
    inner, per, split = rules[0].transform, len(rules[0].hf), rules[0].stride

    def to_ours(ts, d):
        t = torch.stack([inner.to_ours(list(ts[e * per:(e + 1) * per]), d) for e in range(len(rules))])
        return t.reshape(t.shape[0], split, t.shape[1] // split, *t.shape[2:]) if split > 1 else t  # [E, (2,) f, h]

    def to_hf(t, d):
        return [x for expert in t for x in inner.to_hf(expert.reshape(-1, t.shape[-1]), d)]
    return Rule(name, tuple(n for r in rules for n in r.hf), Transform(to_ours, to_hf))


def expected_shape(name: str, experts: int, moe_ffn: int, hidden: int, glu: bool):
    """Global shape of a router or expert tensor (None: not one)."""
    g = 2 if glu else 1
    table = {"router.weight": (experts, hidden), "experts.weight1": (experts, g, moe_ffn, hidden) if glu else
             (experts, moe_ffn, hidden), "experts.weight2": (experts, hidden, moe_ffn)}
    for suffix, shape in table.items():
        if name.endswith(suffix):
            return shape
    if ".local_experts." in name:
        return (g * moe_ffn, hidden) if name.endswith("linear_fc1.weight") else (hidden, moe_ffn)
    return None


def moe_flags(num_experts: int, topk: int, moe_ffn: int, pattern: List[int], pre_softmax: bool,
              aux_loss_coeff: float = 0.0):
    """Flags of a softmax-routed MoE without shared experts; ``pattern``: 1 per MoE layer, 0 per dense one."""
    flags = [("--num-experts", num_experts), ("--moe-ffn-hidden-size", moe_ffn), ("--moe-router-topk", topk)]
    if not all(pattern):
        flags.append(("--moe-layer-freq", "[" + ",".join(str(p) for p in pattern) + "]"))
    if pre_softmax:
        flags.append(("--moe-router-pre-softmax", None))
    if aux_loss_coeff:  # training only: HF's router_aux_loss_coef with Megatron's Switch loss
        flags += [("--moe-router-load-balancing-type", "aux_loss"), ("--moe-aux-loss-coeff", float(aux_loss_coeff))]
    return flags


def softmax_router_args(args, family: str) -> List[int]:
    """The MoE layer pattern of a checkpoint exported as ``family``; one line for what it cannot hold."""
    def refuse(what):
        raise ValueError(f"{what} has no {family} counterpart; export this checkpoint as another family")
    if not getattr(args, "num_experts", None):
        refuse("a dense checkpoint (no --num-experts)")
    if args.moe_router_score_function != "softmax":
        refuse(f"--moe-router-score-function {args.moe_router_score_function}")
    if args.moe_router_enable_expert_bias or args.moe_router_num_groups or args.moe_shared_expert_intermediate_size:
        refuse("--moe-router-enable-expert-bias / --moe-router-num-groups / shared experts")
    if args.moe_router_topk_scaling_factor not in (None, 1.0):
        refuse(f"--moe-router-topk-scaling-factor {args.moe_router_topk_scaling_factor}")
    return moe_layer_pattern(args.moe_layer_freq, args.num_layers)


def aux_loss_coeff(args) -> float:
    coeff = args.moe_aux_loss_coeff
    coeff = coeff[0] if isinstance(coeff, (list, tuple)) else coeff
    return float(coeff or 0.0)
