"""LLaVA (LlavaForConditionalGeneration): a CLIP ViT, a two-layer GeLU projector and a Llama / Mistral decoder.

| ours                                                  | Hugging Face                                            |
|-------------------------------------------------------|---------------------------------------------------------|
| vision_model.conv1.weight                             | vision_tower.embeddings.patch_embedding.weight          |
| vision_model.class_token [1, 1, h]                    | vision_tower.embeddings.class_embedding [h]             |
| vision_model.position_embeddings.weight               | vision_tower.embeddings.position_embedding.weight       |
| vision_model.ln_pre.{weight,bias}                     | vision_tower.pre_layrnorm.{weight,bias}                 |
| vision_model.decoder.layers.{j}.input_layernorm       | vision_tower.encoder.layers.{j}.layer_norm1             |
| ... self_attention.linear_qkv (per head [q; k; v])    | ... self_attn.{q,k,v}_proj                              |
| ... self_attention.linear_proj                        | ... self_attn.out_proj                                  |
| ... pre_mlp_layernorm / mlp.linear_fc1 / linear_fc2   | ... layer_norm2 / mlp.fc1 / mlp.fc2                     |
| vision_projection.encoder.linear_fc1 / linear_fc2     | multi_modal_projector.linear_1 / linear_2               |
| language_model.<Llama's table>                        | language_model.model.<Llama's table>, language_model.lm_head |

HF reads the features of ViT layer ``vision_feature_layer`` (-2: the second to last) without the post-norm;
ours uses all its layers, so import keeps the layers up to that one and export writes
``vision_feature_layer: -1`` and an identity ``post_layernorm``. ``vision_feature_select_strategy``
"default" drops the class token (--disable-vision-class-token), "full" keeps it. HF's text holds
``image_seq_length`` image tokens per image, ours one (--image-token-index) that the model expands.
"""
import torch

from . import llama, mistral
from .family import Family, Rule, UnsupportedConfig, need
from .layout import COPY, Dims, Transform, _fuse_qkv, _split_qkv
from .state import expected_shape as text_shape
from .state import shapes_from_flags

TEXT_FAMILIES = {"llama": llama, "mistral": mistral}
CLASS_TOKEN = Transform(lambda ts, d: ts[0].reshape(1, 1, -1), lambda t, d: [t.reshape(-1).contiguous()])


def _vision(cfg: dict) -> dict:
    return cfg.get("vision_config") or {}


def _text(cfg: dict) -> dict:
    return cfg.get("text_config") or {}


def vision_layers(cfg: dict) -> int:
    """The ViT layers LLaVA reads: up to ``vision_feature_layer`` (hidden_states[k] is after k layers)."""
    n, k = _vision(cfg)["num_hidden_layers"], cfg.get("vision_feature_layer", -2)
    if not isinstance(k, int):
        raise UnsupportedConfig(f"config.json: vision_feature_layer {k} (several layers) is not supported")
    return n + 1 + k if k < 0 else k


