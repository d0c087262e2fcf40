"""aftgen's native code, built once into aftgen's cache: library (its build and load), matmul_rows (the
batch-invariant matrix product), top_scores (a step's log-probabilities and their top k) and scores_json (OpenAI's
`logprobs` JSON of them), each beside the C++ source of the same name.
"""
