"""Megatron's megatron.training.argument_utils location of the args -> config builders."""
from megatron.training.arguments.configs import core_transformer_config_from_args  # noqa: F401
