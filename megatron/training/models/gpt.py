"""GPTModelConfig and GPTModelBuilder (Megatron 0.19's model config objects): a TransformerConfig plus
the GPT-specific settings, and the builder that turns them into a GPTModel stage."""
import dataclasses
import importlib
import inspect
from types import SimpleNamespace
from typing import Any, Callable, ClassVar, List, Optional

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.tokenizer.tokenizer import _vocab_size_with_padding


@dataclasses.dataclass
class ModelConfig:
    """Base of the model configs: ``builder`` names the class that builds the model. Megatron's
    ``pre_wrap_hooks`` / ``post_wrap_hooks`` (functions of the model chunks around their DDP wrapping)
    are accepted empty; pretrain refuses others."""
    builder: ClassVar[str]
    restore_modelopt_state: bool = False
    extra_checkpoint_metadata: Optional[dict] = None
    pre_wrap_hooks: List[Callable] = dataclasses.field(default_factory=list)
    post_wrap_hooks: List[Callable] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.restore_modelopt_state:
            raise ValueError("ModelConfig(restore_modelopt_state=True): ModelOpt quantization state is not supported")

    def get_builder_cls(self):
        module, name = self.builder.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(kw_only=True)
class GPTModelConfig(ModelConfig):
    """A GPT model: ``transformer`` (its TransformerConfig, whose attributes read and write through this
    object too), the layer spec (a ModuleSpec, a function of this config, or None for the default local
    spec) and the embedding / output settings of GPTModel."""
    builder: ClassVar[str] = "megatron.training.models.gpt.GPTModelBuilder"
    transformer: TransformerConfig
    transformer_layer_spec: Any = None
    vocab_size: Optional[int] = None  # unpadded; padded by the builder when should_pad_vocab
    make_vocab_size_divisible_by: int = 128
    should_pad_vocab: bool = False
    seq_length: int = 1024
    fp16_lm_cross_entropy: bool = False
    parallel_output: bool = True
    share_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "learned_absolute"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    scatter_embedding_sequence_parallel: bool = True
    seq_len_interpolation_factor: Optional[float] = None
    tp_comm_overlap_cfg: Any = None
    use_arbitrary_attention_mask: Optional[bool] = None

    def __getattr__(self, name: str):
        try:
            transformer = object.__getattribute__(self, "transformer")
        except AttributeError:
            raise AttributeError(f"GPTModelConfig has no attribute '{name}'") from None
        if hasattr(transformer, name):
            return getattr(transformer, name)
        raise AttributeError(f"Neither GPTModelConfig nor TransformerConfig has any attribute '{name}'.")

    def __setattr__(self, name: str, value) -> None:
        own = name in {f.name for f in dataclasses.fields(self)}
        transformer = self.__dict__.get("transformer")
        if not own and transformer is not None and hasattr(transformer, name):
            setattr(transformer, name, value)
        else:
            object.__setattr__(self, name, value)

    def finalize(self) -> None:
        """Checks to run once the config is complete (before building)."""
        t = self.transformer
        vp = t.virtual_pipeline_model_parallel_size
        if vp and t.pipeline_model_parallel_layout is None and (t.num_layers // t.pipeline_model_parallel_size) % vp:
            raise ValueError(f"GPTModelConfig: {t.num_layers} layers over {t.pipeline_model_parallel_size} pipeline "
                             f"stages do not split into {vp} virtual stages each")


def default_layer_spec(config: GPTModelConfig, vp_stage: Optional[int] = None):
    """The local spec pretrain_gpt.py uses: per-layer specs with experts or linear-attention layers, else one dense
    layer spec."""
    t = config.transformer
    if t.num_moe_experts is not None or t.experimental_attention_variant is not None:
        return get_gpt_decoder_block_spec(t, normalization=t.normalization, qk_l2_norm=t.qk_l2_norm, vp_stage=vp_stage)
    return get_gpt_layer_local_spec(qk_layernorm=t.qk_layernorm, normalization=t.normalization,
                                    multi_latent_attention=t.multi_latent_attention, qk_l2_norm=t.qk_l2_norm)


class GPTModelBuilder:
    """Builds GPTModel stages from a GPTModelConfig."""

    def __init__(self, model_config: GPTModelConfig):
        self._model_config = model_config

    def build_model(self, pg_collection=None, pre_process: Optional[bool] = None,
                    post_process: Optional[bool] = None, vp_stage: Optional[int] = None) -> GPTModel:
        """One stage; ``pre_process`` / ``post_process`` default to this rank's pipeline (and virtual) stage."""
        cfg = self._model_config
        spec = cfg.transformer_layer_spec
        if spec is None:
            spec = default_layer_spec(cfg, vp_stage)
        elif not isinstance(spec, ModuleSpec) and callable(spec):
            spec = (spec(cfg, vp_stage=vp_stage) if "vp_stage" in inspect.signature(spec).parameters else spec(cfg))
        if cfg.vocab_size is None:
            raise ValueError("GPTModelConfig.vocab_size must be set before building the model")
        vocab = cfg.vocab_size
        if cfg.should_pad_vocab:
            vocab = _vocab_size_with_padding(vocab, SimpleNamespace(
                make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
                tensor_model_parallel_size=cfg.transformer.tensor_model_parallel_size), logging_enabled=False)
        ignore_virtual = vp_stage is None
        if pre_process is None:
            pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
        if post_process is None:
            post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
        return GPTModel(
            config=cfg.transformer, transformer_layer_spec=spec,
            mtp_block_spec=get_gpt_mtp_block_spec(cfg.transformer, spec, vp_stage=vp_stage), vocab_size=vocab,
            max_sequence_length=cfg.seq_length, fp16_lm_cross_entropy=cfg.fp16_lm_cross_entropy,
            parallel_output=cfg.parallel_output,
            share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
            position_embedding_type=cfg.position_embedding_type, rotary_percent=cfg.rotary_percent,
            rotary_base=cfg.rotary_base, rope_scaling=cfg.rope_scaling, rope_scaling_factor=cfg.rope_scaling_factor,
            seq_len_interpolation_factor=cfg.seq_len_interpolation_factor,
            scatter_embedding_sequence_parallel=cfg.scatter_embedding_sequence_parallel,
            pre_process=pre_process, post_process=post_process, pg_collection=pg_collection, vp_stage=vp_stage)
