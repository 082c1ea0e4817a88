"""pretrain() of pretrain_gpt.py in the calling process, with a hook after every training step."""
import sys


def run_pretrain(argv, on_step):
    """Train with pretrain_gpt's providers and the flags ``argv``; ``on_step(model, optimizer, result)``
    sees each step's train_step result (loss dict, skipped, grad norm, zeros in grad)."""
    import megatron.training.training as training
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars

    step = training.train_step

    def recording_train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        result = step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        on_step(model, optimizer, result)
        return result

    training.train_step = recording_train_step
    sys.argv = ["pretrain_gpt.py"] + list(argv)
    try:
        training.pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                          ModelType.encoder_or_decoder, pretrain_gpt.forward_step)
    finally:
        training.train_step = step
        destroy_global_vars()
