"""Dataset plumbing shared by the masked-LM pretraining scripts (pretrain_bert.py, pretrain_t5.py)."""
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.utils import get_blend_from_list
from megatron.training import get_tokenizer, print_rank_0


def is_dataset_built_on_rank(vp_stage=None):
    # every pipeline stage reads: each needs the padding mask for its attention layers
    return parallel_state.get_tensor_model_parallel_rank() == 0


def masked_dataset_config_kwargs(args) -> dict:
    """The MaskedWordPieceDatasetConfig fields that come straight from the common data flags."""
    return dict(
        random_seed=args.seed, blend=get_blend_from_list(args.data_path),
        blend_per_split=[get_blend_from_list(args.train_data_path), get_blend_from_list(args.valid_data_path),
                         get_blend_from_list(args.test_data_path)],
        multiple_validation_sets=args.multiple_validation_sets, full_validation=args.full_validation,
        split=args.split, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=get_tokenizer(),
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        masking_probability=args.mask_prob, short_sequence_probability=args.short_seq_prob)


def build_masked_datasets(dataset_cls, config, train_val_test_num_samples, name: str):
    """Train/valid/test datasets of ``dataset_cls`` through the blended builder, with Megatron's log lines."""
    print_rank_0(f"> building train, validation, and test datasets for {name} ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_cls, train_val_test_num_samples, is_dataset_built_on_rank, config).build()
    print_rank_0(f"> finished creating {name} datasets ...")
    return train_ds, valid_ds, test_ds
