"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): its windowed ViT, the patch merger and a Qwen2 decoder with
multimodal RoPE; pretrain_vlm.py --vision-model-type qwen2.5_vit builds it (Qwen25VLModel).

| ours                                                   | Hugging Face (the checkpoint files' names)         |
|--------------------------------------------------------|----------------------------------------------------|
| vision_model.conv1.weight [h, c, t, p, p]              | visual.patch_embed.proj.weight                     |
| vision_model.decoder.layers.{j}.input_layernorm        | visual.blocks.{j}.norm1                            |
| ... self_attention.linear_qkv (per head [q; k; v])     | ... attn.qkv ([q heads; k heads; v heads])         |
| ... self_attention.linear_proj                         | ... attn.proj                                      |
| ... pre_mlp_layernorm                                  | ... norm2                                          |
| ... mlp.linear_fc1 ([gate; up]) / mlp.linear_fc2       | ... mlp.{gate,up}_proj / mlp.down_proj             |
| vision_model.decoder.final_layernorm.weight            | visual.merger.ln_q.weight                          |
| vision_projection.encoder.linear_fc1 / linear_fc2      | visual.merger.mlp.0 / visual.merger.mlp.2          |
| language_model.<Qwen2's table>                         | model.<Qwen2's table>, lm_head                     |

config.json: transformers >= 5 nests the text model under ``text_config`` (rope in ``rope_parameters``
with ``mrope_section``); the Hub's original files keep it at the top level (``rope_scaling`` of type
mrope). Both are read; export writes the nested form, which both transformers 4.5x and 5 load.
"""
from . import qwen2
from .family import Family, Rule, need, rope_theta
from .layout import COPY, GATE_UP, Transform
from .state import expected_shape as text_shape
from .state import shapes_from_flags

VISION_ARCH = "qwen2.5_vit"


def _vision(cfg: dict) -> dict:
    return cfg.get("vision_config") or {}


def _text(cfg: dict) -> dict:
    """The text model's fields (nested or top-level), with the rope reduced to plain RoPE's theta and the
    top-level tie_word_embeddings (the flag transformers reads)."""
    text = dict(cfg.get("text_config") or cfg)
    text.pop("rope_scaling", None)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta(text)}
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return text


def mrope_section(cfg: dict):
    text = cfg.get("text_config") or cfg
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    need(cfg, section is not None and len(section) == 3, "a text rope without a 3-part mrope_section")
    return [int(x) for x in section]


def _heads_qkv(heads: int) -> Transform:
    """HF's fused qkv [3 * heads * d, ...] (all q, all k, all v) <-> ours, per head [q; k; v]."""
    def to_ours(ts, d):
        (t,) = ts
        rest = t.shape[1:]
        return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(-1, *rest)

    def to_hf(t, d):
        rest = t.shape[1:]
        return [t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest).contiguous()]
    return Transform(to_ours, to_hf)


def vision_rules(cfg: dict):
    v = _vision(cfg)
    ours, hf = "vision_model.", "visual."
    qkv = _heads_qkv(v["num_heads"])
    rules = [Rule(ours + "conv1.weight", (hf + "patch_embed.proj.weight",)),
             Rule(ours + "decoder.final_layernorm.weight", (hf + "merger.ln_q.weight",))]
    per_layer = [("input_layernorm.weight", ("norm1.weight",), COPY, 1),
                 ("pre_mlp_layernorm.weight", ("norm2.weight",), COPY, 1)]
    for p in ("weight", "bias"):
        per_layer += [(f"self_attention.linear_qkv.{p}", (f"attn.qkv.{p}",), qkv, 1),
                      (f"self_attention.linear_proj.{p}", (f"attn.proj.{p}",), COPY, 1),
                      (f"mlp.linear_fc1.{p}", (f"mlp.gate_proj.{p}", f"mlp.up_proj.{p}"), GATE_UP, 2),
                      (f"mlp.linear_fc2.{p}", (f"mlp.down_proj.{p}",), COPY, 1)]
    for j in range(v["depth"]):
        for ours_name, hf_names, transform, stride in per_layer:
            rules.append(Rule(f"{ours}decoder.layers.{j}.{ours_name}",
                              tuple(f"{hf}blocks.{j}.{n}" for n in hf_names), transform, stride))
    for ours_name, hf_name in (("linear_fc1", "mlp.0"), ("linear_fc2", "mlp.2")):
        for p in ("weight", "bias"):
            rules.append(Rule(f"vision_projection.encoder.{ours_name}.{p}", (f"{hf}merger.{hf_name}.{p}",)))
    return rules


def rules(cfg: dict):
    _check(cfg)
    glob, layer = qwen2.rules(_text(cfg))
    glob = [Rule("language_model." + r.ours, r.hf, r.transform, r.stride) for r in glob]
    layer = [Rule("language_model." + r.ours, r.hf, r.transform, r.stride) for r in layer]
    return vision_rules(cfg) + glob, layer


def _check(cfg: dict) -> None:
    v, text = _vision(cfg), _text(cfg)
    need(cfg, v.get("hidden_act", "silu") == "silu", f"vision hidden_act {v.get('hidden_act')!r}")
    need(cfg, v.get("in_channels", v.get("in_chans", 3)) == 3, "vision in_channels other than 3")
    vision_rope = v.get("rope_parameters") or {}
    need(cfg, float(vision_rope.get("rope_theta", 10000.0)) == 10000.0, "a vision rope_theta other than 10000")
    need(cfg, v.get("out_hidden_size", text["hidden_size"]) == text["hidden_size"],
         "vision out_hidden_size other than the text hidden_size")
    need(cfg, text.get("hidden_act", "silu") == "silu", f"text hidden_act {text.get('hidden_act')!r}")
    need(cfg, text["hidden_size"] % text["num_attention_heads"] == 0, "a text hidden_size not divisible by heads")
    mrope_section(cfg)


