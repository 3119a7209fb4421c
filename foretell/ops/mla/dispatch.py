"""Which MLA backend a layer gets, by the attention backend's name: "torch" is TorchMLABackend
(reference.py), "triton" TritonMLABackend (triton_attention.py, imported only when asked for: it
imports triton). Unknown names fall back to torch, as the GQA layers' "auto" does off CUDA.
"""

from __future__ import annotations

from foretell.ops.mla.reference import TorchMLABackend


def _triton_mla_backend():
    from foretell.ops.mla.triton_attention import TritonMLABackend  # imports triton

    return TritonMLABackend()


MLA_BACKENDS = {"torch": TorchMLABackend, "triton": _triton_mla_backend}


def build_mla_backend(name: str):
    """The MLA backend for an attention backend name (torch when it has no MLA twin)."""
    return MLA_BACKENDS.get(name, TorchMLABackend)()
