"""Multi-head latent attention (DeepSeek, Kimi): torch reference, Triton kernels, backend choice."""
