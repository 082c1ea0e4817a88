"""Megatron's megatron.training.argument_utils: the args -> config builders (TransformerConfig, GPTModelConfig,
the pretrain / inference config containers), and ArgumentGroupFactory, which turns a config dataclass into
an argparse group (one flag per field)."""
import ast
import dataclasses
import enum
import inspect
import types
import typing
import warnings
from argparse import ArgumentParser
from typing import Any, Dict, Optional

from megatron.core.transformer.spec_utils import import_module
from megatron.training.arguments.configs import (
    config_kwargs_from_args,
    core_transformer_config_from_args,
    ddp_config_from_args,
    optimizer_config_from_args,
)
from megatron.training.config import (
    CheckpointConfig,
    DistributedInitConfig,
    InferenceConfigContainer,
    InferenceSetupConfig,
    LoggerConfig,
    PretrainConfigContainer,
    ProfilingConfig,
    RerunStateMachineConfig,
    RNGConfig,
    SchedulerConfig,
    StragglerDetectionConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron.training.models import GPTModelConfig


class TypeInferenceError(Exception):
    """A field's annotation has no argparse counterpart (a Union of several types, a mixed list...)."""


class ArgumentGroupFactory:
    """Adds one flag per field of the dataclass `src_cfg_class` (except `exclude`) to a parser:
    `--field-name`, default the field's default, help its attribute docstring. Types: T and Optional[T]
    -> type=T; list[T] -> nargs='+'; Literal[...] -> choices; an Enum -> the member named on the
    command line; bool -> store_true, or for a True default store_false under --no-<name> /
    --disable-<name>. A field's metadata["argparse_meta"] (add_argument kwargs, plus "arg_names")
    overrides what is inferred; without it an annotation outside these raises TypeInferenceError."""

    def __init__(self, src_cfg_class: type, exclude: Optional[list] = None) -> None:
        self.src_cfg_class = src_cfg_class
        self.field_docstrings = self._get_field_docstrings(src_cfg_class)
        self.exclude = set(exclude or ())

    @staticmethod
    def _format_arg_name(config_attr_name: str, prefix: Optional[str] = None) -> str:
        return "--" + (f"{prefix}_{config_attr_name}" if prefix else config_attr_name).replace("_", "-")

    def _extract_type(self, config_type) -> Dict[str, Any]:
        origin, args = typing.get_origin(config_type), typing.get_args(config_type)
        if isinstance(config_type, type) and issubclass(config_type, enum.Enum):
            return {"type": lambda name: config_type[name], "choices": list(config_type)}
        if origin is None:
            return {"type": config_type}
        if origin in (typing.Union, types.UnionType):
            if len(args) == 2 and type(None) in args:
                return self._extract_type(args[0] if args[1] is type(None) else args[1])
            raise TypeInferenceError(f"Unions not supported by argparse: {config_type}")
        if origin is list and len(args) == 1:
            return {**self._extract_type(args[0]), "nargs": "+"}
        if origin is typing.Literal and len({type(a) for a in args}) == 1:
            return {"type": type(args[0]), "choices": args}
        raise TypeInferenceError(f"Unsupported type: {config_type}")

    def _build_argparse_kwargs_from_field(self, attribute) -> Dict[str, Any]:
        default = attribute.default_factory() if attribute.default is dataclasses.MISSING else attribute.default
        kwargs = {"arg_names": [self._format_arg_name(attribute.name)], "dest": attribute.name,
                  "help": self.field_docstrings.get(attribute.name, ""), "default": default}
        meta = attribute.metadata.get("argparse_meta") if attribute.metadata else None
        try:
            kwargs.update(self._extract_type(attribute.type))
            if kwargs.get("type") is bool:
                kwargs.pop("type")
                kwargs["action"] = "store_true" if not default else "store_false"
                if default:
                    kwargs["arg_names"] = [self._format_arg_name(attribute.name, "no"),
                                           self._format_arg_name(attribute.name, "disable")]
        except TypeInferenceError:
            if meta is None:
                raise
        kwargs.update(meta or {})
        return kwargs

    def build_group(self, parser: ArgumentParser, title: Optional[str] = None):
        """Add the group (titled `title`, described by the class docstring) to `parser` and return it."""
        group = parser.add_argument_group(title=title, description=self.src_cfg_class.__doc__)
        for attribute in dataclasses.fields(self.src_cfg_class):
            if attribute.name in self.exclude or not attribute.init:
                continue
            kwargs = self._build_argparse_kwargs_from_field(attribute)
            group.add_argument(*kwargs.pop("arg_names"), **kwargs)
        return group

    def _get_field_docstrings(self, src_cfg_class: type) -> Dict[str, str]:
        """{field: the string literal right below its annotation}, from this class and its bases."""
        docs = {}
        for cls in reversed([c for c in src_cfg_class.__mro__ if dataclasses.is_dataclass(c)]):
            try:
                body = ast.parse(inspect.cleandoc("\n" + inspect.getsource(cls))).body[0].body
            except (OSError, TypeError, SyntaxError):
                continue
            for a, b in zip(body, body[1:]):
                if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr) \
                        and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
                    docs[a.target.id] = " ".join(inspect.cleandoc(b.value.value).split())
        return docs


