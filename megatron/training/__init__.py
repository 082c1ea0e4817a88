"""The training application: flags, initialization, the pretrain() loop, logging, checkpoints."""
from megatron.training.global_vars import get_args, get_timers, get_tokenizer  # noqa: F401
from megatron.training.utils import print_rank_0, print_rank_last  # noqa: F401


def pretrain(*args, **kwargs):
    """Megatron's pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func, ...)."""
    from megatron.training.training import pretrain as _pretrain
    return _pretrain(*args, **kwargs)
