"""Megatron's ``megatron.training.argument_utils`` (the 0.19 config-container builders and
ArgumentGroupFactory): nothing in this application calls them, so they live in the compat room
(megatron/training/_compat/argument_utils.py) and resolve from there on first use, as do the config
classes this module has always re-exported."""
from megatron.core.utils import lazy_names

__getattr__ = lazy_names(__name__, {name: "megatron.training._compat.argument_utils" for name in (
    "ArgumentGroupFactory", "TypeInferenceError", "core_transformer_config_from_args", "gpt_config_from_args",
    "pretrain_cfg_container_from_args", "inference_cfg_from_args", "inference_cfg_container_from_args",
    "CheckpointConfig", "DistributedInitConfig", "InferenceConfigContainer", "InferenceSetupConfig", "LoggerConfig",
    "PretrainConfigContainer", "ProfilingConfig", "RNGConfig", "RerunStateMachineConfig", "SchedulerConfig",
    "StragglerDetectionConfig", "TokenizerConfig", "TrainingConfig", "ValidationConfig", "GPTModelConfig")})
