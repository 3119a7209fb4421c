"""Per-row ops of a decoder layer (RMSNorm, RoPE, SiLU-and-mul, the EAGLE3 input): kernels and twins."""
