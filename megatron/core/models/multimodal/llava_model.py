"""LLaVAModel: a ViT encoder, a projector and a GPTModel decoder; image features take the places of the
image tokens in the text.

Input convention (Megatron's): each image is ONE token ``image_token_index`` in ``input_ids``; the model
expands it to ``num_tiles * img_seq_len`` positions holding the projected features of that image's tiles,
so the decoder sees a longer, combined sequence. ``labels[t]`` is the target of input position t (the
next token) and ``loss_mask[t]`` whether it counts; on the combined sequence a text position keeps its
label and mask, image positions and the text position just before an image are masked out.

Pipeline parallelism: the encoder and projector live on the first stage with the first decoder layers;
every stage computes the combined labels / loss mask from ``input_ids`` alone, and a pipelined decoder
pads the combined sequence to ``language_max_sequence_length`` (p2p shapes are fixed).
"""
import logging
from typing import List, Optional

import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.multimodal.vision_language_module import VisionLanguageModule
from megatron.core.models.vision.clip_vit_model import CLIPViTModel, get_num_image_embeddings
from megatron.core.models.vision.multimodal_projector import MultimodalProjector

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # Megatron's label for positions without a target
DEFAULT_IMAGE_TOKEN_INDEX = -200  # Megatron's image placeholder id in input_ids
IMAGE_TOKEN = "<image>"


