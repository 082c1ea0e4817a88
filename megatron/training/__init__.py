"""The training application: flags, initialization, the pretrain() loop, logging, checkpoints."""
from megatron.training.global_vars import get_args, get_timers, get_tokenizer  # noqa: F401
from megatron.training.utils import print_rank_0, print_rank_last  # noqa: F401


_LAZY = {
    "get_model": "megatron.training.model_setup", "initialize_megatron": "megatron.training.initialize",
    "get_train_valid_test_num_samples": "megatron.training.data_iterators",
    "get_tensorboard_writer": "megatron.training.global_vars", "get_wandb_writer": "megatron.training.global_vars",
    "get_signal_handler": "megatron.training.global_vars", "get_one_logger": "megatron.training.global_vars",
    "get_adlr_autoresume": "megatron.training.global_vars", "is_last_rank": "megatron.training.utils",
}


def __getattr__(name):
    # Resolved on first use, so that importing megatron.training stays light.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron.training' has no attribute '{name}'")


def pretrain(*args, **kwargs):
    """Megatron's pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func, ...)."""
    from megatron.training.training import pretrain as _pretrain
    return _pretrain(*args, **kwargs)
