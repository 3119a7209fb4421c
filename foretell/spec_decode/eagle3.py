"""EAGLE3 drafting: the head reads the target's aux hidden states and keeps its own KV cache.

Which target layers feed it ("input of layer i" = HF hidden_states[i] = the residual stream
entering layer i), in order of precedence:
  1. speculative_config["eagle3_aux_layer_ids"] / --eagle3-aux-layer-ids: read as inputs of
     layers i (vLLM's reading of its own flag);
  2. the head's eagle_config.eagle_aux_hidden_state_layer_ids (also read at the top level):
     read as SpecForge and SGLang write them, "output of layer j", so we capture the input of
     layer j + 1 (SpecForge's default [1, N//2 - 1, N - 4] is inputs 2, N//2, N - 3);
  3. the default inputs of layers 2, N//2, N - 3.

The head is replicated on every tensor-parallel rank unless speculative_config
draft_tensor_parallel_size is the target's tensor_parallel_size: then its layers and vocabulary
split like the target's (models/eagle3.py). Whenever the lm_head in use is split by vocabulary
(that head's own, or the target's shared one under the target's tensor parallelism), greedy
batches draft with each rank's row maxima and gather no logits (greedy_without_logits).
"""

from __future__ import annotations

import torch
from torch import nn

from foretell.device_util import to_device
from foretell.distributed.tensor_parallel import TensorParallel
from foretell.loader import checkpoint_keys, load_weights
from foretell.models.base import HFConfig, ModelOptions
from foretell.models.eagle3 import Eagle3Head
from foretell.models.eagle3_cpu_step import eagle3_cpu_step
from foretell.spec_decode.draft_loop import DraftLoopProposer, catch_up_rows
from foretell.spec_decode.proposer import DraftBatch

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


def resolve_aux_layers(flag_ids, head_config: HFConfig, num_layers: int) -> tuple[int, ...]:
    if flag_ids is not None:
        ids, source = tuple(int(i) for i in flag_ids), "eagle3_aux_layer_ids"
    else:
        eagle = head_config.get("eagle_config") or {}
        written = eagle.get("eagle_aux_hidden_state_layer_ids") or head_config.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        if written:
            ids = tuple(int(j) + 1 for j in written)
            source = f"{head_config.source} eagle_aux_hidden_state_layer_ids {list(written)} (+1)"
        else:
            ids, source = default_aux_layers(num_layers), "default"
    if len(ids) != 3 or any(not 0 <= i < num_layers for i in ids):
        raise ValueError(
            f"EAGLE3 aux layers {list(ids)} (from {source}) must be 3 layer inputs in "
            f"[0, {num_layers}) for a target with {num_layers} layers"
        )
    return ids


