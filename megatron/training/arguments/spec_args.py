"""--spec MODULE NAME: the module spec a model is built from, named as Megatron names it.

Megatron builds GPT and BERT from a transformer layer spec and hybrid models from a stack spec; `--spec` swaps
the default for any ``ModuleSpec`` (or, for GPT, ``TransformerBlockSubmodules``) importable as
``MODULE.NAME``: Megatron's own launch scripts pass
``--spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec`` to pretrain_hybrid.py, which resolves
here to this project's hybrid stack under the same name. ``--spec local`` is the local spec (the default).
The name is resolved while the flags are checked, so a typo is one line before any model is built."""
from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


def add_spec_args(parser):
    g = parser.add_argument_group(title="model spec")
    g.add_argument("--spec", type=str, default=None, nargs="*",
                   help="MODULE NAME of a ModuleSpec to build the model from (the transformer layer spec of GPT "
                        "and BERT, the stack spec of hybrid models), e.g. megatron.core.models.hybrid."
                        "hybrid_layer_specs hybrid_stack_spec; 'local' (or no --spec): the local spec.")
    return parser


def resolve_spec(words):
    """The spec object ``--spec`` names, or None for no --spec / ``local``. Raises ValueError with one line."""
    if words is None or list(words) == ["local"]:
        return None
    if len(words) != 2:
        raise ValueError(f"--spec takes a module and a name (e.g. --spec megatron.core.models.gpt.gpt_layer_specs "
                         f"my_layer_spec) or 'local'; got {' '.join(words) or 'nothing'}")
    module, name = words
    try:
        spec = import_module((module, name))
    except ImportError as e:
        raise ValueError(f"--spec {module} {name}: module {module} cannot be imported ({e}); check the name and "
                         f"PYTHONPATH") from None
    except AttributeError:
        raise ValueError(f"--spec {module} {name}: {module} has no attribute {name}") from None
    if not isinstance(spec, (ModuleSpec, TransformerBlockSubmodules)):
        what = "a function" if callable(spec) else type(spec).__name__
        raise ValueError(f"--spec {module} {name} is {what}, not a ModuleSpec: name the spec object (Megatron builds "
                         f"the model from it as it is, without calling anything)")
    return spec


def validate_spec_args(args, require):
    try:
        resolve_spec(args.spec)
    except ValueError as e:
        require(False, str(e))


def refuse_spec(args, script):
    """Entry points whose models are not built from one layer spec refuse --spec with one line."""
    spec = getattr(args, "spec", None)  # a caller's own namespace may lack it
    if spec is not None and list(spec) != ["local"]:
        raise ValueError(f"{script}: --spec is not read by this model (it is built from its own layer specs); "
                         f"drop the flag")
