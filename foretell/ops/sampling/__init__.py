"""Sampling kernels: row-wise argmax over a large vocabulary."""
