"""How the shipped default model family (foretell/default_models) was made: the tokenizer (bpe),
the corpus, pretraining of the Qwen3- and DeepSeek-layout targets, the model cards and the
measurements. Not part of the installed package: run from the repository root,
`python -m recipes.default_models.train --smoke` (CPU, minutes) or without --smoke on a GPU."""
