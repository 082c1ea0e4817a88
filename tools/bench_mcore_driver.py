# Driver for benchmarking megatron-core 0.19.2 (PyPI wheel) GPT pretraining, side by side with ours.
# Run with the wheel first on PYTHONPATH (tools/bench_deepseek_round.sh); never imported by the product.
# Own code: imports megatron.training.pretrain and megatron.core modules, provides the
# model/data/forward-step callbacks. Launch with torchrun --nproc_per_node 1.
import os
import time
from functools import partial

import torch

from megatron.core import mpu  # noqa: F401  (Megatron's wheel must import its parallel_state before pretrain)
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args

_ITER_T = []  # host timestamps (after cuda sync) at each forward_step entry
USE_SDPA = os.environ.get("BENCH_SDPA", "0") == "1"


class SDPACoreAttention(torch.nn.Module):
    """Variant A2 (own code): core attention through torch SDPA (flash) instead of Megatron's
    unfused local DotProductAttention. Same constructor/forward interface as the local module."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kw):
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale  # MLA passes its YaRN-scaled 1/sqrt(d)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        sq, b, n, d = query.shape  # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=k.shape[1] != q.shape[1],
                                                             scale=self.softmax_scale)
        return o.permute(2, 0, 1, 3).reshape(sq, b, -1)  # v's head dim (MLA: v_head_dim != qk dim)


def build_model(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    tcfg = core_transformer_config_from_args(args)
    mtp_spec = None
    if args.multi_latent_attention or args.moe_layer_freq != 1 or args.mtp_num_layers:
        # DeepSeek-style: Megatron's pretrain_gpt builds the block spec (dense/MoE pattern, MLA) and the MTP spec.
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
        spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization=args.normalization)
        if USE_SDPA:
            for ls in spec.layer_specs:
                ls.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        if args.mtp_num_layers:
            mtp_spec = get_gpt_mtp_block_spec(tcfg, spec, use_transformer_engine=False)
    else:
        spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
                                        normalization=args.normalization)
        if USE_SDPA:
            spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    model = GPTModel(mtp_block_spec=mtp_spec,
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
    )
    n = sum(p.numel() for p in model.parameters())
    print_rank_0(f"[bench] GPTModel params: {n} ({n/1e9:.4f} B)")
    print_rank_0(f"[bench] core attention module: {type(model.decoder.layers[0].self_attention.core_attention)}")
    print_rank_0(f"[bench] layer types: {[type(l.mlp).__name__ for l in model.decoder.layers]}")
    print_rank_0(f"[bench] layernorm module: {type(model.decoder.layers[0].input_layernorm)}")
    print_rank_0(f"[bench] activation: {tcfg.activation_func}, bias_activation_fusion={tcfg.bias_activation_fusion}, "
                 f"masked_softmax_fusion={tcfg.masked_softmax_fusion}, attention_backend={tcfg.attention_backend}")
    return model


def datasets(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    tok = get_tokenizer()
    blend, split = None, "1,0,0"
    if args.data_path:  # real .bin/.idx data (loss-curve comparison runs)
        from megatron.core.datasets.utils import get_blend_from_list
        blend, split = get_blend_from_list(args.data_path), args.split
    cfg = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=None,
        split=split,
        path_to_cache=None,
        mmap_bin_files=False,
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    cls = MockGPTDataset
    if args.data_path:
        from megatron.core.datasets.gpt_dataset import GPTDataset
        cls = GPTDataset
    train, valid, test = BlendedMegatronDatasetBuilder(
        cls, train_val_test_num_samples, lambda: True, cfg
    ).build()
    return train, valid, test


datasets.is_distributed = True


def _loss(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    total = torch.sum(losses * mask)
    ntok = mask.sum().to(torch.int)
    report = torch.cat([total.clone().detach().view(1), ntok.view(1).float()])
    return total, ntok, {"lm loss": report}


def fwd_step(data_iterator, model):
    torch.cuda.synchronize()
    _ITER_T.append(time.perf_counter())
    batch = next(data_iterator)
    tokens = batch["tokens"].cuda(non_blocking=True)
    labels = batch["labels"].cuda(non_blocking=True)
    loss_mask = batch["loss_mask"].cuda(non_blocking=True)
    position_ids = batch["position_ids"].cuda(non_blocking=True)
    out = model(tokens, position_ids, None, labels=labels)
    return out, partial(_loss, loss_mask)


if __name__ == "__main__":
    # The PyPI wheel ships a prebuilt megatron/core/datasets/helpers_cpp*.so but no Makefile, and
    # initialize_megatron() runs `make -C .../datasets` which then fails. If the prebuilt module
    # imports, skip the compile step.
    import megatron.core.datasets.utils as _dsu
    from megatron.core.datasets import helpers_cpp  # noqa: F401  (fails loudly if absent)
    _dsu.compile_helpers = lambda: print("[bench] skipping compile_helpers (prebuilt helpers_cpp present)")
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    print_rank_0(f"[bench] padded_vocab_size={args.padded_vocab_size}")
    from megatron.training.training import num_floating_point_operations
    fl = num_floating_point_operations(args, args.global_batch_size)
    print_rank_0(f"[bench] megatron num_floating_point_operations(global batch)={fl} ({fl/1e12:.3f} TFLOP/iter)")
    cfg = pretrain_cfg_container_from_args(args, None)
    torch.cuda.reset_peak_memory_stats()
    pretrain(cfg, datasets, ModelType.encoder_or_decoder, fwd_step, model_provider=build_model)
    torch.cuda.synchronize()
    _ITER_T.append(time.perf_counter())
    dts = [(b - a) * 1e3 for a, b in zip(_ITER_T[:-1], _ITER_T[1:])]
    last = sorted(dts[-20:])
    med = (last[9] + last[10]) / 2 if len(last) == 20 else last[len(last) // 2]
    print(f"[bench] per-iter ms (host, forward_step to forward_step): {[round(x, 1) for x in dts]}")
    print(f"[bench] median last20 ms={med:.2f}")
    print(f"[bench] max_memory_allocated GiB={torch.cuda.max_memory_allocated()/2**30:.2f} "
          f"max_reserved GiB={torch.cuda.max_memory_reserved()/2**30:.2f}")
