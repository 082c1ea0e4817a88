"""Mistral (MistralForCausalLM): Llama's tables plus sliding-window attention.

HF's window W lets query i see keys i-W+1 .. i (``kv_idx > q_idx - W``); ours is Megatron's
(left, right) pair, so W <-> ``--window-size W-1,0``. ``sliding_window: null`` means full attention.
"""
from . import llama
from .family import Family, need


def config_to_flags(cfg: dict):
    need(cfg, not cfg.get("attention_bias", False), "attention_bias=true")
    flags = llama.config_to_flags(cfg)
    window = cfg.get("sliding_window")
    if window is not None:
        flags.append(("--window-size", f"{int(window) - 1},0"))
    return flags


def args_to_config(args, vocab_size: int) -> dict:
    cfg = llama.args_to_config(args, vocab_size)
    window = getattr(args, "window_size", None)
    if window is not None and tuple(window)[1] != 0:
        raise ValueError(f"--window-size {window}: only causal windows (left, 0) have a Mistral counterpart")
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral",
               sliding_window=None if window is None else int(window[0]) + 1)
    for k in ("attention_bias", "mlp_bias"):
        cfg.pop(k)
    return cfg


FAMILY = Family("mistral", ("MistralForCausalLM",), rules=llama.rules, config_to_flags=config_to_flags,
                args_to_config=args_to_config)
