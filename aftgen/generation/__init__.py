"""Generation: the prompt read in the parallel form, then one recurrent step per token.

Sampling controls follow llama.cpp / transformers meanings: temperature (0 = greedy), top-k,
top-p (nucleus), min-p, repeat penalty over the last n tokens, stop strings. One concept a module:
controls (the controls and SamplingOptions), drawing (a batch's next tokens), scores (the score records),
context (where a generation stands), prompt (reading a prompt), stream (text out, stop strings) and
loop (generate, sample_text).
"""
