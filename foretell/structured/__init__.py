"""Structured outputs: a request's output constrained by a JSON schema, a regular expression, a
list of choices or a grammar, exactly, under every drafter.

params.py     StructuredOutputsParams (vLLM's names), validated when a request is made; no torch
matcher.py    SequenceMatcher: one sequence's grammar state, the token bitmasks of a verify
              step's rows (row j as if drafts d_0..d_{j-1} were accepted) and its rollback
runtime.py    StructuredOutputs: the runner's matchers per sequence, the masks applied to the
              sampling rows' logits on the device, drafts the grammar rejects cut before verify
verify_rows.py  VerifyRows: a step's verify rows filled into the host buffer, and the next
              step's rows filled ahead on a worker thread (MaskWorker)
bitmask.py    the device op: a packed [rows, ceil(vocab / 32)] int32 bitmask -> -inf on logits,
              and BitmaskBuffer (reused host rows, pinned on CUDA, one copy per step)
batched_fill.py  every sequence's verify rows of a step in one llguidance (LLExecutor) call
draft_mask.py DraftMask: the grammar masks of a model drafter's loop (EAGLE3, MTP, draft LM), so
              drafts follow the grammar (sampled drafts keep the masked q they were drawn from)

The grammar engine is llguidance (pinned in pyproject.toml). Why it and not xgrammar: its wheel is
one abi3 Rust library of 3 MB with no Python dependencies, where xgrammar's wheel requires torch,
triton, transformers and apache-tvm-ffi (from PyPI that resolves to a CUDA build of torch, which CI
cannot take). On this project's 2-core CPU box (a JSON schema of 4 fields with a nested object,
token by token through a document) llguidance's masks cost more than xgrammar's, more so at first
(the first masks build its lexer lazily) and with a larger vocabulary, and xgrammar pays a compile
up front (the figures: docs/perf-log.md, "Figures moved from docstrings"). Both are far below a step
on the H200 at batch 1 for small vocabularies; llguidance also has what the speculative step needs
built in: rollback, try_consume_tokens, and grammar validation without a tokenizer (so a bad schema
is refused when the request is made).
"""
