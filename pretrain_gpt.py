"""Pretrain a GPT: `torchrun --nproc-per-node N pretrain_gpt.py <Megatron flags>` (or srun / plain python)."""
import dataclasses
from functools import partial

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.enums import ModelType
from megatron.core.full_cuda_graph import is_graph_capturing
from megatron.core.fusions.compile import compile_available
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.transformer.transformer_layer import compile_transformer_layers
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.arguments.spec_args import resolve_spec
from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig
from megatron.training.datasets.sft_chat import read_chat_template
from megatron.training.datasets.sft_dataset import SFTDataset, SFTDatasetConfig


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    """GPTModel built from the flags: the local layer spec, or (--transformer-impl transformer_engine) the
    same torch layers under Megatron's TE-spec checkpoint key names."""
    args = get_args()
    print_rank_0("building GPT model ...")
    config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    spec_fn = get_gpt_layer_with_transformer_engine_spec if use_te else get_gpt_layer_local_spec
    layer_spec = spec_fn(qk_layernorm=args.qk_layernorm, multi_latent_attention=args.multi_latent_attention,
                         qk_l2_norm=args.qk_l2_norm)
    # One spec per layer: MoE where --moe-layer-freq says so, Gated DeltaNet where --linear-attention-freq does.
    named = resolve_spec(args.spec)  # --spec: as named, as Megatron builds it
    if named is not None:
        layer_spec = named
    elif args.num_experts is not None or args.experimental_attention_variant is not None:
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                                qk_l2_norm=args.qk_l2_norm)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        mtp_block_spec=get_gpt_mtp_block_spec(config, layer_spec, vp_stage=vp_stage), vp_stage=vp_stage)
    if args.torch_compile:
        if compile_available():
            n = compile_transformer_layers(model)
            print_rank_0(f"> torch.compile: {n} transformer layers compiled (first iterations include compile)")
        else:
            print_rank_0("> --torch-compile: no CUDA + Triton here; layers run eagerly")
    return model


_INT_KEYS = ["tokens", "labels", "position_ids"]
SPIKY_LOSS_FACTOR = 10  # Megatron's: a loss 10x the largest of the first 100 steps is a spike


def _packed_documents(args):
    """True when samples carry document offsets (cu_seqlens) instead of a dense attention mask: packed
    documents (--reset-attention-mask) and packed SFT conversations (--sft)."""
    return args.sft or (args.reset_attention_mask and not args.create_attention_mask_in_dataloader)


def get_batch(data_iterator, vp_stage=None):
    """TP rank 0 reads a micro-batch and broadcasts it to its TP group; every CP rank then keeps its two
    chunks of the sequence (get_batch_on_this_cp_rank). Middle PP stages need only the document
    boundaries of packed sequences. Returns tokens, labels, loss_mask, attention_mask, position_ids,
    packed_seq_params."""
    args = get_args()
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    packed = _packed_documents(args)
    if not first and not last and not packed:
        return None, None, None, None, None, None
    data = next(data_iterator) if parallel_state.get_tensor_model_parallel_rank() == 0 else None
    # Without --reset-attention-mask the data loader's mask is the plain causal one, which attention applies
    # itself (SDPA's is_causal): it is neither copied to the device nor checked there (a host sync that
    # CUDA-graph capture refuses). Under CP or packed documents the mask is never needed.
    # Every rank knows what the loader yields (the dataset makes a mask iff create_attention_mask) and its
    # shapes ([micro-batch, seq]): the broadcasts need no size exchange and nothing here waits for the
    # device, so the host keeps queueing work ahead of the GPU under TP.
    has_mask = (args.context_parallel_size == 1 and not packed and args.reset_attention_mask
                and args.create_attention_mask_in_dataloader)
    if data is not None and has_mask and "attention_mask" not in data:
        raise ValueError("get_batch: --reset-attention-mask without --no-create-attention-mask-in-dataloader "
                         "expects the data loader to yield an attention_mask; this one does not")
    keys = _INT_KEYS + (["cu_seqlens"] if packed else [])
    if data is not None and packed:
        data = dict(data, cu_seqlens=data["cu_seqlens"].long())
    s = (args.micro_batch_size, args.seq_length)
    shapes = {k: s for k in _INT_KEYS + ["loss_mask"]} | {"attention_mask": (s[0], 1, s[1], s[1])}
    # Packed documents' offsets differ per sample: that one broadcast exchanges sizes.
    batch = tensor_parallel.broadcast_data(keys, data, torch.int64, shapes=None if packed else shapes)
    batch["loss_mask"] = tensor_parallel.broadcast_data(["loss_mask"], data, torch.float32,
                                                        shapes=shapes)["loss_mask"]
    batch["attention_mask"] = None
    if has_mask:
        batch["attention_mask"] = tensor_parallel.broadcast_data(["attention_mask"], data, torch.bool,
                                                                 shapes=shapes)["attention_mask"]
    packed_seq_params = _packed_seq_params(batch.pop("cu_seqlens"), batch["tokens"].size(1)) if packed else None
    batch = get_batch_on_this_cp_rank(batch)
    if not first and not last:
        return None, None, None, None, None, packed_seq_params
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"], batch["position_ids"],
            packed_seq_params)


