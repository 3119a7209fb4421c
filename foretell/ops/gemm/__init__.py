"""Few-row GEMMs (decode and verify): Triton GEMV and MMA kernels, and SmallMGemm, which picks."""
