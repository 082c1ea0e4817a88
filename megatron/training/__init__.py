"""The training application: flags, initialization, the pretrain() loop, logging, checkpoints."""
from megatron.core.utils import lazy_names
from megatron.training.global_vars import (  # noqa: F401
                                           get_adlr_autoresume,
                                           get_args,
                                           get_signal_handler,
                                           get_tensorboard_writer,
                                           get_timers,
                                           get_tokenizer,
                                           get_wandb_writer,
)
from megatron.training.utils import is_last_rank, print_rank_0, print_rank_last  # noqa: F401

# Resolved on first use: the training loop and its model, optimizer and checkpoint modules cost ~0.9 s of
# CPU to import, which `import megatron.training` (tokenizer, config and tool users) does not pay; and
# Megatron-only names come from the compat room (megatron/training/_compat/).
__getattr__ = lazy_names(__name__, {
    "pretrain": "megatron.training.training", "set_startup_timestamps": "megatron.training.training",
    "get_model": "megatron.training.model_setup", "initialize_megatron": "megatron.training.initialize",
    "get_train_valid_test_num_samples": "megatron.training.data_iterators",
    "get_one_logger": "megatron.training._compat.global_vars",
})
