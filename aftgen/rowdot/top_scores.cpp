// The scores a step reports for `logprobs`: each row's chosen token's log-probability and its k likeliest
// tokens', packed as aftgen.sampling's score records are (aftgen/sampling.py, token_scores). torch.topk over a
// step's 32 rows of 1,024 log-probabilities cost the serving engine, which sets the pace, more than all else
// `logprobs` adds (docs/benchmarks.md); one pass over each row that skips any block of 16 with nothing above the
// current k-th costs a quarter of it (12 against 49 us for 32 rows and k = 5, on one thread).
//
// logprobs (rows, vocab) float32 contiguous, tokens (rows) int64, out (rows, 1 + 2k) int32:
//   [the chosen token's log-probability, the k likeliest log-probabilities high to low (float32 bits), their ids].
// Among equal log-probabilities the lower id comes first, as a stable sort from high to low puts them. NaN has no
// place in that order: the engine refuses a row with NaN scores before it draws from it.

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t BLOCK = 16;
constexpr int MOST = 64;  // the largest k kept (OpenAI's API asks for at most 20)

// Insert (v, id) into the k best so far, high to low, after any equal ones (they have lower ids).
inline void insert(float* values, int32_t* ids, int& count, int k, float v, int32_t id) {
    int at = count < k ? count++ : k - 1;
    while (at > 0 && v > values[at - 1]) {
        values[at] = values[at - 1];
        ids[at] = ids[at - 1];
        --at;
    }
    values[at] = v;
    ids[at] = id;
}

// Whether any of the block's n values is above `floor`: branch-free, so the compiler vectorises it.
inline bool any_above(const float* x, int64_t n, float floor) {
    int above = 0;
    for (int64_t i = 0; i < n; ++i) above |= x[i] > floor;
    return above;
}

void row_top(const float* x, int64_t vocab, int k, float* values, int32_t* ids) {
    int count = 0;
    int64_t j = 0;
    for (; j < vocab && count < k; ++j) insert(values, ids, count, k, x[j], int32_t(j));
    for (; j < vocab; j += BLOCK) {
        const int64_t n = vocab - j < BLOCK ? vocab - j : BLOCK;
        if (!any_above(x + j, n, values[k - 1])) continue;
        for (int64_t i = 0; i < n; ++i)
            if (x[j + i] > values[k - 1]) insert(values, ids, count, k, x[j + i], int32_t(j + i));
    }
}

}  // namespace

extern "C" {

// The largest k aftgen_top_scores keeps.
int aftgen_top_scores_most() { return MOST; }

// Returns 0, or -1 where k is out of range (0..min(vocab, MOST)) or a token id is outside the vocabulary (the rows
// before it written, the rest not).
int aftgen_top_scores(const float* logprobs, int64_t rows, int64_t vocab, const int64_t* tokens, int k,
                      int32_t* out) {
    if (k < 0 || k > MOST || k > vocab) return -1;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t token = tokens[r];  // read once: the check and the read see the same id
        if (token < 0 || token >= vocab) return -1;
        const float* x = logprobs + r * vocab;
        float values[MOST];
        int32_t ids[MOST];
        if (k > 0) row_top(x, vocab, k, values, ids);
        int32_t* o = out + r * (1 + 2 * int64_t(k));
        std::memcpy(o, x + token, sizeof(float));
        std::memcpy(o + 1, values, sizeof(float) * size_t(k));
        std::memcpy(o + 1 + k, ids, sizeof(int32_t) * size_t(k));
    }
    return 0;
}

}  // extern "C"
