"""Flags of the vision entry points (pretrain_vlm.py, pretrain_vision_classify.py) and the configs they build.

Megatron's names: --img-h, --img-w, --patch-dim, --num-channels, --encoder-num-layers (global flags in
Megatron), --freeze-LM, --freeze-ViT, --disable-vision-class-token, --dataloader-seq-length (its
pretrain_vlm.py), --vision-model-type, --use-tiling, --max-num-tiles, --use-thumbnail (its
examples/multimodal). Ours, because Megatron's pretrain_vlm.py copies the language model's sizes into
the ViT: --vision-hidden-size, --vision-ffn-hidden-size, --vision-num-attention-heads (default: the
language model's), --vision-projection-type / --vision-projection-ffn-hidden-size, --image-token-index,
the data flags of the built-in image-text loader, and Qwen2.5-VL's ViT shape (--vision-model-type
qwen2.5_vit): --spatial-merge-size, --temporal-patch-size, --vision-window-size,
--vision-full-attention-layers.
"""
import copy

import torch.nn.functional as F

from megatron.core.activations import fast_gelu, quick_gelu

DEFAULT_IMAGE_TOKEN_INDEX = -200  # Megatron's placeholder id; a HF-imported LLaVA uses its vocabulary id
# The ViT architecture of each --vision-model-type (Megatron's examples/multimodal/config.py): activation,
# norm epsilon, class tokens. qwen2.5_vit: Qwen2.5-VL's native-resolution ViT (RMSNorm, SwiGLU, 2-D RoPE,
# window attention) with its patch merger, and a decoder with --position-embedding-type mrope.
VISION_TYPES = {"clip": (quick_gelu, 1e-5, 1), "siglip": (fast_gelu, 1e-6, 0), "qwen2.5_vit": (F.silu, 1e-6, 0)}
QWEN_VIT = "qwen2.5_vit"
# Qwen2.5-VL's ViT flags (ours) and their defaults (the released models'); they apply to qwen2.5_vit only.
QWEN_VIT_DEFAULTS = {"spatial_merge_size": 2, "temporal_patch_size": 2, "vision_window_size": 112,
                     "vision_full_attention_layers": [7, 15, 23, 31]}


def _add_image_args(g):
    """Megatron's image flags, shared by pretrain_vlm.py and pretrain_vision_classify.py."""
    g.add_argument("--img-h", type=int, default=224, help="Image height in pixels (the ViT's position grid).")
    g.add_argument("--img-w", type=int, default=224, help="Image width in pixels.")
    g.add_argument("--patch-dim", type=int, default=16, help="Patch size (the patch conv's kernel and stride).")
    g.add_argument("--num-channels", type=int, default=3, help="Image channels.")


def add_vision_classify_args(parser):
    """pretrain_vision_classify.py's flags (Megatron's vision group): the image size, the classes, the
    image-folder data's fractions, and the bad-image policy."""
    g = parser.add_argument_group(title="vision")
    _add_image_args(g)
    g.add_argument("--num-classes", type=int, default=1000, help="Classes of the classification head.")
    g.add_argument("--classes-fraction", type=float, default=1.0,
                   help="Train on the first part of the sorted class folders.")
    g.add_argument("--data-per-class-fraction", type=float, default=1.0,
                   help="Train on the first part of each class folder's sorted images.")
    g.add_argument("--vision-backbone-type", default="vit", choices=["vit", "mit", "swin"],
                   help="Backbone of the classifier; vit (a CLIP-style ViT) is built here.")
    g.add_argument("--vision-pretraining-type", default="classify", choices=["classify", "inpaint", "dino"],
                   help="What pretrain_vision_classify.py trains; classify is built here.")
    g.add_argument("--skip-bad-samples", action="store_true", default=False,
                   help="Skip (and log once per file) unreadable images instead of stopping.")
    return parser