def _vision_dims(cfg: dict) -> Dims:
    v = _vision(cfg)
    heads = v["num_attention_heads"]
    return Dims(heads, heads, v["hidden_size"] // heads, 0, 0)


def _vision_qkv(cfg: dict) -> Transform:
    dims = _vision_dims(cfg)  # the ViT's heads, not the language model's that the converter passes
    return Transform(lambda ts, d: _fuse_qkv(ts, dims), lambda t, d: _split_qkv(t, dims))


def vision_rules(cfg: dict):
    e, ours = "vision_tower.embeddings.", "vision_model."
    qkv = _vision_qkv(cfg)
    rules = [Rule(ours + "conv1.weight", (e + "patch_embedding.weight",)),
             Rule(ours + "class_token", (e + "class_embedding",), CLASS_TOKEN),
             Rule(ours + "position_embeddings.weight", (e + "position_embedding.weight",)),
             Rule(ours + "ln_pre.weight", ("vision_tower.pre_layrnorm.weight",)),
             Rule(ours + "ln_pre.bias", ("vision_tower.pre_layrnorm.bias",))]
    per_layer = [("input_layernorm.{p}", ("layer_norm1.{p}",), COPY),
                 ("self_attention.linear_qkv.{p}", tuple(f"self_attn.{x}_proj.{{p}}" for x in "qkv"), qkv),
                 ("self_attention.linear_proj.{p}", ("self_attn.out_proj.{p}",), COPY),
                 ("pre_mlp_layernorm.{p}", ("layer_norm2.{p}",), COPY),
                 ("mlp.linear_fc1.{p}", ("mlp.fc1.{p}",), COPY), ("mlp.linear_fc2.{p}", ("mlp.fc2.{p}",), COPY)]
    for j in range(vision_layers(cfg)):
        for ours_name, hf_names, transform in per_layer:
            for p in ("weight", "bias"):
                rules.append(Rule(f"{ours}decoder.layers.{j}." + ours_name.format(p=p),
                                  tuple(f"vision_tower.encoder.layers.{j}." + n.format(p=p) for n in hf_names),
                                  transform))
    for ours_name, hf_name in (("linear_fc1", "linear_1"), ("linear_fc2", "linear_2")):
        for p in ("weight", "bias"):
            rules.append(Rule(f"vision_projection.encoder.{ours_name}.{p}", (f"multi_modal_projector.{hf_name}.{p}",)))
    return rules


def _text_family(cfg: dict):
    kind = _text(cfg).get("model_type", "llama")
    if kind not in TEXT_FAMILIES:
        raise UnsupportedConfig(f"config.json: text_config model_type {kind!r} is not supported (llama or mistral)")
    return TEXT_FAMILIES[kind]


def rules(cfg: dict):
    _check(cfg)
    glob, layer = llama.rules(_text(cfg))
    prefix = {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."}

    def hf(name):
        for a, b in prefix.items():
            if name.startswith(a):
                return b + name[len(a):]
        return name
    glob = [Rule("language_model." + r.ours, tuple(hf(n) for n in r.hf), r.transform, r.stride) for r in glob]
    layer = [Rule("language_model." + r.ours, tuple(hf(n) for n in r.hf), r.transform, r.stride) for r in layer]
    return vision_rules(cfg) + glob, layer


def _check(cfg: dict) -> None:
    v = _vision(cfg)
    need(cfg, v.get("model_type", "clip_vision_model") == "clip_vision_model",
         f"vision model {v.get('model_type')!r} (only CLIP)")
    need(cfg, v.get("hidden_act", "quick_gelu") == "quick_gelu", f"vision hidden_act {v.get('hidden_act')!r}")
    need(cfg, float(v.get("layer_norm_eps", 1e-5)) == 1e-5, "vision layer_norm_eps other than 1e-5")
    need(cfg, v.get("num_channels", 3) == 3, "vision num_channels other than 3")
    need(cfg, cfg.get("projector_hidden_act", "gelu") == "gelu",
         f"projector_hidden_act {cfg.get('projector_hidden_act')!r}")
    need(cfg, cfg.get("multimodal_projector_bias", True), "multimodal_projector_bias=false")
    need(cfg, cfg.get("vision_feature_select_strategy", "default") in ("default", "full"),
         f"vision_feature_select_strategy {cfg.get('vision_feature_select_strategy')!r}")


def config_to_flags(cfg: dict):
    """pretrain_vlm.py's flags for this LLaVA: the text model's, then the vision and projector ones."""
    _check(cfg)
    v = _vision(cfg)
    flags = _text_family(cfg).config_to_flags(_text(cfg))
    flags += [("--vision-model-type", "clip"), ("--img-h", v["image_size"]), ("--img-w", v["image_size"]),
              ("--patch-dim", v["patch_size"]), ("--encoder-num-layers", vision_layers(cfg)),
              ("--vision-hidden-size", v["hidden_size"]), ("--vision-ffn-hidden-size", v["intermediate_size"]),
              ("--vision-num-attention-heads", v["num_attention_heads"]),
              ("--vision-projection-type", "mlp"),
              ("--vision-projection-ffn-hidden-size", _text(cfg)["hidden_size"]),
              ("--image-token-index", int(cfg.get("image_token_index", cfg.get("image_token_id", 32000))))]
    if cfg.get("vision_feature_select_strategy", "default") == "default":
        flags.append(("--disable-vision-class-token", None))
    return flags


def args_to_config(args, vocab_size: int) -> dict:
    """config.json of a LLaVA built from pretrain_vlm.py's ``args``."""
    if args.vision_model_type != "clip":
        raise ValueError(f"--vision-model-type {args.vision_model_type}: only CLIP ViTs have a LLaVA counterpart")
    if args.vision_projection_type != "mlp":
        raise ValueError("--vision-projection-type affine has no LLaVA counterpart (a 2-layer GeLU MLP)")
    text_family = mistral if getattr(args, "window_size", None) is not None else llama
    text = text_family.args_to_config(args, vocab_size)
    text.pop("architectures", None)
    text["model_type"] = "mistral" if text_family is mistral else "llama"
    if args.img_h != args.img_w:
        raise ValueError(f"--img-h {args.img_h} != --img-w {args.img_w}: CLIP's config has one image_size")
    hidden = args.vision_hidden_size or args.hidden_size
    vision = dict(model_type="clip_vision_model", hidden_size=hidden, image_size=args.img_h,
                  patch_size=args.patch_dim, num_hidden_layers=args.encoder_num_layers or args.num_layers,
                  num_attention_heads=args.vision_num_attention_heads or args.num_attention_heads,
                  intermediate_size=args.vision_ffn_hidden_size or 4 * hidden, hidden_act="quick_gelu",
                  layer_norm_eps=1e-5, num_channels=3, attention_dropout=0.0)
    if (args.vision_projection_ffn_hidden_size or args.hidden_size) != args.hidden_size:
        raise ValueError("--vision-projection-ffn-hidden-size other than --hidden-size has no LLaVA counterpart")
    return dict(architectures=["LlavaForConditionalGeneration"], model_type="llava", text_config=text,
                vision_config=vision, image_token_index=args.image_token_index, projector_hidden_act="gelu",
                multimodal_projector_bias=True, vision_feature_layer=-1,
                vision_feature_select_strategy="default" if args.disable_vision_class_token else "full",
                tie_word_embeddings=text["tie_word_embeddings"],
                image_seq_length=(args.img_h // args.patch_dim) * (args.img_w // args.patch_dim)
                + (0 if args.disable_vision_class_token else 1))


def expected_shape(name: str, cfg: dict, hidden: int, padded_vocab: int):
    """Global shape of our tensor ``name`` for this config."""
    if name.startswith("language_model."):
        flags = _text_family(cfg).config_to_flags(_text(cfg))
        return text_shape(name[len("language_model."):],
                          shapes_from_flags(flags, _text(cfg)["vocab_size"], padded_vocab))
    v = _vision(cfg)
    h, f, text_h = v["hidden_size"], v["intermediate_size"], _text(cfg)["hidden_size"]
    positions = (v["image_size"] // v["patch_size"]) ** 2 + 1
    table = {"vision_model.conv1.weight": (h, 3, v["patch_size"], v["patch_size"]),
             "vision_model.class_token": (1, 1, h), "vision_model.position_embeddings.weight": (positions, h),
             "vision_projection.encoder.linear_fc1.weight": (text_h, h),
             "vision_projection.encoder.linear_fc1.bias": (text_h,),
             "vision_projection.encoder.linear_fc2.weight": (text_h, text_h),
             "vision_projection.encoder.linear_fc2.bias": (text_h,),
             "linear_qkv.weight": (3 * h, h), "linear_qkv.bias": (3 * h,), "linear_proj.weight": (h, h),
             "linear_fc1.weight": (f, h), "linear_fc1.bias": (f,), "linear_fc2.weight": (h, f)}
    for key, shape in table.items():
        if name == key or (not key.startswith("vision_") and name.endswith(key)):
            return shape
    return (h,)  # norms and the remaining biases


def post_layernorm(cfg: dict):
    """HF's unused ViT post-norm as identity tensors (export)."""
    h = _vision(cfg)["hidden_size"]
    return {"vision_tower.post_layernorm.weight": torch.ones(h), "vision_tower.post_layernorm.bias": torch.zeros(h)}


FAMILY = Family("llava", ("LlavaForConditionalGeneration",), rules=rules, config_to_flags=config_to_flags,
                args_to_config=args_to_config, expected_shape=expected_shape, extra_hf_tensors=post_layernorm)
