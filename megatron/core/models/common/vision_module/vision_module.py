"""VisionModule: the base of image encoders; parameter bookkeeping shared with the language models."""
from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.transformer.initialize import initialize_parameters
from megatron.core.transformer.module import MegatronModule


class VisionModule(MegatronModule):
    """An encoder of images. ``finalize_parameters`` ends a subclass ``__init__`` as
    ``LanguageModule.finalize_parameters`` does: TP defaults, the DP all-reduce flag, then
    layout-independent initialization (values from the seed and each parameter's name)."""

    pg_collection = None

    def finalize_parameters(self, name_prefix: str = "") -> None:
        for p in self.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(p)
            if not hasattr(p, "allreduce"):
                p.allreduce = True
        if self.config.perform_initialization:
            initialize_parameters(self, pg_collection=self.pg_collection, name_prefix=name_prefix)
