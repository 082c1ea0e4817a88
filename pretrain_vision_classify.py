"""Pretrain a ViT image classifier (Megatron's legacy entry point): `torchrun ... pretrain_vision_classify.py <flags>`.

The model: a CLIP-style ViT of --num-layers x --hidden-size (--num-attention-heads, --ffn-hidden-size) on
--img-h x --img-w images cut into --patch-dim patches, a final LayerNorm and an MLP head over the class
token to --num-classes logits. TP and DP as for GPT (PP 1).

Data (--data-path TRAIN [VALID]): image folders with one sub-folder per class (torchvision's ImageFolder
layout; see megatron/training/datasets/image_folder.py); decoding and augmentation run on the DataLoader
workers (--num-workers). --classes-fraction / --data-per-class-fraction take part of the data;
--skip-bad-samples skips unreadable images (default: stop with one line naming the file).
The log line reports the loss and the top-1 accuracy of each iteration.

--seq-length and --max-position-embeddings default to the ViT's sequence (patches + class token); images
need no tokenizer, so none is required.
"""
import argparse
import sys
from functools import partial

import torch
import torch.nn.functional as F

from megatron.core.enums import ModelType
from megatron.core.models.vision.vit_classification_model import VitClassificationModel
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.utils import get_device
from megatron.training import get_args, get_timers, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.arguments.mup_args import refuse_mup
from megatron.training.arguments.spec_args import refuse_spec
from megatron.training.arguments.vision_args import add_vision_classify_args
from megatron.training.datasets.image_folder import ImageFolderDataset
from megatron.training.datasets.vlm_dataset import BadSample, worker_error_line


def check_classify_args(args):
    """Refuse what this entry point does not build, one line each."""
    refuse_spec(args, "pretrain_vision_classify.py")
    refuse_mup(args, "pretrain_vision_classify.py")
    if args.vision_backbone_type != "vit":
        raise ValueError(f"--vision-backbone-type {args.vision_backbone_type}: only vit is built here")
    if args.vision_pretraining_type != "classify":
        raise ValueError(f"--vision-pretraining-type {args.vision_pretraining_type}: only classify is built here")
    if args.pipeline_model_parallel_size > 1 or args.context_parallel_size > 1 or args.sequence_parallel:
        raise ValueError("pretrain_vision_classify.py: use TP and DP; --pipeline-model-parallel-size, "
                         "--context-parallel-size and --sequence-parallel are not supported")
    if args.img_h % args.patch_dim or args.img_w % args.patch_dim:
        raise ValueError(f"--img-h {args.img_h} / --img-w {args.img_w} must be multiples of --patch-dim "
                         f"{args.patch_dim}")
    if args.mock_data or not args.data_path:
        raise ValueError("pretrain_vision_classify.py: pass --data-path TRAIN_FOLDER [VALID_FOLDER] (image folders "
                         "with one sub-folder per class)")
    if len(args.data_path) > 2:
        raise ValueError(f"--data-path takes a training folder and optionally a validation folder; got "
                         f"{len(args.data_path)} paths")


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    args = get_args()
    check_classify_args(args)
    print_rank_0("building ViT classification model ...")
    config = core_transformer_config_from_args(args)
    return VitClassificationModel(config, get_vit_layer_with_local_spec(), args.num_classes, img_h=args.img_h,
                                  img_w=args.img_w, patch_dim=args.patch_dim, num_channels=args.num_channels,
                                  vp_stage=vp_stage)


def get_batch(data_iterator):
    try:
        batch = next(data_iterator)
    except BadSample as e:  # raised on a loader worker: keep the one line that names the file
        raise BadSample(worker_error_line(e)) from None
    device = get_device()
    return batch["images"].to(device, non_blocking=True), batch["labels"].to(device, non_blocking=True)


def loss_func(labels, logits):
    """Token-weighted form (summed loss, samples): the schedule averages over the global batch; accuracy
    is reported as (correct, samples) the same way."""
    logits = logits.float()
    loss = F.cross_entropy(logits, labels, reduction="sum")
    correct = (logits.argmax(-1) == labels).sum().float()
    # A fill on the device: torch.tensor(n, device=cuda) copies from pageable host memory, which waits for the
    # stream (a host sync per micro-batch) and cannot be captured by --cuda-graph-impl full_iteration.
    count = torch.full((), labels.numel(), dtype=torch.int, device=labels.device)
    return loss, count, {"loss": torch.stack([loss.detach(), count.float()]),
                         "accuracy": torch.stack([correct, count.float()])}


def forward_step(data_iterator, model):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    images, labels = get_batch(data_iterator)
    timers("batch-generator").stop()
    return model(images), partial(loss_func, labels)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """The training image folder (random crops and flips) and the optional validation one (centre crops)."""
    args = get_args()
    check_classify_args(args)
    common = dict(img_h=args.img_h, img_w=args.img_w, seed=args.seed, skip_bad_samples=args.skip_bad_samples)
    train = ImageFolderDataset(args.data_path[0], train=True, classes_fraction=args.classes_fraction,
                               data_per_class_fraction=args.data_per_class_fraction,
                               num_samples=train_val_test_num_samples[0], **common)
    valid = None
    if len(args.data_path) == 2:
        valid = ImageFolderDataset(args.data_path[1], train=False, num_samples=train_val_test_num_samples[1],
                                   **common)
    if len(train.classes) > args.num_classes:
        raise ValueError(f"--data-path {args.data_path[0]} has {len(train.classes)} classes but --num-classes is "
                         f"{args.num_classes}")
    print_rank_0(f"> image folder {args.data_path[0]}: {len(train.samples)} images in {len(train.classes)} classes")
    return train, valid, None


# Every rank reads its own images (decoding runs on each rank's DataLoader workers; nothing to broadcast).
train_valid_test_datasets_provider.is_distributed = True


def vit_defaults(argv):
    """Entry-point defaults: the ViT's sequence length (patches + class token) for --seq-length and
    --max-position-embeddings, a tokenizer the loop can build (images use none), and the shuffling
    sampler (--dataloader-type cyclic, as Megatron's entry point set; image folders are sorted by class)."""
    parser = add_vision_classify_args(argparse.ArgumentParser(add_help=False))
    known, _ = parser.parse_known_args(argv)
    seq = (known.img_h // known.patch_dim) * (known.img_w // known.patch_dim) + 1
    return {"seq_length": seq, "max_position_embeddings": seq, "tokenizer_type": "NullTokenizer",
            "vocab_size": 2, "dataloader_type": "cyclic"}


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             extra_args_provider=add_vision_classify_args, args_defaults=vit_defaults(sys.argv[1:]))
