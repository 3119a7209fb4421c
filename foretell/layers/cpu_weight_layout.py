"""Float32 linear weights stored transposed on the CPU where MKL streams them fastest that way.

A Linear's weight is [N, K] (out, in), row-major as checkpoints hold it, and F.linear asks MKL for
x W^T. On Intel CPUs (the measure: a 2-core Xeon with AVX-512, MKL 2024.2) that product costs one
weight read only up to 2-3 rows: at a verify's 4 rows (1 + k) it costs about twice a one-row
GEMV, and the W x^T form (cpu_few_rows.py, which wins on the AMD EPYC it was measured on) costs
twice from 2 rows on. The same product over the weight stored [K, N] (row-major; x @ W_kn, MKL's
no-transpose form) costs one weight read from 1 to 5 rows on that Xeon: a default-family verify
forward of 4 rows takes about the time of a one-row decode forward.

So there, after loading, each float32 Linear and LMHead weight of the Llama-family models and the
EAGLE3 head is re-stored as the transpose of a contiguous [K, N] tensor: the parameter keeps its
[N, K] shape and values (a view with strides (1, N)), F.linear on it runs x @ W_kn, and a tied
embedding's row gather reads the same storage (strided rows). Only the memory order changes; a
row's result may differ in its last bits from the [N, K] form's, as any two GEMM forms' do.

transposed_weights_preferred() decides: FORETELL_CPU_WEIGHT_LAYOUT=transposed or =rows when set,
else transposed on an Intel CPU and rows elsewhere (MKL's AMD path was measured with the rows
layout). Models whose code views a weight's memory (MLA's kv_b_proj) are not passed here.
"""

from __future__ import annotations

import functools
import os
from typing import Iterable

import torch
from torch import nn

from foretell.layers.cpu_few_rows import is_transposed

LAYOUT_ENV = "FORETELL_CPU_WEIGHT_LAYOUT"


@functools.lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"), "" when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def transposed_weights_preferred() -> bool:
    """Whether CPU float32 weights are stored transposed here (the module docstring says why)."""
    asked = os.environ.get(LAYOUT_ENV, "").strip().lower()
    if asked in ("transposed", "rows"):
        return asked == "transposed"
    if asked:
        raise ValueError(f"{LAYOUT_ENV} must be 'transposed' or 'rows', got {asked!r}")
    return cpu_vendor() == "GenuineIntel"


def store_weights_transposed(roots: Iterable[nn.Module]) -> int:
    """Re-store every float32 CPU Linear / LMHead weight under roots (FP8 layers, layers with a
    bound SmallMGemm and weights already transposed left as they are) as the transpose of a
    contiguous [K, N] tensor; returns how many were re-stored. A weight shared by two modules (a
    tied embedding and LM head) is re-stored once and both see it."""
    from foretell.layers.embedding import LMHead
    from foretell.layers.linear import Linear

    done = set()
    for root in roots:
        for module in root.modules():
            if isinstance(module, Linear) and module.is_fp8:
                continue
            if not isinstance(module, (Linear, LMHead)) or module.small_m is not None:
                continue
            weight = module.weight
            if (id(weight) in done or weight.device.type != "cpu" or weight.dtype != torch.float32
                    or weight.dim() != 2 or is_transposed(weight)):
                continue
            with torch.no_grad():
                weight.data = weight.data.t().contiguous().t()  # [N, K] view of [K, N] storage
            done.add(id(weight))
    return len(done)
