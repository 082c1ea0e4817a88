"""Qwen25VLModel: Qwen2.5-VL's ViT, its patch merger and a Qwen2 decoder with multimodal RoPE.

Input convention (Hugging Face's, unlike LLaVAModel's one token per image): ``input_ids`` already hold
one ``image_token_index`` per merged image feature (t * h * w / merge^2 per image, as the Qwen2-VL
processor expands its ``<|image_pad|>``), so the decoder sees the text's own length; the features replace
those tokens' embeddings in order. ``images`` are the processor's flattened patches [N, c*t*p*p] of every
image of the batch, with ``image_grid_thw`` [images, 3]. Position ids are the three-component mRoPE ids of
``get_rope_index`` unless given. ``labels[t]`` / ``loss_mask[t]`` are the target and weight of position t.

Pipeline parallelism: the encoder and projector live on the first stage; every stage computes the position
ids from ``input_ids`` and ``image_grid_thw``.
"""
from typing import Iterable, Optional

import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.multimodal.qwen25_vl_rope_index import get_rope_index
from megatron.core.models.multimodal.vision_language_module import VisionLanguageModule
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.qwen25_vl_vit_model import Qwen25VLVisionModel


class Qwen25VLModel(VisionLanguageModule):
    """Vision-language model. ``add_encoder``: this stage holds the ViT and projector (the first pipeline
    stage); ``pre_process`` / ``post_process``: it embeds the text / computes logits or the loss. Forward
    returns ``(output, loss_mask)``: the per-token loss [b, s] with ``labels`` (logits [b, s, V/tp]
    without), hidden states on stages without ``post_process``."""

    def __init__(self, language_transformer_config, language_transformer_layer_spec, language_vocab_size: int,
                 language_max_sequence_length: int, vision_transformer_config, vision_transformer_layer_spec,
                 vision_projection_config, vision_projection_layer_spec, parallel_output: bool = True,
                 share_embeddings_and_output_weights: bool = False, language_rotary_base: int = 1000000,
                 fp16_lm_cross_entropy: bool = False, pre_process: bool = True, post_process: bool = True,
                 add_encoder: bool = True, add_decoder: bool = True, patch_dim: int = 14,
                 temporal_patch_size: int = 2, spatial_merge_size: int = 2, window_size: int = 112,
                 full_attention_layers: Iterable[int] = (7, 15, 23, 31), vision_rotary_base: float = 10000.0,
                 image_token_index: int = 151655, pg_collection=None, vp_stage: Optional[int] = None) -> None:
        lc = language_transformer_config
        super().__init__(config=lc)
        if not add_decoder:
            raise NotImplementedError("Qwen25VLModel without a decoder (add_decoder=False) is not supported")
        self._set_stage(pre_process, post_process, add_encoder, add_decoder, pg_collection, vp_stage,
                        share_embeddings_and_output_weights)
        self.image_token_index, self.spatial_merge_size = image_token_index, spatial_merge_size
        self.language_model = GPTModel(
            config=lc, transformer_layer_spec=language_transformer_layer_spec, vocab_size=language_vocab_size,
            max_sequence_length=language_max_sequence_length, parallel_output=parallel_output,
            position_embedding_type="mrope", rotary_base=language_rotary_base, pre_process=pre_process,
            post_process=post_process, fp16_lm_cross_entropy=fp16_lm_cross_entropy,
            scatter_embedding_sequence_parallel=False,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights, pg_collection=pg_collection,
            vp_stage=vp_stage)
        if add_encoder:
            self.vision_model = Qwen25VLVisionModel(
                vision_transformer_config, vision_transformer_layer_spec, patch_dim=patch_dim,
                temporal_patch_size=temporal_patch_size, spatial_merge_size=spatial_merge_size,
                window_size=window_size, full_attention_layers=full_attention_layers,
                rotary_base=vision_rotary_base, pg_collection=pg_collection, vp_stage=vp_stage)
            self.vision_projection = MultimodalProjector(
                vision_projection_config, vision_projection_layer_spec, "mlp",
                vision_transformer_config.hidden_size * spatial_merge_size ** 2,
                tp_group=None if pg_collection is None else pg_collection.tp)
            self._initialize_encoder()

    def image_embeddings(self, images: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Patches [N, c*t*p*p] -> projected features [N / merge^2, h], images in order."""
        merged = self.vision_model(images, image_grid_thw)  # [N / m^2, h_v * m^2]
        return self.vision_projection(merged.unsqueeze(1)).squeeze(1)  # [N / m^2, h]

    def position_ids(self, input_ids: torch.Tensor, image_grid_thw, attention_mask=None) -> torch.Tensor:
        """mRoPE position ids [3, b, s] of ``input_ids`` (see ``get_rope_index``)."""
        return get_rope_index(input_ids, image_grid_thw, self.image_token_index, self.spatial_merge_size,
                              attention_mask)[0]

    def _decoder_input(self, images, input_ids, image_grid_thw):
        """Text embeddings with the image features at the image-token positions: [s, b, h]."""
        emb = self.language_model.embedding
        is_image = input_ids == self.image_token_index
        words = emb.word_embeddings(input_ids.masked_fill(is_image, 0))  # [b, s, h]
        if images is not None and images.numel():
            if not self.add_encoder:
                raise ValueError("images given to a Qwen25VLModel stage without the vision encoder")
            features = self.image_embeddings(images, image_grid_thw)
            if int(is_image.sum()) != features.shape[0]:
                raise ValueError(f"the tokens hold {int(is_image.sum())} image tokens ({self.image_token_index}) "
                                 f"for {features.shape[0]} image features; expand each image to t*h*w/merge^2 "
                                 "tokens as the Qwen2-VL processor does")
            # Row-major boolean indexing visits images in batch order, each one's positions in order.
            words = words.masked_scatter(is_image.unsqueeze(-1), features.to(words.dtype))
        elif bool(is_image.any()):
            raise ValueError(f"the tokens hold {int(is_image.sum())} image tokens but no images were given")
        combined = words.transpose(0, 1).contiguous()  # [s, b, h]
        if self.config.fp32_residual_connection:
            combined = combined.float()
        return emb.embedding_dropout(combined)

    def forward(self, images: Optional[torch.Tensor], input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                attention_mask: Optional[torch.Tensor], labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, image_grid_thw: Optional[torch.Tensor] = None,
                inference_context=None, runtime_gather_output: Optional[bool] = None, packed_seq_params=None,
                **kwargs):
        """``position_ids`` [3, b, s] or None (computed from ``input_ids`` and ``image_grid_thw``)."""
        if packed_seq_params is not None:
            raise NotImplementedError("Qwen25VLModel: packed sequences are not supported")
        if inference_context is not None:
            raise NotImplementedError("Qwen25VLModel: generation is not supported yet")
        if position_ids is None or position_ids.dim() != 3:
            position_ids = self.position_ids(input_ids, image_grid_thw)
        decoder_input = None
        if self.pre_process:
            decoder_input = self._decoder_input(images, input_ids, image_grid_thw)
        output = self.language_model(input_ids=None, position_ids=position_ids, attention_mask=attention_mask,
                                     decoder_input=decoder_input, labels=labels,
                                     runtime_gather_output=runtime_gather_output)
        return output, loss_mask
