"""State-space and linear-attention sequence mixers (Mamba-2, Gated DeltaNet) and their layers."""
