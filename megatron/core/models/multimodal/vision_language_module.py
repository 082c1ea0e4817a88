"""What every vision-language model here shares: a vision encoder and projector on the first pipeline stage
feeding a ``GPTModel`` decoder (``self.language_model``). The stage flags, the encoder's layout-independent
initialisation, the decoder's pass-throughs the training stack asks for (vocab size, decoder, shared embedding,
the pipeline input) and ``--freeze-LM`` / ``--freeze-ViT`` live here once; each model keeps its own encoder,
input convention and forward."""
from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.transformer.initialize import initialize_parameters
from megatron.core.transformer.module import MegatronModule


class VisionLanguageModule(MegatronModule):
    """Base of LLaVAModel and Qwen25VLModel. Subclasses build ``language_model`` (a GPTModel) and, where
    ``add_encoder``, ``vision_model`` and ``vision_projection``, then call ``_initialize_encoder``."""

    def _set_stage(self, pre_process: bool, post_process: bool, add_encoder: bool, add_decoder: bool,
                   pg_collection, vp_stage, share_embeddings_and_output_weights: bool) -> None:
        """``add_encoder``: this stage holds the ViT and projector; ``pre_process`` / ``post_process``: it
        embeds the text / computes the logits or the loss."""
        self.pre_process, self.post_process = pre_process, post_process
        self.add_encoder, self.add_decoder = add_encoder, add_decoder
        self.pg_collection, self.vp_stage = pg_collection, vp_stage
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.vision_model = self.vision_projection = None

    def _initialize_encoder(self) -> None:
        """Layout-independent values for the encoder parts, named by their path in this model (so the ViT's
        ``decoder.layers.0`` does not draw the language model's numbers); the projector's parameters are
        replicated over TP and reduced with the rest."""
        for p in self.vision_projection.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(p)
            p.allreduce = True
        if self.vision_model.config.perform_initialization:
            self.vision_model.finalize_parameters(name_prefix="vision_model.")
        if self.vision_projection.config.perform_initialization:
            initialize_parameters(self.vision_projection, pg_collection=self.pg_collection,
                                  name_prefix="vision_projection.")

    @property
    def vocab_size(self) -> int:
        return self.language_model.vocab_size

    @property
    def decoder(self):
        return self.language_model.decoder

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    def set_input_tensor(self, input_tensor) -> None:
        """The previous stage's activation; the first stage gets none (its decoder input is built here)."""
        if isinstance(input_tensor, (list, tuple)):
            assert len(input_tensor) == 1, f"{type(self).__name__} takes one input tensor"
            input_tensor = input_tensor[0]
        if not self.pre_process:
            self.language_model.set_input_tensor(input_tensor)

    def freeze(self, freeze_language_model: bool, freeze_vision_model: bool, freeze_vision_projection: bool,
               **kwargs) -> None:
        """requires_grad=False on the chosen parts (--freeze-LM, --freeze-ViT)."""
        parts = [(freeze_language_model, self.language_model), (freeze_vision_model, self.vision_model),
                 (freeze_vision_projection, self.vision_projection)]
        for frozen, module in parts:
            if frozen and module is not None:
                for p in module.parameters():
                    p.requires_grad = False
