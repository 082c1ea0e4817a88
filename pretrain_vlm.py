"""Pretrain a LLaVA-style vision-language model: `torchrun --nproc-per-node N pretrain_vlm.py <Megatron flags>`.

The model: a ViT (--vision-model-type clip|siglip, --img-h/--img-w/--patch-dim, --encoder-num-layers and the
--vision-* sizes), a projector and a GPT decoder (the usual GPT flags); or, with --vision-model-type
qwen2.5_vit, Qwen2.5-VL (its windowed ViT, patch merger and an mRoPE decoder; built for conversion and
evaluation, its native-resolution training data path is not supported yet). Sequence length: --seq-length is the
decoder's, image positions included; each sample carries --dataloader-seq-length text tokens (default:
--seq-length minus one image's positions). --freeze-LM / --freeze-ViT train the rest.

Data (--data-path): a JSONL of image-text samples next to its images (see
megatron/training/datasets/vlm_dataset.py), or a Megatron Energon dataset folder (`pip install
megatron-energon`; tools/prepare_vlm_energon.py writes one from the same JSONL). --split divides the JSONL.
"""
from functools import partial

from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.multimodal.llava_model import LLaVAModel
from megatron.core.models.multimodal.qwen25_vl_model import Qwen25VLModel
from megatron.core.models.vision.clip_vit_model import get_num_image_embeddings
from megatron.core.models.vision.vit_layer_specs import get_vision_projection_submodules, get_vit_layer_with_local_spec
from megatron.core.utils import get_device
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.arguments.mup_args import refuse_mup
from megatron.training.arguments.spec_args import resolve_spec
from megatron.training.arguments.vision_args import (
    QWEN_VIT,
    QWEN_VIT_DEFAULTS,
    VISION_TYPES,
    add_vlm_args,
    projection_config_from,
    vision_config_from,
)
from megatron.training.datasets.vlm_data import build_vlm_datasets, data_format
from megatron.training.datasets.vlm_dataset import BadSample, worker_error_line
from pretrain_gpt import loss_func


def add_vlm_extra_args(parser):
    """pretrain_vlm.py's flags (Megatron's name for this hook): the vision, projector and image-data ones."""
    return add_vlm_args(parser)


def image_positions(args) -> int:
    """Decoder positions of one image: tiles (+ thumbnail) x patches (+ class token)."""
    per_tile = get_num_image_embeddings(args.img_h, args.img_w, args.patch_dim, args.vision_model_type,
                                        args.disable_vision_class_token, VISION_TYPES[args.vision_model_type][2])
    tiles = args.max_num_tiles + int(args.use_thumbnail and args.max_num_tiles > 1) if args.use_tiling else 1
    return per_tile * tiles


def check_vlm_model_args(args):
    """Refuse model flags this entry point does not support, one line each (also run by the generation
    tools, which build the model without data)."""
    refuse_mup(args, "pretrain_vlm.py")
    if args.num_channels != 3:
        raise ValueError(f"--num-channels {args.num_channels}: the image loader produces RGB (3 channels)")
    if args.virtual_pipeline_model_parallel_size is not None:
        raise ValueError("pretrain_vlm.py: virtual pipeline stages are not supported; drop "
                         "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank")
    if args.sequence_parallel or args.context_parallel_size > 1:
        raise ValueError("pretrain_vlm.py: --sequence-parallel and --context-parallel-size > 1 are not supported")
    if args.vision_model_type == QWEN_VIT:
        check_qwen_vit_args(args)
    else:
        changed = [k for k, v in QWEN_VIT_DEFAULTS.items() if getattr(args, k) != v]
        if changed:
            raise ValueError(f"--{changed[0].replace('_', '-')} applies to --vision-model-type {QWEN_VIT} only")
    if args.img_h % args.patch_dim or args.img_w % args.patch_dim:
        raise ValueError(f"--img-h {args.img_h} / --img-w {args.img_w} must be multiples of --patch-dim "
                         f"{args.patch_dim}")


def check_qwen_vit_args(args):
    """Qwen2.5-VL (--vision-model-type qwen2.5_vit): multimodal RoPE in the decoder, the patch merger as
    projector, native resolution (no tiles, no class token)."""
    if args.position_embedding_type != "mrope":
        raise ValueError(f"--vision-model-type {QWEN_VIT} needs --position-embedding-type mrope (with --mrope-section)")
    if args.vision_projection_type != "mlp":
        raise ValueError(f"--vision-model-type {QWEN_VIT}: the patch merger is an MLP; drop --vision-projection-type")
    if args.use_tiling or args.disable_vision_class_token:
        raise ValueError(f"--vision-model-type {QWEN_VIT} keeps each image at its own size and has no class "
                         "token; drop --use-tiling / --disable-vision-class-token")


def language_layer_spec(args):
    """The language model's layer spec: --spec's when given (Megatron's multimodal examples read it there), else
    the local GPT layer."""
    return resolve_spec(args.spec) or get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm)


