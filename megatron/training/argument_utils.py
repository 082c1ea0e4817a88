"""Megatron's megatron.training.argument_utils: the args -> config builders, and ArgumentGroupFactory,
which turns a config dataclass into an argparse group (one flag per field)."""
import ast
import dataclasses
import enum
import inspect
import types
import typing
from argparse import ArgumentParser
from typing import Any, Dict, Optional

from megatron.training.arguments.configs import core_transformer_config_from_args  # noqa: F401


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