# ------------------------------------------------ Megatron 0.19's config containers from parsed args


def _config(cls: type, args):
    """``cls`` with every field that ``args`` has under the same name."""
    return cls(**config_kwargs_from_args(cls, args))


def gpt_config_from_args(args, config=None, model_config_cls: type = GPTModelConfig):
    """A GPTModelConfig (or a subclass adding no fields) from args; ``config``: the TransformerConfig
    to use instead of the one the flags describe."""
    if not issubclass(model_config_cls, GPTModelConfig):
        raise TypeError(f"gpt_config_from_args: {model_config_cls.__name__} is not a GPTModelConfig")
    kwargs = {"transformer": config if config is not None else core_transformer_config_from_args(args)}
    if args.spec:
        kwargs["transformer_layer_spec"] = import_module(args.spec)
    padded = args.padded_vocab_size
    if padded is None and args.vocab_size is None:
        raise ValueError("gpt_config_from_args: either --padded-vocab-size or --vocab-size must be specified")
    return model_config_cls(
        **kwargs, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        seq_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        vocab_size=padded if padded is not None else args.vocab_size, should_pad_vocab=padded is None)


def _checkpoint_and_profiling(args):
    ckpt = config_kwargs_from_args(CheckpointConfig, args)
    ckpt.update(save_optim=not args.no_save_optim, save_rng=not args.no_save_rng, load_optim=not args.no_load_optim,
                load_rng=not args.no_load_rng, fully_parallel_save=args.ckpt_fully_parallel_save,
                fully_parallel_load=args.ckpt_fully_parallel_load)
    prof = config_kwargs_from_args(ProfilingConfig, args)
    prof["use_nsys_profiler"] = args.profile
    return CheckpointConfig(**ckpt), ProfilingConfig(**prof)


def pretrain_cfg_container_from_args(args, model_cfg=None) -> PretrainConfigContainer:
    """Every section of a pretraining run from the parsed args (``model_cfg``: e.g. gpt_config_from_args(args);
    None keeps the model to a model_provider function, with Megatron's warning)."""
    if model_cfg is None:
        warnings.warn("It is recommended to use a ModelConfig (e.g. megatron.training.models.GPTModelConfig) "
                      "instead of a model builder/model provider function pointer.")
    checkpoint, profiling = _checkpoint_and_profiling(args)
    rerun = config_kwargs_from_args(RerunStateMachineConfig, args)
    rerun["check_for_nan_in_loss"] = args.check_for_nan_in_loss_and_grad
    return PretrainConfigContainer(
        train=_config(TrainingConfig, args),
        validation=_config(ValidationConfig, args), model=model_cfg,
        optimizer=optimizer_config_from_args(args), scheduler=_config(SchedulerConfig, args),
        ddp=ddp_config_from_args(args), dist=_config(DistributedInitConfig, args),
        rng=_config(RNGConfig, args), logger=_config(LoggerConfig, args),
        checkpoint=checkpoint, profiling=profiling, tokenizer=_config(TokenizerConfig, args),
        rerun_state_machine=RerunStateMachineConfig(**rerun),
        straggler=_config(StragglerDetectionConfig, args))


def inference_cfg_from_args(args) -> InferenceSetupConfig:
    """The inference flags as one InferenceSetupConfig (field names are the flags' destinations)."""
    return _config(InferenceSetupConfig, args)


def inference_cfg_container_from_args(args, model_cfg=None) -> InferenceConfigContainer:
    """What an inference entry point needs (no optimizer, schedule, training loop or DDP sections);
    ``model_cfg`` None: gpt_config_from_args(args)."""
    if model_cfg is None:
        if args.hybrid_layer_pattern is not None:
            raise ValueError("inference_cfg_container_from_args: --hybrid-layer-pattern (hybrid Mamba models) is "
                             "not supported; build a GPT model")
        model_cfg = gpt_config_from_args(args)
    checkpoint, profiling = _checkpoint_and_profiling(args)
    return InferenceConfigContainer(
        model=model_cfg, checkpoint=checkpoint, inference=inference_cfg_from_args(args),
        dist=_config(DistributedInitConfig, args), rng=_config(RNGConfig, args),
        tokenizer=_config(TokenizerConfig, args),
        logger=_config(LoggerConfig, args), profiling=profiling)