def qwen25_vl_model(args, language, pre_process, post_process, vp_stage):
    """Qwen25VLModel from the flags (--vision-model-type qwen2.5_vit)."""
    vision = vision_config_from(language, args)
    return Qwen25VLModel(
        language_transformer_config=language, language_transformer_layer_spec=language_layer_spec(args),
        language_vocab_size=args.padded_vocab_size,
        language_max_sequence_length=args.seq_length, vision_transformer_config=vision,
        vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
        vision_projection_config=projection_config_from(language, args),
        vision_projection_layer_spec=get_vision_projection_submodules(), parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        language_rotary_base=args.rotary_base, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        pre_process=pre_process, post_process=post_process, add_encoder=parallel_state.is_pipeline_first_stage(),
        add_decoder=True, patch_dim=args.patch_dim, temporal_patch_size=args.temporal_patch_size,
        spatial_merge_size=args.spatial_merge_size, window_size=args.vision_window_size,
        full_attention_layers=args.vision_full_attention_layers, image_token_index=args.image_token_index,
        vp_stage=vp_stage)


def check_vlm_args(args):
    """The model checks, then the data's: fill the text length, refuse what the data path cannot do."""
    check_vlm_model_args(args)
    if args.vision_model_type == QWEN_VIT:
        raise ValueError(f"pretrain_vlm.py --vision-model-type {QWEN_VIT}: training data for native-resolution "
                         "images is not supported yet; this model is built for conversion (tools/checkpoint/hf.py) "
                         "and evaluation")
    if args.mock_data:
        raise ValueError("pretrain_vlm.py: --mock-data is not supported; pass --data-path with a JSONL of "
                         "image-text samples (tests/functional/test_pretrain_vlm.py builds one)")
    if args.data_path and data_format(args.data_path[0], args.vlm_data_format) == "energon":
        args.dataloader_type = "external"  # Energon's loader shards over DP ranks and workers itself
    if args.dataloader_seq_length is None:
        args.dataloader_seq_length = args.seq_length - image_positions(args) + 1
    if args.dataloader_seq_length < 2:
        raise ValueError(f"--seq-length {args.seq_length} leaves no room for text after one image's "
                         f"{image_positions(args)} positions; raise --seq-length")


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    """LLaVAModel from the flags; the ViT and projector on the first pipeline stage."""
    args = get_args()
    check_vlm_model_args(args)
    print_rank_0("building LLaVA model ...")
    language = core_transformer_config_from_args(args)
    if args.vision_model_type == QWEN_VIT:
        model = qwen25_vl_model(args, language, pre_process, post_process, vp_stage)
        model.freeze(freeze_language_model=args.freeze_LM, freeze_vision_model=args.freeze_ViT,
                     freeze_vision_projection=False)
        return model
    first = parallel_state.is_pipeline_first_stage()
    model = LLaVAModel(
        language_transformer_config=language, language_transformer_layer_spec=language_layer_spec(args),
        language_vocab_size=args.padded_vocab_size,
        language_max_sequence_length=args.seq_length, vision_transformer_config=vision_config_from(language, args),
        vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
        drop_vision_class_token=args.disable_vision_class_token,
        vision_projection_config=projection_config_from(language, args),
        vision_projection_layer_spec=get_vision_projection_submodules(),
        vision_projection_type=args.vision_projection_type, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        language_position_embedding_type=args.position_embedding_type, language_rotary_percent=args.rotary_percent,
        language_rotary_base=args.rotary_base, language_rope_scaling=args.use_rope_scaling,
        language_rope_scaling_factor=args.rope_scaling_factor, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        pre_process=pre_process, post_process=post_process, add_encoder=first, add_decoder=True,
        img_h=args.img_h, img_w=args.img_w, patch_dim=args.patch_dim, image_token_index=args.image_token_index,
        class_token_len=VISION_TYPES[args.vision_model_type][2], vp_stage=vp_stage)
    model.freeze(freeze_language_model=args.freeze_LM, freeze_vision_model=args.freeze_ViT,
                 freeze_vision_projection=False)
    return model


def get_batch(data_iterator):
    """Every rank reads its own micro-batch (the provider is distributed); moved to this rank's device."""
    try:
        batch = next(data_iterator)
    except BadSample as e:  # raised on a loader worker: keep the one line that names the file and sample
        raise BadSample(worker_error_line(e)) from None
    device = get_device()
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def forward_step(data_iterator, model):
    """One micro-batch: per-token losses on the combined sequence and pretrain_gpt's token-weighted loss."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    b = get_batch(data_iterator)
    timers("batch-generator").stop()
    output, loss_mask = model(b["images"], b["tokens"], None, None, labels=b["labels"], loss_mask=b["loss_mask"],
                              num_image_tiles=b["num_image_tiles"])
    return output, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Image-text datasets from --data-path (JSONL + images, or Megatron Energon)."""
    args = get_args()
    check_vlm_args(args)
    return build_vlm_datasets(args, get_tokenizer(), train_val_test_num_samples)


# Every rank reads (image decoding runs on each rank's DataLoader workers; nothing to broadcast).
train_valid_test_datasets_provider.is_distributed = True


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             extra_args_provider=add_vlm_extra_args)
