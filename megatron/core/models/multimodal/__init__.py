"""Vision-language models: an image encoder feeding a language model (LLaVA)."""
