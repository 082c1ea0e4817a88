"""Compare our Megatron Core API with Megatron Core 0.19.2's and write docs/api.md.

Megatron's side is read from its wheel with `ast` (never imported, never a dependency) and stored in
docs/api_megatron_0.19.2.json; our side is recomputed by importing our modules and inspecting them, so
tests/unit/compat/test_api_report.py can check docs/api.md offline.

    python tools/api_report.py                 # regenerate docs/api.md from the committed json
    python tools/api_report.py --extract [--wheel PATH]   # re-read the wheel (downloads it without PATH)

Unit of comparison: each public module-level name (function, class, re-export) of the modules in
MODULES. A function's signature, a class's constructor (dataclass fields for dataclasses, members for
enums) must accept every call Megatron's accepts with the same defaults ("same"); extra parameters of
ours with defaults are listed but allowed. Anything else is "differs" (with the differences) or
"absent" (with the reason from tools/api_reasons.py).
"""
import argparse
import ast
import glob
import json
import os
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
JSON_PATH = os.path.join(ROOT, "docs", "api_megatron_0.19.2.json")
MD_PATH = os.path.join(ROOT, "docs", "api.md")
VERSION = "0.19.2"
C = "megatron.core."
T = "megatron.training."
# The modules whose feature we have (issue: Megatron Core's public API).
MODULES = [
    "megatron.core", C + "parallel_state", C + "model_parallel_config", C + "process_groups_config",
    C + "packed_seq_params", C + "enums", C + "config", C + "utils", C + "num_microbatches_calculator",
    C + "optimizer_param_scheduler", C + "timers",
    C + "tensor_parallel", C + "tensor_parallel.layers", C + "tensor_parallel.mappings",
    C + "tensor_parallel.random", C + "tensor_parallel.cross_entropy", C + "tensor_parallel.data",
    C + "tensor_parallel.utils",
    C + "transformer", C + "transformer.transformer_config", C + "transformer.spec_utils",
    C + "transformer.enums", C + "transformer.module", C + "transformer.transformer_block",
    C + "transformer.transformer_layer", C + "transformer.attention", C + "transformer.mlp",
    C + "transformer.identity_op", C + "transformer.dot_product_attention", C + "transformer.torch_norm",
    C + "models.gpt", C + "models.gpt.gpt_model", C + "models.gpt.gpt_layer_specs",
    C + "models.bert.bert_model", C + "models.bert.bert_layer_specs", C + "models.bert.bert_lm_head",
    C + "models.bert.pooler", C + "models.T5", C + "models.T5.t5_model", C + "models.T5.t5_spec",
    C + "models.common.language_module.language_module",
    C + "models.common.embeddings.language_model_embedding",
    C + "models.common.embeddings.rotary_pos_embedding",
    C + "optimizer", C + "optimizer.optimizer", C + "optimizer.optimizer_config",
    C + "optimizer.clip_grads", C + "optimizer.grad_scaler", C + "optimizer.distrib_optimizer",
    C + "distributed", C + "distributed.distributed_data_parallel",
    C + "distributed.distributed_data_parallel_config", C + "distributed.finalize_model_grads",
    C + "distributed.param_and_grad_buffer",
    C + "pipeline_parallel", C + "pipeline_parallel.schedules", C + "pipeline_parallel.p2p_communication",
    C + "dist_checkpointing", C + "dist_checkpointing.serialization", C + "dist_checkpointing.mapping",
    C + "dist_checkpointing.core", C + "dist_checkpointing.dict_utils", C + "dist_checkpointing.validation",
    C + "dist_checkpointing.strategies.torch", C + "dist_checkpointing.strategies.async_utils",
    C + "datasets.blended_megatron_dataset_builder", C + "datasets.blended_megatron_dataset_config",
    C + "datasets.gpt_dataset", C + "datasets.bert_dataset", C + "datasets.t5_dataset",
    C + "datasets.masked_dataset", C + "datasets.indexed_dataset", C + "datasets.megatron_dataset",
    C + "datasets.blended_dataset", C + "datasets.utils", C + "datasets.helpers",
    C + "fusions.fused_bias_dropout", C + "fusions.fused_cross_entropy",
    # Mixture of Experts, multi-latent attention, multi-token prediction.
    C + "transformer.moe.moe_layer", C + "transformer.moe.router", C + "transformer.moe.token_dispatcher",
    C + "transformer.moe.experts", C + "transformer.moe.moe_utils", C + "transformer.moe.shared_experts",
    C + "models.gpt.moe_module_specs", C + "models.backends", C + "transformer.multi_latent_attention",
    C + "transformer.multi_token_prediction", C + "inference.sampling_params",
    "megatron.training", T + "global_vars", T + "arguments", T + "argument_utils", T + "utils",
]


