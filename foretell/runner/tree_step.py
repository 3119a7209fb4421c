"""The draft-tree step (speculative_config topk > 1, issue 28): verify every sequence's tree in one
target forward, accept a path, move its K/V into place, draft the next trees.

A tree of T = num_draft_tokens nodes reaches the scheduler as T - 1 draft tokens in tree order
(topologically ordered, siblings best first); the runner keeps the tree's structure per sequence
until its verify. The scheduler runs it like a chain: 1 + (T - 1) rows at consecutive cache slots,
advanced by the accepted count. Near max_model_len it keeps a prefix of the list, which is a
smaller tree (a node's ancestors come before it); near max_tokens a greedy request keeps every row
and an accept_limit (the path is cut there), others keep a prefix.

One step (the runner's only step under model drafters' trees; a host drafter's tree-less steps: host_tree_steps.py):
  1. the batch as build_input_batch makes it, with each tree's rows at position root + depth
     (RoPE sees the depth, the cache the tree index) and an ancestor mask over the sequence's last
     keys, its tree rows (AttentionMetadata.tree_mask; rows of other sequences all-true, i.e. causal);
     a batch of whole trees only runs the target as the replay of its (bucket, T) graph
     (runner/tree_graphs.py; uncaptured off CUDA), any other batch (and every batch under
     enforce_eager or an attention backend that is not graph-safe) eagerly;
  2. greedy trees: verify_greedy_paths (the longest path the target's argmax agrees with); sampled:
     verify_sampled_paths (multi-draft rejection sampling, one-hot q for top-k drafts) over the
     processed target probabilities, every tree of a group at once (tree/path_verify.py);
     sequences without a tree (prefill chunks, requests whose logits are processed or that ask
     for logprobs: they draft nothing) sample as HostStep does;
  3. the accepted path's target K/V moved to consecutive positions (tree/compact.py); rejected
     nodes' slots lie past the sequence's length and are overwritten by later steps;
  4. the drafter catches up over the path's rows and drafts the next trees (tree/proposer.py; a host
     drafter's from the token lists: tree/host_drafter.py, no catch-up, no draft graphs). After
     a graphed verify where every sequence drafts whatever it accepts, before the step's one host
     read: the paths padded to depth + 1 rows, catch-up and expansion as one replay of the
     drafter's graph from the verify's device outputs (TreeDraftGraphs.run_after_verify); else
     after the read, HostStep.draft_batch's path rows, the eager catch-up and the expansion's graph.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from foretell.device_util import to_device
from foretell.engine.scheduler import SchedulerOutput
from foretell.layers.attention.layer import Attention
from foretell.layers.sampler import SamplingBatch, processed_probs, row_seed
from foretell.ops.step.kv_moves import KVMoveTargets, move_kv_slots
from foretell.runner.host_drafts import token_draft_batch
from foretell.runner.host_step import HostStep
from foretell.runner.input_batch import InputBatch, build_input_batch
from foretell.runner.logprobs import add_prompt_logprobs
from foretell.runner.sequence_result import SequenceResult
from foretell.runner.tree_graphs import TreeVerifyGraphs
from foretell.runner.tree_group import TreeGroup
from foretell.spec_decode.tree.compact import compaction_slots
from foretell.spec_decode.tree.draft_graphs import TreeDraftGraphs
from foretell.spec_decode.tree.host_drafter import HostTreeDrafter
from foretell.spec_decode.tree.proposer import ModelTreeDrafter
from foretell.spec_decode.tree.shape import DraftTree, TreeShape
from foretell.spec_decode.tree.simulated import rank_logprobs, simulated_tree_accept
from foretell.spec_decode.tree.path_verify import verify_greedy_paths, verify_sampled_paths
from foretell.spec_decode.tree.verify import TreeVerifyResult

TREE_SEED_SALT = 0x7EE5EED
logger = logging.getLogger("foretell")


class TreeStep:
    def __init__(self, model, proposer, host_step: HostStep, target_forward, config, block_size: int,
                 device: torch.device, tensor_parallel: bool, verify_graphs: TreeVerifyGraphs | None = None):
        spec = config.speculative
        if tensor_parallel:
            raise ValueError("draft trees (speculative_config topk > 1) run on one rank for now: "
                             "use tensor_parallel_size 1 or topk 1")
        if config.model.batch_invariant:
            raise ValueError("draft trees (speculative_config topk > 1) are not batch-invariant yet: "
                             "turn batch_invariant off or use topk 1")
        layers = [*model.attention_layers(), *proposer.kv_layers()]
        if not all(type(layer) is Attention for layer in layers):
            raise ValueError("draft trees (speculative_config topk > 1) need GQA attention in the target "
                             "and the drafter (Llama / Qwen3 layouts) for now; MLA has no tree mask yet")
        self.shape = TreeShape(spec.num_speculative_tokens, spec.topk, spec.num_draft_tokens)
        self.model = model
        self.host_step = host_step
        self.target_forward = target_forward  # the runner's (graphs when a batch fits), for tree-less steps
        self.verify_graphs: TreeVerifyGraphs | None = None  # whole-tree batches' verify forward (None: eager)
        self.num_graphed_verifies = 0  # tree verifies run on verify_graphs (replayed or uncaptured)
        self.draft_s = 0.0  # the last step's host time drafting after its read (StepTimes.draft_s)
        # Simulated acceptance (tree/simulated.py): the verifier's draws, per-depth rates for the best
        # path, and trees shaped as a draft calibrated to those rates would shape them.
        verifier = host_step.verifier
        self.draws = verifier.draws if verifier.synthetic else None
        self.rates = None if self.draws is None else torch.tensor(self.draws.rates, dtype=torch.float64, device=device)
        shaped = None if self.draws is None else rank_logprobs(self.shape, self.draws.rates).to(device)
        # A host drafter (suffix) drafts its trees from token lists (tree/host_drafter.py); else a model
        # drafter (EAGLE3, a draft LM: tree/proposer.py).
        self.host_trees = proposer.capabilities.drafts_from_tokens
        self.drafter = HostTreeDrafter(proposer, self.shape, device) if self.host_trees \
            else ModelTreeDrafter(proposer, self.shape, shaped)
        self.block_size = block_size
        self.device = device
        self.trees: dict[int, DraftTree] = {}  # seq_id -> its drafted tree [1, T], until its verify
        self.tree_tokens: dict[int, list[int]] = {}  # seq_id -> that tree's tokens, read once when drafted
        self.tree_depths: dict[int, list[int]] = {}  # seq_id -> its nodes' depths, read with the tokens
        self.kv_moves: KVMoveTargets | None = None  # the target layers' caches, for one-launch compaction
        self.generator = torch.Generator(device=device)  # unseeded sampled trees' draws
        self.generator.manual_seed(config.model.seed ^ TREE_SEED_SALT)
        if verify_graphs is not None:
            self.use_graphs(verify_graphs)

    def use_graphs(self, verify_graphs: TreeVerifyGraphs) -> None:
        """Verify whole-tree batches on verify_graphs and draft on graphs of the same buckets,
        captured now (after the target's, in their pool) when verify_graphs is, else uncaptured
        over the same buffers; a drafter backend that reads host lengths drafts on exact buckets."""
        self.verify_graphs = verify_graphs
        if self.host_trees or not self.drafter.proposer.tree_draft_graphs:  # (suffix, a draft LM: drafted eagerly)
            return
        graph_safe = all(layer.backend.graph_safe for layer in self.drafter.proposer.kv_layers())
        draft_graphs = TreeDraftGraphs(
            self.drafter, verify_graphs.buckets, verify_graphs.block_table.shape[1], self.block_size,
            verify_graphs.max_model_len, self.device, capture_graphs=verify_graphs.captures,
            reads_host_lengths=verify_graphs.reads_host_lengths or not graph_safe, pool=verify_graphs.pool)
        try:
            draft_graphs.capture()
        except RuntimeError as e:  # the same buffers, uncaptured
            logger.warning("tree draft graph capture failed, drafting trees uncaptured: %s", e)
            torch.cuda.synchronize(self.device)
        self.drafter.graphs = draft_graphs

    # ---- the step ----------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> list[SequenceResult]:
        batch = build_input_batch(sched.scheduled, self.block_size, self.device)
        results = [SequenceResult() for _ in sched.scheduled]
        groups = self._scheduled_trees(sched, batch)
        graphed = False  # the verify ran on its graph: whole trees only (the graphed catch-up's input)
        if groups:
            batch = self._tree_batch(batch, groups)
            hidden, aux, logits, graphed = self._verify_forward(batch)  # logits [sampling rows, vocab] float32
        else:
            hidden, aux, logits = self.target_forward(batch)
        add_prompt_logprobs(self.model, sched, batch, hidden, results)
        path_rows, drafted = self._sample(sched, batch, logits, groups, results, aux if graphed else None)
        self.draft_s = 0.0  # the host's drafting after the read (a graphed draft ran before it)
        if not drafted:
            start = time.perf_counter()
            self._draft(sched, batch, hidden, aux, results, path_rows)
            self.draft_s = time.perf_counter() - start
        return results

    def forget(self, seq_id: int) -> None:
        self.trees.pop(seq_id, None)
        self.tree_tokens.pop(seq_id, None)
        self.tree_depths.pop(seq_id, None)

    # ---- 1. inputs -----------------------------------------------------------------------------
    def _scheduled_trees(self, sched: SchedulerOutput, batch: InputBatch) -> list[TreeGroup]:
        """The step's trees, cut to the drafts the scheduler kept, stacked by node count (one group
        unless a tree was cut near max_model_len)."""
        by_size: dict[int, list[tuple[int, DraftTree]]] = {}
        for i, item in enumerate(sched.scheduled):
            tree = self.trees.pop(item.seq.seq_id, None)
            tokens = self.tree_tokens.pop(item.seq.seq_id, None)
            depths = self.tree_depths.pop(item.seq.seq_id, None)
            drafts = item.draft_token_ids
            if not drafts:
                continue
            num_nodes = len(drafts) + 1
            root = item.seq.token_ids[item.seq.num_computed_tokens + item.num_new_tokens - num_nodes]
            if tree is None or num_nodes > tree.num_nodes or tokens[:num_nodes] != [root, *drafts]:  # (no device read)
                raise RuntimeError(f"sequence {item.seq.request_id!r} carries drafts that are not its drafted tree")
            by_size.setdefault(num_nodes, []).append((i, tree.cut(num_nodes), depths[:num_nodes]))
        groups = []
        for num_nodes, members in by_size.items():
            index = [i for i, _, _ in members]
            root_rows = [batch.query_start[i + 1] - num_nodes for i in index]  # each sequence's last real row
            groups.append(TreeGroup(index, DraftTree.stack([t for _, t, _ in members]), root_rows,
                                    [batch.position_list[r] for r in root_rows], [d for _, _, d in members]))
        return groups

    def _tree_batch(self, batch: InputBatch, groups: list[TreeGroup]) -> InputBatch:
        """Tree rows at position root + depth, and the ancestor mask over every sequence's last W
        keys (W: the largest tree; a tree's nodes are its sequence's last keys; all-true rows elsewhere)."""
        positions = list(batch.position_list)
        for g in groups:
            num_nodes = g.tree.num_nodes
            for root_row, root_position, depths in zip(g.root_rows, g.root_positions, g.depths):
                positions[root_row: root_row + num_nodes] = [root_position + d for d in depths]
        tree_batch = replace(batch, position_list=positions)
        g = groups[0]
        if len(groups) == 1 and batch.num_tokens == len(g.index) * g.tree.num_nodes:
            # Whole trees only (the graphed verify's batches): the rows are the trees' nodes in order,
            # so the mask is the trees' ancestor masks as they are (a view; no launch).
            mask = g.tree.ancestor_mask.reshape(batch.num_tokens, g.tree.num_nodes)
            tree_batch.attn_metadata = replace(batch.attn_metadata, tree_mask=mask)
            return tree_batch
        width = max(g.tree.num_nodes for g in groups)
        mask = torch.ones(batch.num_tokens, width, dtype=torch.bool, device=self.device)
        for g in groups:
            num_nodes = g.tree.num_nodes
            nodes = torch.arange(num_nodes, device=self.device)
            rows = to_device(g.root_rows, torch.int64, self.device).unsqueeze(1) + nodes  # [n, T]
            cols = width - num_nodes + nodes  # [T]: the mask columns of the sequence's last T keys
            mask[rows.unsqueeze(2), cols] = g.tree.ancestor_mask  # one scatter for the group
        tree_batch.attn_metadata = replace(batch.attn_metadata, tree_mask=mask)  # (a cached property)
        return tree_batch

    def _verify_forward(self, batch: InputBatch):
        """(hidden, aux, logits of the sampling rows, graphed) of the tree batch: its graph's replay
        when every sequence verifies a whole tree (T rows; graphed True), else an eager forward."""
        key = self.verify_graphs.bucket_for(batch) if self.verify_graphs is not None else None
        if key is None:
            hidden, aux = self.model(batch.input_ids, batch.positions, batch.attn_metadata)
            return hidden, aux, self.model.compute_logits(hidden[batch.logits_rows]), False
        captured, rows = self.verify_graphs.run_tree(batch, key), batch.num_tokens
        self.num_graphed_verifies += 1
        logits = captured.logits[:rows] if batch.every_row_samples else captured.logits[:rows][batch.logits_rows]
        return captured.hidden[:rows], [a[:rows] for a in captured.aux], logits, True

    # ---- 2 + 3. verify, compact ---------------------------------------------------------------
    def _sample(self, sched, batch: InputBatch, logits: torch.Tensor, groups: list[TreeGroup],
                results: list, graphed_aux: list[torch.Tensor] | None = None) -> tuple[dict[int, list[int]], bool]:
        """Each sampling sequence's tokens into results; returns the accepted paths' rows (offsets
        from each tree sequence's first row) for the drafter's catch-up, and whether the next trees
        are drafted already: after a graphed verify (graphed_aux: its aux states) the catch-up and
        expansion run as one replay before the step's one host read (_draft_after_verify)."""
        in_tree = {i for g in groups for i in g.index}
        plain, plain_rows, plain_positions, first_row = [], [], [], {}
        row = 0
        for i in batch.sampling_seq_index:
            first_row[i] = row
            if i not in in_tree:
                plain.append(i)
                plain_rows.append(row)
                plain_positions.append(batch.row_positions[row])
            row += len(sched.scheduled[i].draft_token_ids) + 1
        if plain:
            sub = replace(batch, sampling_seq_index=plain, logits_row_ids=[batch.logits_row_ids[r] for r in plain_rows],
                          row_positions=plain_positions)
            self.host_step.sample(sched, sub, logits[to_device(plain_rows, torch.int64, self.device)], results)
        if not groups:
            return {}, False
        target_ids = logits.argmax(-1)  # [sampling rows]: greedy verifies and simulated bonuses read it
        uniforms = iter(self.draws.uniforms(len(in_tree)) if self.draws is not None else ())  # one draw per tree
        path_rows, drafted = {}, False
        for g in groups:
            rows = to_device([first_row[i] for i in g.index], torch.int64, self.device).unsqueeze(1)
            rows = rows + torch.arange(g.tree.num_nodes, device=self.device)  # [n, T] logits rows
            verify = self._verify(sched, g, logits, target_ids, rows, [next(uniforms) for _ in g.index]
                                  if self.draws is not None else None)
            self._compact(g, batch, verify.accepted_nodes)
            tree = self._draft_after_verify(sched, batch, g, graphed_aux, verify) if graphed_aux is not None else None
            parts = [verify.num_accepted.unsqueeze(1), verify.output_tokens, verify.accepted_nodes]
            packed = torch.cat(parts if tree is None else [*parts, tree.tokens, tree.depths], 1)
            width = verify.output_tokens.shape[1]
            for j, (i, values) in enumerate(zip(g.index, packed.tolist())):  # one sync per group
                item, accepted = sched.scheduled[i], values[0]
                results[i].new_token_ids = values[1: 2 + accepted]
                results[i].num_accepted = accepted
                results[i].num_drafts = item.num_usable_drafts
                n_real = item.num_new_tokens - len(item.draft_token_ids)
                path = values[1 + width + 1: 1 + width + 1 + accepted]
                path_rows[i] = list(range(n_real)) + [n_real - 1 + node for node in path]
                if tree is not None:
                    self._keep_tree(sched.scheduled[i].seq.seq_id, tree, j, values[1 + 2 * width:], results[i])
            drafted = drafted or tree is not None
        return path_rows, drafted

    def _verify(self, sched, g: TreeGroup, logits: torch.Tensor, target_ids: torch.Tensor, rows: torch.Tensor,
                uniforms: list[float] | None) -> TreeVerifyResult:
        """One group's trees at once, in a fixed handful of device ops (tree/path_verify.py): drawn
        (simulated), greedy, or sampled (multi-draft rejection sampling over every sampled tree at
        once; a seeded request draws from its own generator). No host read: _sample reads the result."""
        items = [sched.scheduled[i] for i in g.index]
        depth = self.shape.depth
        limits = [depth if item.accept_limit is None else item.accept_limit for item in items]
        limit_tensor = None if all(x == depth for x in limits) else to_device(limits, torch.int64, self.device)
        ids = target_ids[rows]  # [n, T]
        if uniforms is not None:  # (to_device: a pageable upload would wait for the verify forward)
            return simulated_tree_accept(g.tree, to_device(uniforms, torch.float64, self.device),
                                         self.rates, ids, limit_tensor)
        sampled = [j for j, item in enumerate(items) if not item.seq.sampling_params.greedy]
        if not sampled:
            return verify_greedy_paths(g.tree, ids, limit_tensor)
        if any(items[j].accept_limit is not None for j in sampled):
            raise RuntimeError("a sampled tree verify got an accept_limit (the scheduler caps greedy rows only)")
        if len(sampled) == len(items):
            return self._verify_sampled(g.tree, [items[j] for j in sampled], logits[rows])
        picked = to_device(sampled, torch.int64, self.device)
        greedy = verify_greedy_paths(g.tree, ids, limit_tensor)
        drawn = self._verify_sampled(g.tree.take(picked), [items[j] for j in sampled], logits[rows[picked]])
        return TreeVerifyResult(*(getattr(greedy, f).index_copy(0, picked, getattr(drawn, f))
                                  for f in ("accepted_nodes", "num_accepted", "bonus_tokens", "output_tokens")))

    def _verify_sampled(self, tree: DraftTree, items: list, logits: torch.Tensor) -> TreeVerifyResult:
        """Multi-draft rejection sampling of sampled requests' trees (logits [n, T, vocab]) at once:
        their processed probabilities in one pass, one uniform per node and an exponential race per
        tree. Unseeded trees draw together from the step's generator; a seeded tree draws from its
        own (seeded by request, sample and root position: uniforms, then the race, as verify_sampled)."""
        n, num_nodes, vocab = logits.shape
        params = [item.seq.sampling_params for item in items for _ in range(num_nodes)]
        sampling = SamplingBatch.build(params, [None] * len(params), vocab, self.device)
        probs = processed_probs(logits.flatten(0, 1), sampling).view(n, num_nodes, vocab)  # [n, T, vocab]
        seeded = [item.seq.sampling_params.seed is not None for item in items]
        shared = seeded.count(False)
        uniforms = torch.rand(shared, num_nodes, generator=self.generator, device=self.device, dtype=probs.dtype)
        noise = torch.empty(shared, vocab, device=self.device, dtype=probs.dtype).exponential_(generator=self.generator)
        if any(seeded):
            u_parts, noise_parts, k = [], [], 0
            for item, own in zip(items, seeded):
                if own:
                    root_position = item.seq.num_computed_tokens + item.num_new_tokens - num_nodes
                    generator = torch.Generator(device=self.device)
                    generator.manual_seed(row_seed(item.seq.sampling_params.seed ^ TREE_SEED_SALT, item.seq.index,
                                                   root_position))
                    u_parts.append(torch.rand(1, num_nodes, generator=generator, device=self.device, dtype=probs.dtype))
                    noise_parts.append(torch.empty(1, vocab, device=self.device, dtype=probs.dtype)
                                       .exponential_(generator=generator))
                else:
                    u_parts.append(uniforms[k: k + 1])
                    noise_parts.append(noise[k: k + 1])
                    k += 1
            uniforms, noise = torch.cat(u_parts), torch.cat(noise_parts)
        return verify_sampled_paths(tree, probs, uniforms, noise)

    def _compact(self, g: TreeGroup, batch: InputBatch, accepted_nodes: torch.Tensor) -> None:
        """Every target layer's K/V of the accepted paths to consecutive positions after the root:
        the moves of all the group's sequences in every layer in one launch on CUDA (ops/step/
        kv_moves.py), one gather and one scatter per layer elsewhere."""
        table = batch.attn_metadata.block_table[to_device(g.index, torch.int64, self.device)]
        roots = to_device(g.root_positions, torch.int64, self.device)
        src, dst = compaction_slots(accepted_nodes, roots, table, self.block_size)
        caches = [layer.kv_cache for layer in self.model.attention_layers()]
        if self.kv_moves is None or not self.kv_moves.holds(caches):
            self.kv_moves = KVMoveTargets(caches)
        move_kv_slots(self.kv_moves, src, dst, accepted_nodes.shape[1])

    # ---- 4. draft ------------------------------------------------------------------------------
    def _draft_after_verify(self, sched, batch: InputBatch, g: TreeGroup, aux: list[torch.Tensor],
                            verify: TreeVerifyResult) -> DraftTree | None:
        """The next trees of a graphed verify's sequences, drafted on the drafter's graph from the
        verify's device outputs before the host reads them (TreeDraftGraphs.run_after_verify: the
        paths' catch-up padded to depth + 1 rows, then the expansion). None, and the usual catch-up
        and draft after the read, unless every sequence of the step verified a whole tree and
        drafts the next whatever it accepts: no logits processing or logprobs, no draft limit of 0,
        and room for the padded rows and a draft below max_model_len."""
        graphs = self.drafter.graphs
        n, depth = len(g.index), self.shape.depth
        if graphs is None or n != len(sched.scheduled) or g.index != list(range(n)) or sched.num_next_drafts == 0:
            return None
        for item, root in zip(sched.scheduled, g.root_positions):
            # a draft is useful whatever the step accepts (DraftBatch.num_useful_drafts > 0)
            room = root + depth + 3 <= graphs.max_model_len
            if not (item.samples and _drafts_trees(item.seq.sampling_params) and room):
                return None
        num_nodes = g.tree.num_nodes
        if g.root_rows != [j * num_nodes for j in range(n)]:  # whole trees, in order
            return None
        starts = torch.arange(n, device=self.device).unsqueeze(1) * num_nodes  # [n, 1]: each tree's first row
        path_rows = starts + verify.accepted_nodes.clamp(min=0)  # [n, depth + 1]: padding rows read the root's
        path_tokens = torch.cat([g.tree.tokens[:, :1], verify.output_tokens], 1)  # [n, depth + 2]
        return graphs.run_after_verify(aux, path_rows, path_tokens, verify.num_accepted, g.root_positions,
                                       batch.attn_metadata.block_table)

    def _keep_tree(self, seq_id: int, tree: DraftTree, j: int, host: list[int], result: SequenceResult) -> None:
        """Keep row j of the drafted trees [n, T] for sequence seq_id until its verify; host: that row's
        tokens then depths, as read."""
        num_nodes = tree.num_nodes
        tokens = host[:num_nodes]
        self.trees[seq_id], self.tree_tokens[seq_id] = tree.row(j), tokens
        self.tree_depths[seq_id] = host[num_nodes: 2 * num_nodes]
        result.next_drafts = tokens[1:]

    def draft_host_trees(self, sched, results: list) -> None:
        """A host drafter's next trees after a step the runner decoded plainly (queued ahead:
        runner/host_tree_steps.py), from the results' tokens."""
        self._draft(sched, None, None, None, results, {})

    def _draft(self, sched, batch: InputBatch, hidden, aux, results: list, path_rows: dict[int, list[int]]) -> None:
        if self.host_trees:  # token lists only: no rows gathered on the device (host_drafts.py)
            draft_batch = token_draft_batch(sched, results, self.block_size, self.host_step.max_model_len)
        else:
            draft_batch = self.host_step.draft_batch(sched, batch, hidden, aux, results, path_rows)
        depth = self.shape.depth
        drafting = [i for i, item in enumerate(sched.scheduled)
                    if draft_batch.num_useful_drafts(i, depth) > 0 and _drafts_trees(item.seq.sampling_params)]
        if self.host_trees:  # (only the sequences whose drafter found a tree draft; host lists given)
            drafting, tree, packed = self.drafter.draft(draft_batch, drafting)
        else:
            tree = self.drafter.draft(draft_batch, drafting)
            packed = None if tree is None else torch.cat([tree.tokens, tree.depths], 1).tolist()  # one read: [n, 2T]
        if tree is None:
            return
        for j, i in enumerate(drafting):
            self._keep_tree(sched.scheduled[i].seq.seq_id, tree, j, packed[j], results[i])


def _drafts_trees(params) -> bool:
    """Requests whose rows read more than their logits (penalties, biases, grammars) or that ask
    for logprobs run without drafts under trees."""
    return params.use_speculation and not params.needs_logits_processing and params.logprobs is None
