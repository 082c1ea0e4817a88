from megatron.training.tokenizer.tokenizer import build_tokenizer  # noqa: F401