# ---------------------------------------------------------------- Megatron's side (ast)
def fetch_wheel(dest):
    """Download the wheel (it is built for Python 3.12, hence --python-version)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", f"megatron-core=={VERSION}",
                    "--python-version", "3.12", "--only-binary=:all:", "-d", dest], check=True)
    return glob.glob(os.path.join(dest, "megatron_core-*.whl"))[0]


def module_file(src, mod):
    base = os.path.join(src, *mod.split("."))
    return base + "/__init__.py" if os.path.isdir(base) else base + ".py"


def _params(args):
    """[name, kind, default-source-or-None] for an ast.arguments, self/cls dropped later."""
    out = []
    pos = args.posonlyargs + args.args
    defaults = [None] * (len(pos) - len(args.defaults)) + list(args.defaults)
    for a, d in zip(pos, defaults):
        out.append([a.arg, "positional" if a in args.posonlyargs else "pos_or_kw",
                    None if d is None else ast.unparse(d)])
    if args.vararg:
        out.append([args.vararg.arg, "var_positional", None])
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append([a.arg, "kw_only", None if d is None else ast.unparse(d)])
    if args.kwarg:
        out.append([args.kwarg.arg, "var_keyword", None])
    return out


def _top_level(body):
    """Statements at module level, looking inside if/try blocks (optional-dependency definitions)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body + node.orelse + [s for h in node.handlers for s in h.body])
        else:
            yield node


def _is_dataclass(cls):
    return any((isinstance(d, ast.Name) and d.id == "dataclass")
               or (isinstance(d, ast.Call) and getattr(d.func, "id", "") == "dataclass")
               for d in cls.decorator_list)


def _field_default(value):
    if value is None:
        return None
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                return ast.unparse(kw.value)
            if kw.arg == "default_factory":
                return "factory:" + ast.unparse(kw.value)
        return None
    return ast.unparse(value)


