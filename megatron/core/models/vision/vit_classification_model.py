"""VitClassificationModel: a ViT image classifier (Megatron's legacy name): a CLIP-style ``CLIPViTModel``
backbone, a final LayerNorm, and the legacy MLP head on the class token (dense_in, tanh, dense_out).

Images [n, c, H, W] -> logits [n, num_classes]. The head is small and replicated on every TP rank: its
input (the backbone's output after the row-parallel all-reduce) is identical there, so its gradients are too.
"""
from typing import Optional

import torch

from megatron.core.models.common.vision_module.vision_module import VisionModule
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.utils import get_device

HEAD_BIAS_INIT = -10.0  # Megatron's VitMlpHead starts every class at a low logit


class VitMlpHead(torch.nn.Module):
    """Class-token features [n, h] -> logits [n, num_classes]: dense_in (h -> h), tanh, dense_out."""

    def __init__(self, config, hidden_size: int, num_classes: int):
        super().__init__()
        device = torch.device("cpu") if config.use_cpu_initialization else get_device()
        self.dense_in = torch.nn.Linear(hidden_size, hidden_size, device=device, dtype=config.params_dtype)
        self.dense_out = torch.nn.Linear(hidden_size, num_classes, device=device, dtype=config.params_dtype)
        self.dense_in.weight.init_fn = self.dense_out.weight.init_fn = config.init_method
        self.dense_in.bias.init_fn = torch.nn.init.zeros_
        self.dense_out.bias.init_fn = lambda t: torch.nn.init.constant_(t, HEAD_BIAS_INIT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_out(torch.tanh(self.dense_in(x)))


class VitClassificationModel(VisionModule):
    """``transformer_config``: the ViT's (its hidden size, layers, heads, TP); ``transformer_layer_spec``:
    the non-causal ViT layer (``get_vit_layer_with_local_spec()``). Parameter names: ``backbone.*`` (the
    CLIPViTModel's), ``final_layernorm``, ``head.dense_in`` / ``head.dense_out``."""

    def __init__(self, transformer_config, transformer_layer_spec: ModuleSpec, num_classes: int,
                 img_h: int = 224, img_w: int = 224, patch_dim: int = 16, num_channels: int = 3,
                 class_token_len: int = 1, norm_impl=WrappedTorchNorm, pg_collection=None,
                 vp_stage: Optional[int] = None) -> None:
        super().__init__(config=transformer_config)
        if num_classes < 1:
            raise ValueError(f"--num-classes {num_classes} must be >= 1")
        if class_token_len < 1:
            raise ValueError("VitClassificationModel classifies from the class token; class_token_len must be >= 1")
        if transformer_config.pipeline_model_parallel_size > 1:
            raise ValueError("ViT classification runs with --pipeline-model-parallel-size 1 (use TP or DP)")
        self.num_classes = num_classes
        self.backbone = CLIPViTModel(transformer_config, transformer_layer_spec, add_class_token=True,
                                     class_token_len=class_token_len, patch_dim=patch_dim, img_h=img_h, img_w=img_w,
                                     model_subtype="clip", pg_collection=pg_collection, vp_stage=vp_stage,
                                     num_channels=num_channels)
        self.pg_collection = self.backbone.pg_collection
        self.final_layernorm = build_module(norm_impl, config=transformer_config,
                                            hidden_size=transformer_config.hidden_size,
                                            eps=transformer_config.layernorm_epsilon)
        self.head = VitMlpHead(transformer_config, transformer_config.hidden_size, num_classes)
        # Values from (seed, name) for the whole model; the backbone's own init used its unprefixed names.
        self.finalize_parameters()

    def set_input_tensor(self, input_tensor) -> None:
        self.backbone.set_input_tensor(input_tensor)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Images [n, c, H, W] -> logits [n, num_classes] (fp32 math is the caller's choice)."""
        features = self.backbone(images)  # [n, s, h]
        return self.head(self.final_layernorm(features[:, 0]))  # the (first) class token