def _packed_seq_params(cu_seqlens, seq_length):
    """PackedSeqParams over the batch flattened sample by sample, from per-sample offsets [b, s + 1]."""
    b = cu_seqlens.size(0)
    shift = torch.arange(b, device=cu_seqlens.device)[:, None] * seq_length
    flat = torch.cat([(cu_seqlens[:, :-1] + shift).flatten(), cu_seqlens.new_tensor([b * seq_length])])
    flat = flat.to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=flat, cu_seqlens_kv=flat)


def loss_func(loss_mask, output_tensor, mtp_loss_stats=None):
    """(sum of masked token losses, token count, {'lm loss': [sum, count]}) — token-weighted reporting;
    with multi-token prediction in training also {'mtp_<k> loss': [sum, count]} per depth."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    # Inside a CUDA-graph capture the check cannot sync; train_step checks the replayed losses instead.
    if not is_graph_capturing():
        rerun_state_machine = get_rerun_state_machine()
        if args.check_for_nan_in_loss_and_grad:
            rerun_state_machine.validate_result(loss, torch.isnan, "found NaN in local forward loss calculation")
            rerun_state_machine.validate_result(loss, torch.isinf, "found Inf in local forward loss calculation")
        if args.check_for_spiky_loss:
            rerun_state_machine.validate_result(
                loss, partial(rerun_state_machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"),
                "spiky loss", fatal=False)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    reporting = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    losses_reported = {"lm loss": reporting}
    for depth, stats in enumerate(mtp_loss_stats or []):
        losses_reported[f"mtp_{depth + 1} loss"] = stats
    return loss, num_tokens, losses_reported


def forward_step(data_iterator, model):
    """One micro-batch forward; returns the per-token loss and the function that reduces it."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = getattr(_unwrap(model), "vp_stage", None)
    tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                          packed_seq_params=packed_seq_params)
    # The MTP depths' losses of this micro-batch (training only), logged next to the LM loss.
    mtp_loss_stats = getattr(_unwrap(model), "mtp_loss_stats", None)
    return output_tensor, partial(loss_func, loss_mask, mtp_loss_stats=mtp_loss_stats)


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def is_dataset_built_on_rank(vp_stage=None):
    # Middle stages read packed batches too: attention there needs the document boundaries.
    stage_reads = (parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
                   or _packed_documents(get_args()))
    return stage_reads and parallel_state.get_tensor_model_parallel_rank() == 0


def core_gpt_dataset_config_from_args(args):
    """The GPT dataset config from the flags; with --fim-data the FIM one (GPTFIMDatasetConfig), as Megatron's."""
    config_class, fim = GPTDatasetConfig, {}
    if args.fim_data:
        tokens = {"prefix": args.fim_prefix_token, "middle": args.fim_middle_token, "suffix": args.fim_suffix_token,
                  "pad": args.fim_pad_token, "eod": args.fim_eod_token}
        config_class = GPTFIMDatasetConfig
        fim = dict(fim_rate=args.fim_rate, fim_spm_rate=args.fim_spm_rate, fim_extra_tokens=tokens,
                   fim_split_sample=args.fim_split_sample, fim_fragment_rate=args.fim_fragment_rate,
                   fim_no_prefix=args.fim_no_prefix)
    return config_class(
        random_seed=args.seed, sequence_length=args.seq_length, blend=get_blend_from_list(args.data_path),
        blend_per_split=[get_blend_from_list(args.train_data_path), get_blend_from_list(args.valid_data_path),
                         get_blend_from_list(args.test_data_path)],
        multiple_validation_sets=args.multiple_validation_sets, full_validation=args.full_validation,
        split=args.split, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus, **fim)


def sft_dataset_config_from_args(args):
    """The GPT dataset config plus the chat rendering of --sft (HF tokenizer dir, prompt format, bad records)."""
    base = core_gpt_dataset_config_from_args(args)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    return SFTDatasetConfig(**fields, sft_tokenizer_path=args.tokenizer_model,
                            sft_prompt_format=args.sft_tokenizer_prompt_format, sft_bad_records=args.sft_bad_records,
                            sft_chat_template=read_chat_template(args.chat_template))


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """GPT train/valid/test datasets (MockGPTDataset with --mock-data, packed conversations with --sft,
    fill-in-the-middle samples with --fim-data)."""
    args = get_args()
    if args.sft:
        config, dataset_type = sft_dataset_config_from_args(args), SFTDataset
    else:
        config = core_gpt_dataset_config_from_args(args)
        dataset_type = MockGPTDataset if args.mock_data else GPTFIMDataset if args.fim_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        config).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


# Every rank calls the provider; the builder decides which ranks actually build.
train_valid_test_datasets_provider.is_distributed = True


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
