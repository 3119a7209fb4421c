"""Accuracy evaluations that also report the speculative decoding statistics of the run:
`foretell eval gsm8k`. Torch loads only when an evaluation runs."""
