"""The bookkeeping of a speculative step on the device: a graph's inputs scattered from one packed
upload, how many drafts each sequence accepts (verified or drawn) and its next token, the draft
loop's catch-up and chained-step inputs, and the next verify step's inputs. inputs.py holds the
data these take, reference.py the torch twins, triton_kernels.py one launch per piece, dispatch.py
the entry points (Triton on CUDA, the twins elsewhere)."""
