"""Mamba-2 mixers between Hugging Face and ours, shared by the Mamba2 and Nemotron-H families.

HF fuses ``mixer.in_proj.weight`` = [z; x; B; C; dt] rows and ``mixer.conv1d.weight/bias`` = [x; B; C] channels;
our torch_dist checkpoints (as Megatron's) store each part as its own tensor (``mixer.in_proj.weight.z`` ...), so
one HF tensor maps to several of ours: import slices it, export concatenates the parts in rule order
(state.py). Everything else (dt_bias, A_log, D, the gated norm, out_proj) is copied.

Megatron's mixer has no dt clamp (mamba-ssm's ``dt_limit=(0, inf)``), nor a configurable gated-norm epsilon
(1e-5); the config checks here refuse HF configs that ask otherwise.
"""
from typing import List

from .family import Rule, need
from .layout import Transform


def part_of(start: int, size: int, groups: int = 1) -> Transform:
    """Rows [start, start + size) of each of ``groups`` equal row blocks of one HF tensor (concatenated); on
    export the part as [groups, size, ...], which state.py joins with the other parts group by group."""
    def to_ours(ts, d):
        t = ts[0]
        return t.reshape(groups, -1, *t.shape[1:])[:, start:start + size].reshape(-1, *t.shape[1:])
    return Transform(to_ours, lambda t, d: [t.reshape(groups, -1, *t.shape[1:])])


def sections(num_heads: int, head_dim: int, groups: int, state: int):
    """(in_proj parts, conv parts) as [(name, rows)], in HF's and our order."""
    inner, gn = num_heads * head_dim, groups * state
    conv = [("x", inner), ("B", gn), ("C", gn)]
    return [("z", inner)] + conv + [("dt", num_heads)], conv


def mixer_rules(ours: str, hf: str, num_heads: int, head_dim: int, groups: int, state: int) -> List[Rule]:
    """Rules of one Mamba-2 mixer: ``ours`` / ``hf`` are the mixer prefixes (``...mixer.``)."""
    in_parts, conv_parts = sections(num_heads, head_dim, groups, state)
    rules = []
    for suffix, parts in (("in_proj.weight", in_parts), ("conv1d.weight", conv_parts), ("conv1d.bias", conv_parts)):
        start = 0
        for name, rows in parts:
            rules.append(Rule(f"{ours}{suffix}.{name}", (hf + suffix,), part_of(start, rows)))
            start += rows
    rules += [Rule(ours + n, (hf + n,)) for n in ("dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")]
    return rules


def mixer_shape(name: str, hidden: int, num_heads: int, head_dim: int, groups: int, state: int, conv: int):
    """Global shape of a mixer tensor of ours (None: not one)."""
    in_parts, conv_parts = sections(num_heads, head_dim, groups, state)
    for suffix, parts, extra in (("in_proj.weight.", in_parts, (hidden,)), ("conv1d.weight.", conv_parts, (1, conv)),
                                 ("conv1d.bias.", conv_parts, ())):
        for part, rows in parts:
            if name.endswith(".mixer." + suffix + part):
                return (rows,) + extra
    table = {"mixer.dt_bias": (num_heads,), "mixer.A_log": (num_heads,), "mixer.D": (num_heads,),
             "mixer.norm.weight": (num_heads * head_dim,), "mixer.out_proj.weight": (hidden, num_heads * head_dim)}
    for suffix, shape in table.items():
        if name.endswith(suffix):
            return shape
    return None


def check_mixer_config(cfg: dict, act_key: str, dt_limit) -> None:
    """Refuse what our Mamba-2 mixer (Megatron's) cannot reproduce."""
    need(cfg, cfg.get(act_key, "silu") == "silu", f"{act_key} {cfg.get(act_key)!r} (the Mamba mixer uses silu)")
    need(cfg, not cfg.get("use_bias", False), "use_bias=true (Mamba in_proj / out_proj biases)")
    need(cfg, cfg.get("use_conv_bias", True), "use_conv_bias=false")
    need(cfg, int(cfg.get("conv_kernel", 4)) == 4, f"conv_kernel {cfg.get('conv_kernel')} (only 4)")
    need(cfg, abs(float(cfg.get("layer_norm_epsilon", 1e-5)) - 1e-5) < 1e-12,
         f"layer_norm_epsilon {cfg.get('layer_norm_epsilon')} (the Mamba gated norm uses 1e-5, as Megatron's)")
    if dt_limit:
        low, high = (_number(x) for x in dt_limit)
        need(cfg, low == 0.0 and high == float("inf"), f"time_step_limit {list(dt_limit)} (Megatron's mixer does "
                                                       "not clamp dt)")


def _number(x) -> float:
    """A float from config.json; transformers writes infinity as {"__float__": "Infinity"}."""
    return float(x["__float__"]) if isinstance(x, dict) else float(x)


def mixer_flags(num_heads: int, head_dim: int, groups: int, state: int):
    return [("--mamba-num-heads", num_heads), ("--mamba-head-dim", head_dim), ("--mamba-num-groups", groups),
            ("--mamba-state-dim", state)]