class LLaVAModel(VisionLanguageModule):
    """Vision-language model. ``add_encoder``: this stage holds the ViT and projector (the first pipeline
    stage); ``pre_process`` / ``post_process``: it embeds the text / computes the loss. Forward returns
    ``(output, loss_mask)``: the per-token loss [b, S] with ``labels`` (logits [b, S, V/tp] without) and
    the loss mask on the combined sequence of length S, or hidden states [S, b, h] off the last stage."""

    def __init__(self, language_transformer_config, language_transformer_layer_spec, language_vocab_size: int,
                 language_max_sequence_length: int, vision_transformer_config, vision_transformer_layer_spec,
                 drop_vision_class_token: bool, vision_projection_config, vision_projection_layer_spec,
                 vision_projection_type: str = "mlp", allow_missing_vision_projection_checkpoint: bool = False,
                 parallel_output: bool = True, share_embeddings_and_output_weights: bool = False,
                 language_position_embedding_type: str = "learned_absolute", language_rotary_percent: float = 1.0,
                 pre_process: bool = True, post_process: bool = True, add_encoder: bool = True,
                 add_decoder: bool = True, img_h: int = 336, img_w: int = 336, patch_dim: int = 14,
                 language_rotary_base: int = 10000, language_rope_scaling: bool = False,
                 language_rope_scaling_factor: float = 8.0, fp16_lm_cross_entropy: bool = False,
                 image_token_index: int = DEFAULT_IMAGE_TOKEN_INDEX, pixel_shuffle: bool = False,
                 tile_tags: Optional[list] = None, pg_collection=None, max_num_tiles: int = 0,
                 tokenizer_type: str = "", vp_stage: Optional[int] = None, class_token_len: Optional[int] = None,
                 **kwargs) -> None:
        super().__init__(config=language_transformer_config)
        lc = language_transformer_config
        if not add_decoder:
            raise NotImplementedError("LLaVAModel(add_decoder=False): the encoder lives with the first decoder stage "
                                      "here; every pipeline stage holds decoder layers")
        if pixel_shuffle or tile_tags is not None or allow_missing_vision_projection_checkpoint:
            raise NotImplementedError("LLaVAModel: pixel shuffle, tile tags and "
                                      "allow_missing_vision_projection_checkpoint are not supported")
        if lc.sequence_parallel or lc.context_parallel_size > 1:
            raise ValueError("LLaVA: --sequence-parallel and --context-parallel-size > 1 are not supported yet; "
                             "drop them")
        if getattr(lc, "mtp_num_layers", None):
            raise ValueError("LLaVA: multi-token prediction (--mtp-num-layers) is not supported")
        if vp_stage is not None and lc.virtual_pipeline_model_parallel_size:
            raise ValueError("LLaVA: virtual pipeline stages are not supported; drop "
                             "--num-layers-per-virtual-pipeline-stage")
        vision_type = getattr(vision_transformer_config, "vision_model_type", "clip")
        self._set_stage(pre_process, post_process, add_encoder, add_decoder, pg_collection, vp_stage,
                        share_embeddings_and_output_weights)
        self.image_token_index = image_token_index
        self.patch_dim = patch_dim
        self._language_max_sequence_length = language_max_sequence_length
        self._pipelined = lc.pipeline_model_parallel_size > 1
        self._drop_vision_class_token = drop_vision_class_token
        self.encoder_hidden_state = None

        self.language_model = GPTModel(
            config=lc, transformer_layer_spec=language_transformer_layer_spec, vocab_size=language_vocab_size,
            max_sequence_length=language_max_sequence_length, parallel_output=parallel_output,
            position_embedding_type=language_position_embedding_type, rotary_percent=language_rotary_percent,
            pre_process=pre_process, post_process=post_process, rotary_base=language_rotary_base,
            rope_scaling=language_rope_scaling, rope_scaling_factor=language_rope_scaling_factor,
            fp16_lm_cross_entropy=fp16_lm_cross_entropy, scatter_embedding_sequence_parallel=False,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights, pg_collection=pg_collection,
            vp_stage=vp_stage)

        if class_token_len is None:
            class_token_len = 0 if vision_type == "siglip" else 1
        if vision_type == "siglip" and drop_vision_class_token:
            raise ValueError("SigLIP has no class token to drop; drop --disable-vision-class-token")
        self._class_token_len = class_token_len
        if add_encoder:
            self.vision_model = CLIPViTModel(
                vision_transformer_config, vision_transformer_layer_spec, add_class_token=class_token_len > 0,
                class_token_len=class_token_len, patch_dim=patch_dim, img_h=img_h, img_w=img_w,
                model_subtype=vision_type, pg_collection=pg_collection, vp_stage=vp_stage)
            self.vision_projection = MultimodalProjector(
                vision_projection_config, vision_projection_layer_spec, vision_projection_type,
                vision_transformer_config.hidden_size,
                tp_group=None if pg_collection is None else pg_collection.tp)
            self._initialize_encoder()
        self.img_seq_len = get_num_image_embeddings(img_h, img_w, patch_dim, vision_type, drop_vision_class_token,
                                                    class_token_len)

    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """Image tiles [tiles, c, H, W] -> projected features [tiles, img_seq_len, h] (class token dropped
        with --disable-vision-class-token)."""
        features = self.vision_model(images)  # [tiles, s_v, h_v]
        if self._drop_vision_class_token:
            features = features[:, self._class_token_len:]
        features = features.transpose(0, 1).contiguous()  # [s_v, tiles, h_v]
        return self.vision_projection(features).transpose(0, 1)  # [tiles, s_v, h]

    # ---- generation ------------------------------------------------------------------------------
    def expand_image_tokens(self, tokens: List[int], num_image_tiles: List[int],
                            image_token_index: Optional[int] = None) -> List[int]:
        """A prompt with one image token per image -> the sequence the decoder sees: each image token
        repeated tiles * img_seq_len times (the layout of Hugging Face's LLaVA prompts)."""
        image_token_index = self.image_token_index if image_token_index is None else image_token_index
        count = sum(1 for t in tokens if t == image_token_index)
        if count != len(num_image_tiles):
            raise ValueError(f"the prompt has {count} image tokens ({image_token_index}) for "
                             f"{len(num_image_tiles)} image(s); put one image token per image")
        tiles = iter(num_image_tiles)
        out: List[int] = []
        for t in tokens:
            out += [t] * (next(tiles) * self.img_seq_len) if t == image_token_index else [t]
        return out

    def generate_forward(self, images, input_ids, position_ids, inference_context, image_token_index,
                         runtime_gather_output=None):
        """Logits [b, s or 1, V] of a generation step. Prefill: ``input_ids`` [b, s] hold
        ``expand_image_tokens`` sequences; the image features (``images``: every tile of the batch, in
        order) replace the image-token positions. Decode: text tokens only, straight to the decoder and
        its KV cache (nothing here syncs with the host, so a CUDA graph can replay it)."""
        if self._pipelined:
            raise NotImplementedError("LLaVA generation runs with --pipeline-model-parallel-size 1")
        lm = self.language_model
        if inference_context.is_decode_only() or images is None or not images.numel():
            return lm(input_ids, position_ids, None, inference_context=inference_context,
                      runtime_gather_output=runtime_gather_output)
        is_image = input_ids == image_token_index
        features = self.image_embeddings(images)  # [tiles, img_seq_len, h]
        if int(is_image.sum()) != features.shape[0] * features.shape[1]:
            raise ValueError(f"the prompts hold {int(is_image.sum())} image positions for {features.shape[0]} "
                             f"tile(s) of {features.shape[1]} features; expand each image token with "
                             "expand_image_tokens")
        emb = lm.embedding
        words = emb.word_embeddings(input_ids.masked_fill(is_image, 0))  # [b, s, h]
        # Row-major boolean indexing visits images in batch order, each one's positions in order.
        combined = words.masked_scatter(is_image.unsqueeze(-1), features.reshape(-1, words.size(-1)).to(words.dtype))
        if emb.add_position_embedding:
            combined = combined + emb.position_embeddings(position_ids)
        combined = combined.transpose(0, 1).contiguous()  # [s, b, h]
        if self.config.fp32_residual_connection:
            combined = combined.float()
        return lm(None, position_ids, None, decoder_input=emb.embedding_dropout(combined),
                  inference_context=inference_context, runtime_gather_output=runtime_gather_output)

    # ---- the combined sequence -------------------------------------------------------------------
    def _layout(self, input_ids: torch.Tensor, num_image_tiles: torch.Tensor, image_token_index: int):
        """Where each input token lands: (is_image [b, t], start [b, t], span [b, t], seq_lens [b], S).
        A text token spans 1 position, an image token its tiles * img_seq_len."""
        is_image = input_ids == image_token_index
        n_images = int(is_image.sum())
        if n_images != num_image_tiles.numel():
            raise ValueError(f"the batch has {n_images} image tokens but {num_image_tiles.numel()} images "
                             "(num_image_tiles); every image needs one image token in its sample's text")
        span = torch.ones_like(input_ids)
        span[is_image] = num_image_tiles.to(span.dtype) * self.img_seq_len  # row-major: images in batch order
        end = torch.cumsum(span, dim=1)
        seq_lens = end[:, -1]
        length = int(seq_lens.max())
        if self._pipelined:  # p2p shapes are fixed: always the full length
            length = self._language_max_sequence_length
        return is_image, end - span, seq_lens, min(length, self._language_max_sequence_length)

    def _combined_embeddings(self, image_embeddings, input_ids, is_image, start, seq_lens, length):
        """Text embeddings at text positions, image features at image positions: [S, b, h]."""
        emb = self.language_model.embedding
        b, t = input_ids.shape
        text_ids = input_ids.masked_fill(is_image, 0)
        words = emb.word_embeddings(text_ids)  # [b, t, h]
        full = int(seq_lens.max())
        combined = words.new_zeros(b, max(full, length), words.size(-1))
        rows, cols = torch.nonzero(~is_image, as_tuple=True)
        combined = combined.index_put((rows, start[rows, cols]), words[rows, cols])
        if image_embeddings is not None and image_embeddings.numel():
            positions = torch.arange(combined.size(1), device=input_ids.device).unsqueeze(0)
            image_mask = positions < seq_lens.unsqueeze(1)
            image_mask[rows, start[rows, cols]] = False
            # Row-major boolean indexing visits images in batch order, each one's positions in order.
            combined = combined.masked_scatter(image_mask.unsqueeze(-1),
                                               image_embeddings.reshape(-1, combined.size(-1)).to(combined.dtype))
        combined = combined[:, :length]
        if emb.add_position_embedding:  # learned positions count the combined sequence
            combined = combined + emb.position_embeddings.weight[:length].unsqueeze(0)
        combined = combined.transpose(0, 1).contiguous()  # [S, b, h]
        if self.config.fp32_residual_connection:
            combined = combined.float()
        return emb.embedding_dropout(combined)

    def _combined_targets(self, labels, loss_mask, is_image, start, length):
        """Labels and loss mask on the combined sequence [b, S]. Masked positions get label 0 (in every
        vocabulary shard's range) instead of IGNORE_INDEX: the mask removes them from the loss."""
        b, t = labels.shape
        out_labels = labels.new_zeros(b, length)
        out_mask = loss_mask.new_zeros(b, length)
        before_image = torch.zeros_like(is_image)
        before_image[:, :-1] = is_image[:, 1:]
        keep = ~is_image & (start < length)
        rows, cols = torch.nonzero(keep, as_tuple=True)
        pos = start[rows, cols]
        out_labels[rows, pos] = labels[rows, cols]
        out_mask[rows, pos] = loss_mask[rows, cols] * (~before_image[rows, cols]).to(loss_mask.dtype)
        return out_labels, out_mask

    def forward(self, images: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: Optional[torch.Tensor], labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, inference_context=None,
                num_image_tiles: Optional[List[int]] = None, image_token_index: Optional[int] = None,
                runtime_gather_output: Optional[bool] = None, packed_seq_params=None, **kwargs):
        """``images`` [tiles, c, H, W] (every tile of every image of the batch, in order), ``input_ids``
        [b, t] with one ``image_token_index`` per image, ``num_image_tiles`` [images] (1 each when None).
        With an ``inference_context`` (generation) ``input_ids`` are already expanded: see ``generate_forward``."""
        if packed_seq_params is not None:
            raise NotImplementedError("LLaVAModel: packed sequences are not supported")
        image_token_index = self.image_token_index if image_token_index is None else image_token_index
        if inference_context is not None:
            return self.generate_forward(images, input_ids, position_ids, inference_context, image_token_index,
                                         runtime_gather_output), None
        n_images = int((input_ids == image_token_index).sum())
        if num_image_tiles is None:
            num_image_tiles = torch.ones(n_images, dtype=torch.long, device=input_ids.device)
        num_image_tiles = torch.as_tensor(num_image_tiles, device=input_ids.device).long()
        is_image, start, seq_lens, length = self._layout(input_ids, num_image_tiles, image_token_index)

        decoder_input = None
        if self.pre_process:
            image_embeddings = None
            if self.add_encoder and images is not None and images.numel():
                image_embeddings = self.image_embeddings(images)
            decoder_input = self._combined_embeddings(image_embeddings, input_ids, is_image, start, seq_lens,
                                                      length)
        combined_labels = combined_mask = None
        if labels is not None:
            if loss_mask is None:
                loss_mask = torch.ones_like(labels, dtype=torch.float)
            combined_labels, combined_mask = self._combined_targets(labels, loss_mask, is_image, start, length)
        output = self.language_model(input_ids=None, position_ids=None, attention_mask=attention_mask,
                                     decoder_input=decoder_input, labels=combined_labels,
                                     runtime_gather_output=runtime_gather_output)
        return output, combined_mask
