"""Which MLA backend a layer gets, by the attention backend's name: "torch" is TorchMLABackend
(reference.py), "triton" TritonMLABackend (triton_backend.py, imported only when asked for: it
imports triton). Unknown names fall back to torch, as the GQA layers' "auto" does off CUDA.
The batch-invariant mode's GQA backends ("torch_batch_invariant", "triton_batch_invariant") give
their MLA layers the batch-invariant twins: BatchInvariantTorchMLABackend (batch_invariant.py) and
BatchInvariantTritonMLABackend (batch_invariant_triton.py, graph safe; imported only when asked for).
"""

from __future__ import annotations

from foretell.ops.mla.batch_invariant import BatchInvariantTorchMLABackend
from foretell.ops.mla.reference import TorchMLABackend


def _triton_mla_backend():
    from foretell.ops.mla.triton_backend import TritonMLABackend  # imports triton

    return TritonMLABackend()


def _triton_batch_invariant_mla_backend():
    from foretell.ops.mla.batch_invariant_triton import BatchInvariantTritonMLABackend  # imports triton

    return BatchInvariantTritonMLABackend()


MLA_BACKENDS = {
    "torch": TorchMLABackend,
    "triton": _triton_mla_backend,
    "torch_batch_invariant": BatchInvariantTorchMLABackend,
    "triton_batch_invariant": _triton_batch_invariant_mla_backend,
}


def build_mla_backend(name: str):
    """The MLA backend for an attention backend name (torch when it has no MLA twin)."""
    return MLA_BACKENDS.get(name, TorchMLABackend)()