class Eagle3Proposer(DraftLoopProposer):
    method = "eagle3"
    row_offset = -1
    tree_draft_graphs = True
    head_class: type[Eagle3Head] = Eagle3Head
    # A catch-up whose rows draft nothing (a prompt chunk, a step before one that drafts nothing)
    # runs head.cache_kv: fc, the layer input and the keys and values only. False: the whole
    # layer over every row, as before (for comparisons; the same cache bits where
    # layers/attention/kv_only.py runs the whole q|k|v projection: everywhere but CUDA).
    kv_only_catch_up = True

    def __init__(self, config, target_hf_config: HFConfig, options: ModelOptions):
        super().__init__(config.num_speculative_tokens)
        target_hf_config = target_hf_config.language_model()
        self.folder = config.model
        self.head_config = HFConfig.from_folder(config.model)
        archs = self.head_config.get("architectures") or []
        if not any(a in EAGLE3_ARCHITECTURES for a in archs):
            raise ValueError(
                f"{self.head_config.source}: architectures {archs} is not an EAGLE3 head; expected "
                f"one of {list(EAGLE3_ARCHITECTURES)}"
            )
        self.target_hidden = target_hf_config.hidden_size
        self.target_vocab = target_hf_config.vocab_size
        self.target_max_positions = target_hf_config.get("max_position_embeddings", 2048)
        self.aux_hidden_state_layers = resolve_aux_layers(
            config.eagle3_aux_layer_ids, self.head_config, target_hf_config.num_hidden_layers
        )
        draft_vocab = self.head_config.get("draft_vocab_size", self.head_config.vocab_size)
        if draft_vocab > self.target_vocab:
            raise ValueError(
                f"{self.head_config.source}: draft_vocab_size {draft_vocab} is larger than the "
                f"target's vocab_size {self.target_vocab}"
            )
        declared = self.head_config.get("target_hidden_size", self.target_hidden)
        if declared != self.target_hidden:
            raise ValueError(
                f"{self.head_config.source}: target_hidden_size {declared} does not match the "
                f"target's hidden_size {self.target_hidden}; this head was trained for another target"
            )
        target_tp = options.tensor_parallel
        config.check_draft_tensor_parallel(target_tp.world_size)
        head_tp = target_tp if config.draft_tensor_parallel_size > 1 else TensorParallel()
        self.options = ModelOptions(options.dtype, options.device, options.attention_backend, tensor_parallel=head_tp)
        self.init_loop(options.device, self.target_vocab)
        self.head: Eagle3Head | None = None
        # The head's compiled CPU step when the runner installs one (--cpu-compile: runner/cpu_compile_head.py)
        self.cpu_head_step = None
        # Whether the head's step runs as direct torch calls on the CPU (models/eagle3_cpu_step.py; the runner sets it)
        self.cpu_direct_step = False

    @classmethod
    def from_config(cls, config, target_hf_config, options) -> "Eagle3Proposer":
        return cls(config, target_hf_config, options)

    def load(self, target: nn.Module, load_format: str = "auto") -> None:
        dummy = load_format == "dummy"
        keys = {} if dummy else checkpoint_keys(self.folder)
        has_embed = any(k.endswith("embed_tokens.weight") for k in keys)
        has_lm_head = dummy or "lm_head.weight" in keys
        target_width = target.get_input_embeddings().weight.shape[1]
        if not has_embed and self.head_config.hidden_size != target_width:
            raise ValueError(
                f"{self.folder}: the head's hidden_size {self.head_config.hidden_size} differs "
                f"from the target's embedding width {target_width} and it ships no "
                f"embed_tokens.weight to use instead"
            )
        fc_shape = keys.get("fc.weight")
        if fc_shape is not None and fc_shape[1] != 3 * self.target_hidden:
            raise ValueError(
                f"{self.folder}: fc.weight has input width {fc_shape[1]}, expected 3 x target "
                f"hidden = {3 * self.target_hidden}"
            )
        head = self.head_class(
            self.head_config, self.target_hidden, self.target_max_positions,
            self.options, has_embed, has_lm_head,
        )
        if not has_lm_head and head.draft_vocab_size != self.target_vocab:
            raise ValueError(
                f"{self.folder} has no lm_head.weight and a draft vocabulary of "
                f"{head.draft_vocab_size} != the target's {self.target_vocab}, so it cannot share "
                f"the target's lm_head"
            )
        load_weights(head, self.folder, load_format)
        head.share(target.get_input_embeddings(), target.get_output_embeddings())
        target_ids = head.target_ids()
        outside = (target_ids < 0) | (target_ids >= self.target_vocab)
        if bool(outside.any()):
            bad = int(torch.nonzero(outside)[0])
            raise ValueError(
                f"{self.folder}: d2t maps draft id {bad} to target id {int(target_ids[bad])}, "
                f"outside the target vocabulary [0, {self.target_vocab})"
            )
        self.head = head.eval()
        self.target_id_map = target_ids
        self.greedy_without_logits = head.splits_vocabulary

    def kv_layers(self) -> list[nn.Module]:
        return self.head.attention_layers()

    def draft_modules(self) -> list[nn.Module]:
        return [self.head]

    @property
    def draft_dtype(self) -> torch.dtype:
        return self.options.dtype

    def to_target_probs(self, probs: torch.Tensor) -> torch.Tensor:  # [n, Vd] -> [n, Vt]
        out = probs.new_zeros(probs.shape[0], self.target_vocab)
        return out.index_copy_(1, self.target_id_map, probs)

    def catch_up(self, batch: DraftBatch, last_rows: list[int], greedy_only: bool = False):
        input_ids, positions, metadata = catch_up_rows(batch, self.row_offset, self.draft_block_size)
        if not last_rows:  # nothing drafts: only the rows' keys and values are wanted
            g = self.head.combine(batch.aux_hidden_states)  # [n, H]
            if self.kv_only_catch_up:
                self.head.cache_kv(input_ids, positions, g, metadata)
            else:
                self.head(input_ids, positions, g, metadata)
            return None, None
        if list(last_rows) == list(range(batch.num_seqs)):  # every sequence drafts: no upload
            keep_rows = metadata.query_start_loc[1:] - 1  # [B] int32 (index_select takes it)
        else:
            ends = [metadata.query_start_loc_cpu[i + 1] - 1 for i in last_rows]
            keep_rows = to_device(ends, torch.int64, self.device)
        stepped = self._head_step(input_ids, positions, metadata, keep_rows, greedy_only, aux=batch.aux_hidden_states)
        return self._drafts(stepped, greedy_only)

    def padded_catch_up(self, input_ids, positions, metadata, hidden, aux, last_rows, greedy_only: bool = False):
        return self._drafts(self._head_step(input_ids, positions, metadata, last_rows, greedy_only, aux=aux),
                            greedy_only)

    def chain_step(self, tokens, positions, metadata, state, greedy_only: bool = False):
        return self._drafts(self._head_step(tokens, positions, metadata, greedy_only=greedy_only, g=state), greedy_only)

    def tree_step(self, tokens, positions, state, metadata):
        """The head's step as it is (the CPU's direct and compiled steps take no tree mask)."""
        return self.head.step(tokens, positions, state, metadata)

    def _head_step(self, input_ids, positions, metadata, keep_rows=None, greedy_only=False, *, g=None, aux=None):
        """head.step from g (the previous h) or from the aux hidden states (fc first), through the
        compiled CPU step when one is installed (it runs head.step itself where a step does not fit),
        or its direct torch calls on the CPU (cpu_direct_step: the same bits)."""
        if self.cpu_head_step is not None and not greedy_only:
            return self.cpu_head_step(input_ids, positions, metadata, keep_rows, g=g, aux=aux)
        if self.cpu_direct_step and not greedy_only:
            return eagle3_cpu_step(self.head, input_ids, positions, metadata, keep_rows, g=g, aux=aux)
        return self.head.step(input_ids, positions, self.head.combine(aux) if g is None else g, metadata, keep_rows,
                              greedy_only)

    def _drafts(self, stepped, greedy_only: bool):
        """The head's (logits [m, draft_vocab], h) as they are, or with greedy_only its (greedy draft
        ids [m], h) as (target ids [m] int64, h)."""
        out, h = stepped
        return (self.to_target_ids(out) if greedy_only else out), h
