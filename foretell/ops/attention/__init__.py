"""Paged GQA attention: metadata, torch reference, Triton kernels and the backends over them."""
