"""--use-checkpoint-args: take the model's architecture flags from the checkpoint under --load.

Runs before argument validation (no process groups yet): the tracker and the saved `args` are read
directly from disk, like Megatron's `load_args_from_checkpoint`.
"""
import os

import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import CheckpointingException
from megatron.training.arguments.errors import ArgumentError

from . import paths

# (name, force): forced flags always take the checkpoint's value (their defaults are not None, so a
# user value cannot be told apart); the others only fill flags the user left unset (None).
MODEL_ARGS = [("num_layers", False), ("hidden_size", False), ("ffn_hidden_size", False),
              ("seq_length", False), ("num_attention_heads", False), ("kv_channels", False),
              ("max_position_embeddings", False), ("vocab_size", False), ("tokenizer_type", True),
              ("padded_vocab_size", True), ("make_vocab_size_divisible_by", True),
              ("group_query_attention", True), ("num_query_groups", True),
              ("position_embedding_type", True), ("add_position_embedding", True),
              ("use_rotary_position_embeddings", True), ("rotary_percent", True), ("rotary_base", True),
              ("normalization", True), ("norm_epsilon", True), ("apply_layernorm_1p", True),
              ("swiglu", True), ("squared_relu", True), ("quick_geglu", True), ("glu_linear_offset", True),
              ("activation_func_clamp_value", True), ("untie_embeddings_and_output_weights", True),
              ("add_bias_linear", True), ("add_qkv_bias", True), ("qk_layernorm", True),
              ("attention_output_gate", True),
              ("use_rope_scaling", True), ("rope_scaling_factor", True), ("openai_gelu", True),
              ("window_size", False), ("window_attn_skip_freq", False),
              ("softmax_type", True), ("mrope_section", False),
              # MoE: experts, layer pattern, router semantics and the expert layout (the checkpoint's tensor names)
              ("num_experts", False), ("moe_ffn_hidden_size", False), ("moe_layer_freq", True),
              ("moe_router_topk", True), ("moe_router_pre_softmax", True), ("moe_router_score_function", True),
              ("moe_router_topk_scaling_factor", False), ("moe_router_enable_expert_bias", True),
              ("moe_router_num_groups", False), ("moe_router_group_topk", False),
              ("moe_shared_expert_intermediate_size", False), ("moe_shared_expert_gate", True),
              ("moe_grouped_gemm", True),
              # pretrain_vlm.py: the ViT, projector and image token (absent from other checkpoints: skipped)
              ("img_h", True), ("img_w", True), ("patch_dim", True), ("encoder_num_layers", False),
              ("vision_model_type", True), ("vision_hidden_size", False), ("vision_ffn_hidden_size", False),
              ("vision_num_attention_heads", False), ("vision_projection_type", True),
              ("vision_projection_ffn_hidden_size", False), ("disable_vision_class_token", True),
              ("image_token_index", True), ("spatial_merge_size", True), ("temporal_patch_size", True),
              ("vision_window_size", True), ("vision_full_attention_layers", True),
              # hybrid models: the layer pattern and the Mamba-2 / Gated DeltaNet shapes
              ("is_hybrid_model", True), ("hybrid_layer_pattern", False), ("mamba_state_dim", True),
              ("mamba_head_dim", True), ("mamba_num_groups", True), ("mamba_num_heads", False),
              ("linear_num_key_heads", True), ("linear_num_value_heads", True), ("linear_key_head_dim", True),
              ("linear_value_head_dim", True), ("linear_conv_kernel_dim", True),
              ("experimental_attention_variant", False), ("linear_attention_freq", False),
              ("moe_latent_size", False)]


def _legacy_file(checkpoint_dir: str) -> str:
    names = sorted(n for n in os.listdir(checkpoint_dir) if n.startswith("mp_rank_"))
    return os.path.join(checkpoint_dir, names[0], paths.LEGACY_FNAME)


def has_checkpoint(load_dir: str) -> bool:
    """True when ``load_dir`` has a tracker file (a checkpoint was saved there)."""
    return os.path.isfile(paths.get_checkpoint_tracker_filename(load_dir))


def read_checkpoint_args(load_dir: str, ckpt_step=None):
    """(saved args, iteration) of the latest (or ``ckpt_step``) checkpoint under ``load_dir``."""
    tracker = paths.get_checkpoint_tracker_filename(load_dir)
    if ckpt_step is not None:
        iteration, release = ckpt_step, False
    elif os.path.isfile(tracker):
        iteration, release = paths.read_metadata(tracker)
    else:
        raise ArgumentError(f"--use-checkpoint-args: no checkpoint tracker {tracker}; pass --load with a "
                         f"checkpoint or drop --use-checkpoint-args")
    checkpoint_dir = paths.get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    fmt = paths.detect_format(checkpoint_dir)
    if fmt == "torch_dist":
        state = dist_checkpointing.load_common_state_dict(checkpoint_dir)  # resolved on use: DCP imports late
    elif fmt == "torch":
        path = _legacy_file(checkpoint_dir)
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:
            raise CheckpointingException(f"corrupted checkpoint file {path}: {type(e).__name__}: {e}") from e
    else:
        raise ArgumentError(f"--use-checkpoint-args: {checkpoint_dir} holds no complete checkpoint")
    if state.get("args") is None:
        raise ArgumentError(f"--use-checkpoint-args: checkpoint {checkpoint_dir} has no saved args")
    return state["args"], iteration


def load_args_from_checkpoint(args, load_arg: str = "load"):
    """Overwrite ``args``' architecture flags with the checkpoint's; returns ``args``."""
    load_dir = getattr(args, load_arg, None)
    if not load_dir:
        raise ArgumentError("--use-checkpoint-args needs --load DIR or --pretrained-checkpoint DIR")
    ckpt_args, _ = read_checkpoint_args(load_dir, args.ckpt_step)
    for name, force in MODEL_ARGS:
        if not hasattr(ckpt_args, name):
            continue
        if force or getattr(args, name, None) is None:
            setattr(args, name, getattr(ckpt_args, name))
    return args
