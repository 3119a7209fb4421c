"""The CPU runner's model set-up after loading: where each float weight lives and which forwards
are compiled, decided once from the config (ModelRunner calls prepare_cpu_models on a CPU device).

  - float weights stored transposed (layers/cpu_weight_layout.py) for the Llama family and EAGLE3
    heads over a Llama layer, when this CPU's one-row GEMV prefers them;
  - an EAGLE3 head's linears packed for fbgemm (layers/cpu_draft_weights.py), its normed
    embedding rows gathered per step, and its step in direct torch calls where it fits
    (models/eagle3_cpu_step.py);
  - with cpu_compile, the target's decode and verify forwards and the head's draft step through
    torch.compile (cpu_compile.py, cpu_compile_head.py).
The batch-invariant mode keeps every weight as loaded (the compiled forwards say what they do in it).
"""

from __future__ import annotations

import torch

from foretell.config import EngineConfig
from foretell.layers.cpu_draft_weights import draft_weight_format, pack_draft_weights
from foretell.layers.cpu_weight_layout import store_weights_transposed, transposed_weights_preferred
from foretell.models.eagle3_cpu_step import cpu_step_fits
from foretell.runner.cpu_compile import install_cpu_compile
from foretell.runner.cpu_compile_head import install_cpu_compile_head
from foretell.spec_decode.proposer import Proposer


def prepare_cpu_models(model: torch.nn.Module, proposer: Proposer | None, config: EngineConfig,
                       device: torch.device, world_size: int) -> None:
    """Lay out the loaded target's and drafter's CPU weights and install the compiled forwards; on
    another device nothing, except that cpu_compile is refused there (install_cpu_compile)."""
    mc = config.model
    on_cpu = device.type == "cpu"
    if on_cpu and not mc.batch_invariant and transposed_weights_preferred():
        store_weights_transposed(cpu_transposable_models(model, proposer))
    if on_cpu and proposer is not None and not mc.batch_invariant and not mc.cpu_compile:
        heads = cpu_packed_draft_heads(proposer)
        pack_draft_weights(heads, draft_weight_format(), exclude=model)
        for head in heads:  # its layer's normed embedding rows, gathered per step (models/eagle3.py)
            head.prepare_cpu_input_table()
        proposer.cpu_direct_step = len(heads) == 1 and cpu_step_fits(heads[0])
    if mc.cpu_compile:
        verify_rows = (1 + config.speculative.num_speculative_tokens,) if config.speculative is not None else ()
        install_cpu_compile(model, device, (1, *verify_rows), world_size, mc.batch_invariant)
        if proposer is not None:
            install_cpu_compile_head(proposer, (1, *verify_rows), world_size, mc.batch_invariant)


def cpu_packed_draft_heads(proposer: Proposer) -> list[torch.nn.Module]:
    """The drafter modules whose CPU weights are packed for fbgemm (cpu_draft_weights.py): EAGLE3
    heads over a Llama layer. A draft model keeps its float32 weights: one that is the target's own
    checkpoint drafts exactly what the target verifies, which tests and A/B runs rely on."""
    from foretell.models.eagle3 import Eagle3Head

    return [m for m in proposer.draft_modules() if type(m) is Eagle3Head]


def cpu_transposable_models(model: torch.nn.Module, proposer: Proposer | None) -> list[torch.nn.Module]:
    """The models whose float weights may be stored transposed on the CPU (cpu_weight_layout.py):
    the Llama family (target or draft model) and the EAGLE3 head over a Llama layer; their code
    never views a weight's memory (MLA's does)."""
    from foretell.models.eagle3 import Eagle3Head
    from foretell.models.llama import LlamaForCausalLM

    drafts = proposer.draft_modules() if proposer is not None else []
    return [m for m in (model, *drafts) if isinstance(m, LlamaForCausalLM) or type(m) is Eagle3Head]
