"""Mixture of experts: the router and the packed experts, torch reference and Triton kernels."""