class Reader:
    """Parses Megatron's modules lazily and resolves class bases across modules."""

    def __init__(self, src):
        self.src, self.trees, self.imports = src, {}, {}

    def tree(self, mod):
        if mod not in self.trees:
            path = module_file(self.src, mod)
            self.trees[mod] = ast.parse(open(path).read()) if os.path.exists(path) else None
            self.imports[mod] = self._imports(mod)
        return self.trees[mod]

    def _imports(self, mod):
        table, tree = {}, self.trees[mod]
        pkg = mod if module_file(self.src, mod).endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for node in _top_level(tree.body if tree else []):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    table[a.asname or a.name] = base + "." + a.name
            elif isinstance(node, ast.Import):
                for a in node.names:
                    table[a.asname or a.name.split(".")[-1]] = a.name
        return table

    def find_class(self, mod, name, depth=0):
        tree = self.tree(mod)
        for node in _top_level(tree.body if tree else []):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return mod, node
        target = self.imports.get(mod, {}).get(name)
        if target and depth < 5 and target.startswith("megatron."):
            m, n = target.rsplit(".", 1)
            return self.find_class(m, n, depth + 1)
        return None, None

    def describe_class(self, mod, cls):
        bases = [ast.unparse(b) for b in cls.bases]
        if any(b.split(".")[-1] in ("Enum", "IntEnum", "str, Enum") for b in bases):
            members = [t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets
                       if isinstance(t, ast.Name)]
            return {"kind": "enum", "members": members}
        own_init = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
        if _is_dataclass(cls) and not own_init:
            fields = {}
            for b in cls.bases:  # inherited fields come first, as in dataclasses
                bm, bc = self.find_class(mod, ast.unparse(b))
                if bc is not None and _is_dataclass(bc):
                    fields.update(self.describe_class(bm, bc)["fields"])
            for n in cls.body:
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    init_false = isinstance(n.value, ast.Call) and any(
                        k.arg == "init" and ast.unparse(k.value) == "False" for k in n.value.keywords)
                    if "ClassVar" not in ast.unparse(n.annotation) and not init_false:
                        fields[n.target.id] = _field_default(n.value)
            return {"kind": "dataclass", "fields": fields}
        for n in cls.body:
            if isinstance(n, ast.FunctionDef) and n.name == "__init__":
                return {"kind": "class", "params": _params(n.args)[1:]}
        for b in cls.bases:
            bm, bc = self.find_class(mod, ast.unparse(b))
            if bc is not None:
                d = self.describe_class(bm, bc)
                return d if d["kind"] != "enum" else {"kind": "class", "params": None}
        return {"kind": "class", "params": None, "bases": bases}

    def module_names(self, mod):
        tree = self.tree(mod)
        if tree is None:
            return None
        names, funcs = {}, []
        is_pkg = module_file(self.src, mod).endswith("__init__.py")
        for node in _top_level(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                names[node.name] = {"kind": "function", "params": _params(node.args)}
                for d in node.decorator_list:  # @copy_signature(f): the signature users see is f's
                    if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "copy_signature":
                        names[node.name]["params"] = dict(funcs)[ast.unparse(d.args[0])]
                funcs.append((node.name, names[node.name]["params"]))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                names[node.name] = self.describe_class(mod, node)
            elif is_pkg and isinstance(node, (ast.ImportFrom, ast.Import)):
                for a in node.names:
                    name = a.asname or a.name.split(".")[-1]
                    target = self.imports[mod].get(name, "")
                    # Re-exports from the package's own submodules (not helpers it imports for itself).
                    if not name.startswith("_") and target.startswith(mod + ".") and name not in names:
                        names[name] = {"kind": "alias", "target": target}
            elif is_pkg and isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
                for t in node.targets:  # `mpu = parallel_state`
                    if isinstance(t, ast.Name) and node.value.id in names:
                        names[t.id] = dict(names[node.value.id])
        return names


def extract(wheel):
    with tempfile.TemporaryDirectory() as tmp:
        zipfile.ZipFile(wheel).extractall(tmp)
        reader = Reader(tmp)
        modules = {mod: reader.module_names(mod) for mod in MODULES}
    missing = [m for m, v in modules.items() if v is None]
    if missing:
        raise SystemExit(f"modules not in the wheel: {missing}")
    return {"version": VERSION, "modules": modules}


def main():
    from tools.api_compare import compare_all, render_md  # our side needs our package importable
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--extract", action="store_true", help="re-read Megatron's wheel into the json")
    p.add_argument("--wheel", help="path of megatron_core-0.19.2-*.whl (downloaded when absent)")
    a = p.parse_args()
    if a.extract or a.wheel:
        with tempfile.TemporaryDirectory() as tmp:
            data = extract(a.wheel or fetch_wheel(tmp))
        with open(JSON_PATH, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
    with open(JSON_PATH) as f:
        data = json.load(f)
    with open(MD_PATH, "w") as f:
        f.write(render_md(compare_all(data)))
    print(f"wrote {os.path.relpath(MD_PATH, ROOT)}")


if __name__ == "__main__":
    main()
