"""Pretrain T5 (span corruption): `torchrun --nproc-per-node N pretrain_t5.py <Megatron flags>`.

Data: `tools/preprocess_data.py --split-sentences --tokenizer-type BertWordPieceCase ...` output
(`<prefix>_text_sentence`), passed with --data-path, or --mock-data (synthetic sentences). BertWordPieceCase
registers the 100 sentinels <extra_id_i>; with BertWordPieceLowerCase pass --vocab-extra-ids 100.
"""
import argparse
import sys
from functools import partial

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.datasets.t5_dataset import (
    MockT5MaskedWordPieceDataset,
    T5MaskedWordPieceDataset,
    T5MaskedWordPieceDatasetConfig,
)
from megatron.core.enums import ModelType
from megatron.core.models.T5 import T5Model
from megatron.core.models.T5.t5_model import encoder_config_from, t5_attention_masks
from megatron.core.models.T5.t5_spec import get_t5_decoder_with_local_block_spec, get_t5_encoder_with_local_block_spec
from megatron.training import get_args, get_timers, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.arguments.mup_args import refuse_mup
from megatron.training.arguments.spec_args import refuse_spec
from megatron.training.masked_lm_datasets import (
    build_masked_datasets,
    masked_dataset_config_kwargs,
)


def add_t5_args(parser):
    """Encoder-decoder shape and span-corruption flags (Megatron names and defaults)."""
    g = parser.add_argument_group(title="t5")
    g.add_argument("--encoder-num-layers", type=int, default=None, help="Encoder layers (default --num-layers).")
    g.add_argument("--decoder-num-layers", type=int, default=None, help="Decoder layers (default --num-layers).")
    g.add_argument("--decoder-seq-length", type=int, default=None, help="Decoder sequence length (required).")
    g.add_argument("--mask-prob", type=float, default=0.15, help="Fraction of encoder tokens corrupted.")
    g.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="Probability of a sample shorter than --encoder-seq-length.")
    return parser


def check_t5_args(args):
    """Fill the encoder/decoder layer counts and reject what this T5 does not support, one line each."""
    refuse_spec(args, "pretrain_t5.py")
    refuse_mup(args, "pretrain_t5.py")
    if args.decoder_seq_length is None or args.decoder_seq_length <= 0:
        raise ValueError("pretrain_t5.py: --decoder-seq-length is required (e.g. 128 for --encoder-seq-length 512)")
    if args.max_position_embeddings < max(args.seq_length, args.decoder_seq_length):
        raise ValueError(f"--max-position-embeddings ({args.max_position_embeddings}) must be >= the encoder and "
                         f"decoder sequence lengths ({args.seq_length}, {args.decoder_seq_length})")
    if args.pipeline_model_parallel_size > 1:
        raise ValueError("pretrain_t5.py: --pipeline-model-parallel-size > 1 is not supported yet; use TP/DP")
    if args.sequence_parallel or args.context_parallel_size > 1:
        raise ValueError("pretrain_t5.py: --sequence-parallel and --context-parallel-size > 1 are not supported")
    if args.recompute_granularity is not None:
        raise ValueError("pretrain_t5.py: activation recompute is not supported for T5 yet; drop "
                         "--recompute-granularity / --recompute-activations")
    if args.encoder_num_layers is None:
        args.encoder_num_layers = args.num_layers
    if args.decoder_num_layers is None:
        args.decoder_num_layers = args.num_layers


def model_provider(pre_process=True, post_process=True, vp_stage=None, add_encoder=True, add_decoder=True):
    """T5Model from the flags: encoder and decoder configs differ only in their layer counts."""
    args = get_args()
    check_t5_args(args)
    print_rank_0("building T5 model ...")
    base = core_transformer_config_from_args(args)
    config = encoder_config_from(base, args.decoder_num_layers)
    encoder_config = encoder_config_from(base, args.encoder_num_layers)
    return T5Model(
        config=config, encoder_config=encoder_config,
        transformer_encoder_layer_spec=get_t5_encoder_with_local_block_spec(args.encoder_num_layers),
        transformer_decoder_layer_spec=get_t5_decoder_with_local_block_spec(args.decoder_num_layers),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, add_encoder=add_encoder, add_decoder=add_decoder)


_KEYS = ["text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask"]


def get_batch(data_iterator):
    """TP rank 0 reads a micro-batch and broadcasts it; the attention masks are built here."""
    data = next(data_iterator) if parallel_state.get_tensor_model_parallel_rank() == 0 else None
    b = tensor_parallel.broadcast_data(_KEYS, data, torch.int64)
    enc_mask, dec_mask, enc_dec_mask = t5_attention_masks(b["enc_mask"], b["dec_mask"])
    return (b["text_enc"].long(), b["text_dec"].long(), b["labels"].long(), b["loss_mask"].float(),
            enc_mask, dec_mask, enc_dec_mask)


def loss_func(loss_mask, output_tensor):
    """(sum of decoder token losses, token count, {'lm loss': [sum, count]}): token-weighted reporting."""
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])}


def forward_step(data_iterator, model):
    """One micro-batch through encoder and decoder; returns the per-token loss and its reducer."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens_enc, tokens_dec, lm_labels, loss_mask, enc_mask, dec_mask, enc_dec_mask = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(tokens_enc, tokens_dec, enc_mask, dec_mask, enc_dec_mask, lm_labels=lm_labels)
    return output_tensor, partial(loss_func, loss_mask)


def core_t5_dataset_config_from_args(args):
    return T5MaskedWordPieceDatasetConfig(
        **masked_dataset_config_kwargs(args), sequence_length=args.seq_length,
        sequence_length_encoder=args.seq_length, sequence_length_decoder=args.decoder_seq_length,
        masking_max_ngram=10, masking_do_full_word=False, masking_do_permutation=False,
        masking_use_longer_ngrams=False, masking_use_geometric_distribution=True)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """T5 train/valid/test datasets from sentence-split data (synthetic sentences with --mock-data)."""
    args = get_args()
    check_t5_args(args)
    dataset_type = MockT5MaskedWordPieceDataset if args.mock_data else T5MaskedWordPieceDataset
    return build_masked_datasets(dataset_type, core_t5_dataset_config_from_args(args),
                                 train_val_test_num_samples, "T5")


# Every rank calls the provider; the builder decides which ranks actually build.
train_valid_test_datasets_provider.is_distributed = True


def _args_defaults(argv):
    """--num-layers defaults to --encoder-num-layers (as in Megatron) when only the latter is given."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--num-layers", type=int, default=None)
    pre.add_argument("--encoder-num-layers", type=int, default=None)
    known, _ = pre.parse_known_args(argv)
    defaults = {"tokenizer_type": "BertWordPieceCase"}
    if known.num_layers is None and known.encoder_num_layers is not None:
        defaults["num_layers"] = known.encoder_num_layers
    return defaults


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_and_decoder, forward_step,
             extra_args_provider=add_t5_args, args_defaults=_args_defaults(sys.argv[1:]))