def config_to_flags(cfg: dict):
    """pretrain_vlm.py's flags for this Qwen2.5-VL: Qwen2's, mRoPE, then the ViT's and the merger's."""
    _check(cfg)
    v, text = _vision(cfg), _text(cfg)
    text.pop("head_dim", None)  # Qwen2.5-VL's attention uses hidden / heads whatever head_dim says
    flags = [f for f in qwen2.config_to_flags(text) if f[0] != "--position-embedding-type"]
    m = v.get("spatial_merge_size", 2)
    flags += [("--position-embedding-type", "mrope"), ("--mrope-section", mrope_section(cfg)),
              ("--vision-model-type", VISION_ARCH), ("--patch-dim", v["patch_size"]),
              ("--temporal-patch-size", v.get("temporal_patch_size", 2)), ("--spatial-merge-size", m),
              ("--vision-window-size", v.get("window_size", 112)),
              ("--vision-full-attention-layers", list(v.get("fullatt_block_indexes", []))),
              ("--encoder-num-layers", v["depth"]), ("--vision-hidden-size", v["hidden_size"]),
              ("--vision-ffn-hidden-size", v["intermediate_size"]),
              ("--vision-num-attention-heads", v["num_heads"]), ("--vision-projection-type", "mlp"),
              ("--vision-projection-ffn-hidden-size", v["hidden_size"] * m * m),
              ("--image-token-index", int(cfg.get("image_token_id", 151655)))]
    return flags


def args_to_config(args, vocab_size: int) -> dict:
    """config.json of a Qwen2.5-VL built from pretrain_vlm.py's ``args`` (transformers 5's nested form)."""
    if args.vision_model_type != VISION_ARCH:
        raise ValueError(f"--vision-model-type {args.vision_model_type}: only {VISION_ARCH} has a Qwen2.5-VL "
                         "counterpart")
    text = qwen2.args_to_config(args, vocab_size)
    for k in ("architectures", "rope_scaling", "head_dim"):
        text.pop(k, None)
    text.update(model_type="qwen2_5_vl_text", rope_parameters=dict(
        rope_type="default", rope_theta=float(args.rotary_base), mrope_section=list(args.mrope_section)))
    hidden, m = args.vision_hidden_size or args.hidden_size, args.spatial_merge_size
    if (args.vision_projection_ffn_hidden_size or args.hidden_size) != hidden * m * m:
        raise ValueError(f"--vision-projection-ffn-hidden-size must be the ViT width x merge^2 ({hidden * m * m}) "
                         "for a Qwen2.5-VL patch merger")
    vision = dict(model_type="qwen2_5_vl_vision", depth=args.encoder_num_layers or args.num_layers,
                  hidden_size=hidden, hidden_act="silu", intermediate_size=args.vision_ffn_hidden_size or 4 * hidden,
                  num_heads=args.vision_num_attention_heads or args.num_attention_heads, in_channels=3,
                  patch_size=args.patch_dim, spatial_merge_size=m, temporal_patch_size=args.temporal_patch_size,
                  window_size=args.vision_window_size, out_hidden_size=args.hidden_size,
                  fullatt_block_indexes=list(args.vision_full_attention_layers),
                  rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    return dict(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", text_config=text,
                vision_config=vision, image_token_id=args.image_token_index,
                tie_word_embeddings=text["tie_word_embeddings"])


def expected_shape(name: str, cfg: dict, hidden: int, padded_vocab: int):
    """Global shape of our tensor ``name`` for this config."""
    text = _text(cfg)
    if name.startswith("language_model."):
        text.pop("head_dim", None)
        flags = qwen2.config_to_flags(text)
        return text_shape(name[len("language_model."):], shapes_from_flags(flags, text["vocab_size"], padded_vocab))
    v = _vision(cfg)
    h, f, m = v["hidden_size"], v["intermediate_size"], v.get("spatial_merge_size", 2)
    merged = h * m * m
    table = {"vision_model.conv1.weight": (h, v.get("in_channels", v.get("in_chans", 3)),
                                           v.get("temporal_patch_size", 2), v["patch_size"], v["patch_size"]),
             "vision_projection.encoder.linear_fc1.weight": (merged, merged),
             "vision_projection.encoder.linear_fc1.bias": (merged,),
             "vision_projection.encoder.linear_fc2.weight": (text["hidden_size"], merged),
             "vision_projection.encoder.linear_fc2.bias": (text["hidden_size"],),
             "linear_qkv.weight": (3 * h, h), "linear_qkv.bias": (3 * h,), "linear_proj.weight": (h, h),
             "linear_fc1.weight": (2 * f, h), "linear_fc1.bias": (2 * f,), "linear_fc2.weight": (h, f)}
    for key, shape in table.items():
        if name == key or (not key.startswith("vision_") and name.endswith(key)):
            return shape
    return (h,)  # norms and the remaining biases


FAMILY = Family("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), rules=rules, config_to_flags=config_to_flags,
                args_to_config=args_to_config, expected_shape=expected_shape)
