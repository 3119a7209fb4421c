"""Tensor parallelism's plumbing below the layers: the rank's place in its group and the
collectives the parallel layers call (tensor_parallel.py), and starting a process group
(process_group.py). Imports nothing of the package; layers and models take a TensorParallel
through ModelOptions, never from a module-level global."""
