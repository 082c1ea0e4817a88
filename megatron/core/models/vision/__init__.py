"""Vision encoders (ViT) and the projector that maps their features into a language model."""