def add_vlm_args(parser):
    g = parser.add_argument_group(title="vision language model")
    _add_image_args(g)
    g.add_argument("--encoder-num-layers", type=int, default=None, help="ViT layers (default --num-layers).")
    g.add_argument("--vision-model-type", default="clip", choices=sorted(VISION_TYPES),
                   help="clip: class token, pre-norm, quick GeLU; siglip: no class token, post-norm, tanh GeLU; "
                        "qwen2.5_vit: Qwen2.5-VL's windowed native-resolution ViT and patch merger.")
    g.add_argument("--spatial-merge-size", type=int, default=QWEN_VIT_DEFAULTS["spatial_merge_size"],
                   help="qwen2.5_vit: neighbouring patches (m x m) merged into one language-model token.")
    g.add_argument("--temporal-patch-size", type=int, default=QWEN_VIT_DEFAULTS["temporal_patch_size"],
                   help="qwen2.5_vit: frames per patch (an image is repeated to fill them).")
    g.add_argument("--vision-window-size", type=int, default=QWEN_VIT_DEFAULTS["vision_window_size"],
                   help="qwen2.5_vit: side of the attention windows in pixels.")
    g.add_argument("--vision-full-attention-layers", type=int, nargs="*",
                   default=QWEN_VIT_DEFAULTS["vision_full_attention_layers"],
                   help="qwen2.5_vit: ViT layers (from 0) that attend over the whole image; the others attend "
                        "within windows.")
    g.add_argument("--vision-hidden-size", type=int, default=None, help="ViT width (default --hidden-size).")
    g.add_argument("--vision-ffn-hidden-size", type=int, default=None,
                   help="ViT MLP width (default 4 x the ViT width).")
    g.add_argument("--vision-num-attention-heads", type=int, default=None,
                   help="ViT attention heads (default --num-attention-heads).")
    g.add_argument("--vision-projection-type", default="mlp", choices=["mlp", "affine"],
                   help="Projector from ViT features to the language model: 2-layer GeLU MLP or one linear.")
    g.add_argument("--vision-projection-ffn-hidden-size", type=int, default=None,
                   help="Projector MLP width (default --hidden-size, LLaVA-1.5's).")
    g.add_argument("--disable-vision-class-token", action="store_true", default=False,
                   help="Drop the ViT's class token before the language model.")
    g.add_argument("--image-token-index", type=int, default=DEFAULT_IMAGE_TOKEN_INDEX,
                   help="Token id that marks an image in the text (the data path writes it for '<image>').")
    g.add_argument("--freeze-LM", action="store_true", default=False, help="Freeze the language model.")
    g.add_argument("--freeze-ViT", action="store_true", default=False, help="Freeze the vision model (ViT).")
    g.add_argument("--dataloader-seq-length", type=int, default=None,
                   help="Text tokens per sample (default --seq-length minus the image positions).")
    g.add_argument("--use-tiling", action="store_true", default=False,
                   help="Split each image into --img-h x --img-w tiles on a grid that keeps its aspect ratio.")
    g.add_argument("--max-num-tiles", type=int, default=1, help="Most tiles per image with --use-tiling.")
    g.add_argument("--use-thumbnail", action="store_true", default=False,
                   help="Add the whole image, resized, as one more tile with --use-tiling.")
    g.add_argument("--vlm-data-format", default="auto", choices=["auto", "jsonl", "energon"],
                   help="--data-path is a JSONL of image-text samples or a Megatron Energon dataset "
                        "(auto: Energon when the folder has .nv-meta).")
    g.add_argument("--skip-bad-samples", action="store_true", default=False,
                   help="Skip (and log once per sample) unreadable images and samples without their image "
                        "token instead of stopping.")
    return parser


def vision_config_from(language_config, args):
    """The ViT's TransformerConfig: the language config's parallel and precision settings, CLIP/SigLIP's
    architecture, the --vision-* sizes; kept whole on the first pipeline stage."""
    activation, eps, _ = VISION_TYPES[args.vision_model_type]
    qwen = args.vision_model_type == QWEN_VIT
    hidden = args.vision_hidden_size or language_config.hidden_size
    heads = args.vision_num_attention_heads or language_config.num_attention_heads
    config = copy.deepcopy(language_config)
    config.__dict__.update(
        num_layers=args.encoder_num_layers or language_config.num_layers, hidden_size=hidden,
        num_attention_heads=heads, num_query_groups=heads, kv_channels=hidden // heads,
        ffn_hidden_size=args.vision_ffn_hidden_size or 4 * hidden, gated_linear_unit=qwen,
        activation_func=activation, bias_activation_fusion=False, add_bias_linear=True, add_qkv_bias=True,
        normalization="RMSNorm" if qwen else "LayerNorm", layernorm_epsilon=eps, layernorm_zero_centered_gamma=False,
        rotary_interleaved=False, mrope_section=None,
        qk_layernorm=False, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
        account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
        window_size=None, num_moe_experts=None, multi_latent_attention=False, mtp_num_layers=None)
    config.vision_model_type = args.vision_model_type
    return config


def projection_config_from(language_config, args):
    """The projector's config: output width --hidden-size, MLP width --vision-projection-ffn-hidden-size,
    exact GeLU with biases (LLaVA-1.5)."""
    config = copy.deepcopy(language_config)
    config.__dict__.update(
        ffn_hidden_size=args.vision_projection_ffn_hidden_size or language_config.hidden_size,
        gated_linear_unit=False, activation_func=F.gelu, bias_activation_fusion=False, add_bias_linear=True,
        pipeline_model_parallel_size=1, num_moe_experts=None)
    return config
