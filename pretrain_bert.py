"""Pretrain BERT (masked LM + sentence order): `torchrun --nproc-per-node N pretrain_bert.py <Megatron flags>`.

Data: `tools/preprocess_data.py --split-sentences --tokenizer-type BertWordPieceLowerCase ...` output
(`<prefix>_text_sentence`), passed with --data-path; or --mock-data (synthetic sentences, same masking).
"""
from functools import partial

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
    MockBERTMaskedWordPieceDataset,
)
from megatron.core.enums import ModelType
from megatron.core.models.bert.bert_layer_specs import get_bert_layer_local_spec
from megatron.core.models.bert.bert_model import BertModel
from megatron.training import get_args, get_timers, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.arguments.mup_args import refuse_mup
from megatron.training.arguments.spec_args import resolve_spec
from megatron.training.masked_lm_datasets import (
    build_masked_datasets,
    masked_dataset_config_kwargs,
)
from megatron.training.utils import average_losses_across_data_parallel_group


def add_bert_args(parser):
    """BERT's data and head flags (Megatron names and defaults)."""
    g = parser.add_argument_group(title="bert")
    g.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head",
                   help="Disable the sentence-order (binary) head; samples are then single segments.")
    g.add_argument("--mask-prob", type=float, default=0.15, help="Fraction of tokens masked for the LM loss.")
    g.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="Probability of a sample shorter than --seq-length.")
    return parser


def check_bert_args(args):
    """One-line errors for layouts this BERT does not support."""
    refuse_mup(args, "pretrain_bert.py")
    if args.virtual_pipeline_model_parallel_size is not None:
        raise ValueError("pretrain_bert.py: virtual pipeline stages are not supported; drop "
                         "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank")
    if args.sequence_parallel or args.context_parallel_size > 1:
        raise ValueError("pretrain_bert.py: --sequence-parallel and --context-parallel-size > 1 are not supported")


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    """BertModel from the flags, with the local (torch) encoder layer spec."""
    args = get_args()
    check_bert_args(args)
    print_rank_0("building BERT model ...")
    config = core_transformer_config_from_args(args)
    return BertModel(
        config=config, num_tokentypes=2 if args.bert_binary_head else 0,
        transformer_layer_spec=resolve_spec(args.spec) or get_bert_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, add_binary_head=args.bert_binary_head,
        vp_stage=vp_stage)


_KEYS = ["text", "types", "labels", "is_random", "loss_mask", "padding_mask"]


def get_batch(data_iterator):
    """TP rank 0 reads a micro-batch; broadcast_data ships it to the rest of its TP group."""
    data = next(data_iterator) if parallel_state.get_tensor_model_parallel_rank() == 0 else None
    b = tensor_parallel.broadcast_data(_KEYS, data, torch.int64)
    return (b["text"].long(), b["types"].long(), b["is_random"].long(), b["loss_mask"].float(),
            b["labels"].long(), b["padding_mask"].long())


def loss_func(loss_mask, sentence_order, output_tensor):
    """Masked-token mean CE (+ sentence-order CE); legacy (loss, dict) reporting averaged over DP."""
    lm_loss_, sop_logits = output_tensor
    loss_mask = loss_mask.float().reshape(-1)
    lm_loss = torch.sum(lm_loss_.float().view(-1) * loss_mask) / loss_mask.sum().clamp(min=1.0)
    if sop_logits is None:
        averaged = average_losses_across_data_parallel_group([lm_loss])
        return lm_loss, {"lm loss": averaged[0]}
    sop_loss = F.cross_entropy(sop_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1)
    averaged = average_losses_across_data_parallel_group([lm_loss, sop_loss])
    return lm_loss + sop_loss, {"lm loss": averaged[0], "sop loss": averaged[1]}


def forward_step(data_iterator, model):
    """One micro-batch: (lm loss per token, sentence-order logits) and the function that reduces them."""
    args, timers = get_args(), get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, types, sentence_order, loss_mask, lm_labels, padding_mask = get_batch(data_iterator)
    timers("batch-generator").stop()
    if not args.bert_binary_head:
        types = None
    output_tensor = model(tokens, padding_mask, tokentype_ids=types, lm_labels=lm_labels)
    return output_tensor, partial(loss_func, loss_mask, sentence_order)


def core_bert_dataset_config_from_args(args):
    return BERTMaskedWordPieceDatasetConfig(
        **masked_dataset_config_kwargs(args), sequence_length=args.seq_length,
        masking_max_ngram=3, masking_do_full_word=True, masking_do_permutation=False,
        masking_use_longer_ngrams=False, masking_use_geometric_distribution=False,
        classification_head=args.bert_binary_head)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """BERT train/valid/test datasets from sentence-split data (synthetic sentences with --mock-data)."""
    args = get_args()
    check_bert_args(args)
    dataset_type = MockBERTMaskedWordPieceDataset if args.mock_data else BERTMaskedWordPieceDataset
    return build_masked_datasets(dataset_type, core_bert_dataset_config_from_args(args),
                                 train_val_test_num_samples, "BERT")


# Every rank calls the provider; the builder decides which ranks actually build.
train_valid_test_datasets_provider.is_distributed = True


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             extra_args_provider=add_bert_args, args_defaults={"tokenizer_type": "BertWordPieceLowerCase"})
