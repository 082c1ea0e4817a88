"""What a model family is to the converter: its name tables and its config.json <-> flags mapping.

A ``Rule`` maps one global (TP=PP=1) tensor of ours to the HF tensor(s) it is made of. Names may hold
``{i}`` (the layer index). Adding a family (or MoE experts: one more rule list with ``{e}``) is one table.
"""
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from .layout import COPY, Transform


@dataclass(frozen=True)
class Rule:
    ours: str
    hf: Tuple[str, ...]
    transform: Transform = COPY
    # torch_dist stores a stride-k tensor (gated fc1: [gate; up]) as [k, rows/k, ...]: see sharded_state.py
    stride: int = 1


@dataclass(frozen=True)
class Family:
    name: str
    architectures: Tuple[str, ...]
    # config -> (global rules, per-layer rules with {i}, or a function of the layer index returning them for
    # families whose layers differ, e.g. DeepSeek's dense then MoE layers)
    rules: Callable[[dict], Tuple[List[Rule], object]]
    config_to_flags: Callable[[dict], List[Tuple[str, object]]]  # config -> [(flag, value or None)]
    args_to_config: Callable[[object, int], Dict]  # (args, vocab_size) -> config.json fields
    # (our name, config, hidden, padded vocab) -> global shape, for names the common table does not know
    expected_shape: Optional[Callable] = None
    # config -> {HF name: tensor} that export writes besides the mapped ones (HF-only tensors ours lack)
    extra_hf_tensors: Optional[Callable] = None


class UnsupportedConfig(ValueError):
    """config.json asks for something our model cannot reproduce."""


def need(cfg: dict, cond: bool, what: str) -> None:
    if not cond:
        raise UnsupportedConfig(f"config.json: {what} is not supported by the converter")


def rope_theta(cfg: dict) -> float:
    """``rope_theta`` (transformers < 5) or ``rope_parameters.rope_theta`` (transformers >= 5)."""
    params = cfg.get("rope_parameters") or {}
    return cfg.get("rope_theta", params.get("rope_theta", 10000.0))


def rope_scaling(cfg: dict):
    """The rope scaling dict, or None for plain RoPE."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    return None if kind in (None, "default") else params


def head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
