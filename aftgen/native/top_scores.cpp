// The scores a step reports for `logprobs`: each row's chosen token's log-probability and its k likeliest
// tokens', packed as aftgen.generation.scores' records are (token_scores), read from the step's
// logits in one call. Inside the serving engine, which sets the pace, torch's log_softmax and a top-k over a step's
// 32 rows of 1,024 logits cost a visible share of a step, half of it in a top-k whose branches mispredicted on each
// step's fresh logits (a loop timing the same logits again and again teaches the predictor, and reads far less;
// figures: docs/benchmarks.md). Here:
// the maxima of 64 interleaved groups, whose k-th bounds the row's k-th value from the start, so few branches go
// the rare way, and a log-sum-exp whose exp the compiler vectorises.
//
// logits (rows, vocab) float32 contiguous, tokens (rows) int64, out (rows, 1 + 2k) int32:
//   [the chosen token's log-probability, the k likeliest log-probabilities high to low (float32 bits), their ids].
// A log-probability is (x - max) - log(sum exp(x - max)), as torch's log_softmax writes it. Among equal logits
// the lower id comes first, as a stable sort from high to low puts them. NaN has no place in that order: the
// engine refuses a row with NaN scores before it draws from it.

#include <cmath>  // INFINITY, std::log
#include <cstdint>
#include <cstring>

namespace {

#define INLINE inline __attribute__((always_inline))

constexpr int64_t SUMS = 16;  // the log-sum-exp's partial sums: a vector of AVX-512's, two of AVX2's
constexpr int MOST = 64;  // the largest k kept (OpenAI's API asks for at most 20)
constexpr int64_t LANES = MOST;  // groups whose maxima bound the k-th value: at least k of them

// exp(x) for x <= 0 to within 2 ulp (Cephes' expf): branch-free, so that a loop of it vectorises without
// -ffast-math. Below -87 it gives exp(-87), which a sum with exp(0) = 1 in it does not see.
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2), in -126..0
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;  // x - n ln 2, ln 2 in two parts
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (int32_t(n) + 127) << 23;  // 2^n
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// log(sum exp(x - top)) over the row: in SUMS partial sums, so the loop is elementwise and vectorises.
INLINE float log_sum_exp_below(const float* x, int64_t vocab, float top) {
    float sums[SUMS] = {};
    int64_t j = 0;
    for (; j + SUMS <= vocab; j += SUMS)
        for (int64_t i = 0; i < SUMS; ++i) sums[i] += exp_nonpositive(x[j + i] - top);
    for (int64_t i = 0; j + i < vocab; ++i) sums[i] += exp_nonpositive(x[j + i] - top);
    double total = 0.0;
    for (float s : sums) total += s;
    return float(std::log(total));
}

// Whether (v, id) goes before (w, other): the larger value first, the lower id among equal ones.
INLINE bool before(float v, int32_t id, float w, int32_t other) { return v > w || (v == w && id < other); }

// Insert (v, id) into the k best so far, in that order (they may come in any order of ids).
INLINE void insert(float* values, int32_t* ids, int& count, int k, float v, int32_t id) {
    int at = count < k ? count++ : k - 1;
    while (at > 0 && before(v, id, values[at - 1], ids[at - 1])) {
        values[at] = values[at - 1];
        ids[at] = ids[at - 1];
        --at;
    }
    values[at] = v;
    ids[at] = id;
}

// The largest of each of LANES interleaved groups of the row (x[j] is in group j mod LANES): an elementwise loop,
// which vectorises. Groups the row does not reach stay at -inf.
INLINE void group_maxima(const float* x, int64_t vocab, float* maxima) {
    for (int64_t i = 0; i < LANES; ++i) maxima[i] = -INFINITY;
    int64_t j = 0;
    for (; j + LANES <= vocab; j += LANES)
        for (int64_t i = 0; i < LANES; ++i) maxima[i] = x[j + i] > maxima[i] ? x[j + i] : maxima[i];
    for (int64_t i = 0; j + i < vocab; ++i) maxima[i] = x[j + i] > maxima[i] ? x[j + i] : maxima[i];
}

// The row's k largest logits, high to low, given its group maxima. The k-th largest of those is at most the row's
// k-th value (k groups hold a value at least that), and only a group whose maximum reaches it can hold one of the
// k: those few groups (their bits in `reaching`, found without a branch) are the only values read again, so few
// branches go the rare way.
INLINE void row_top(const float* x, int64_t vocab, int k, const float* maxima, float* values, int32_t* ids) {
    int count = 0;
    for (int i = 0; i < LANES; ++i)  // values, ids as scratch
        if (count < k || maxima[i] > values[k - 1]) insert(values, ids, count, k, maxima[i], i);
    const float floor = values[k - 1];
    uint64_t reaching = 0;
    for (int i = 0; i < LANES; ++i) reaching |= uint64_t(maxima[i] >= floor) << i;
    count = 0;
    for (; reaching; reaching &= reaching - 1) {
        for (int64_t j = __builtin_ctzll(reaching); j < vocab; j += LANES)
            if (x[j] >= floor && (count < k || before(x[j], int32_t(j), values[k - 1], ids[k - 1])))
                insert(values, ids, count, k, x[j], int32_t(j));
    }
}

// The rows' records (aftgen_top_scores, its checks made).
INLINE int score_rows(const float* logits, int64_t rows, int64_t vocab, const int64_t* tokens, int k, int32_t* out) {
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t token = tokens[r];  // read once: the check and the read see the same id
        if (token < 0 || token >= vocab) return -1;
        const float* x = logits + r * vocab;
        float maxima[LANES], values[MOST];
        int32_t ids[MOST];
        group_maxima(x, vocab, maxima);
        float top = maxima[0];
        for (float m : maxima) top = m > top ? m : top;
        if (k > 0) row_top(x, vocab, k, maxima, values, ids);
        const float log_sum = log_sum_exp_below(x, vocab, top);
        int32_t* o = out + r * (1 + 2 * int64_t(k));
        const float chosen = (x[token] - top) - log_sum;
        std::memcpy(o, &chosen, sizeof(float));
        for (int i = 0; i < k; ++i) {
            const float figure = (values[i] - top) - log_sum;
            std::memcpy(o + 1 + i, &figure, sizeof(float));
        }
        std::memcpy(o + 1 + k, ids, sizeof(int32_t) * size_t(k));
    }
    return 0;
}

// One per level of the machine, compiled for it, as matmul_rows.cpp's products are: the log-sum-exp's vectors are 4, 8
// or 16 floats wide. The figures may differ in their last bit from one level to another (fused multiply-adds),
// never the order.
typedef int (*ScoreRows)(const float* logits, int64_t rows, int64_t vocab, const int64_t* tokens, int k,
                         int32_t* out);

#if defined(__x86_64__)
__attribute__((target("arch=x86-64-v4"))) int score_rows_v4(const float* logits, int64_t rows, int64_t vocab,
                                                             const int64_t* tokens, int k, int32_t* out) {
    return score_rows(logits, rows, vocab, tokens, k, out);
}

__attribute__((target("arch=x86-64-v3"))) int score_rows_v3(const float* logits, int64_t rows, int64_t vocab,
                                                             const int64_t* tokens, int k, int32_t* out) {
    return score_rows(logits, rows, vocab, tokens, k, out);
}
#endif

int score_rows_base(const float* logits, int64_t rows, int64_t vocab, const int64_t* tokens, int k, int32_t* out) {
    return score_rows(logits, rows, vocab, tokens, k, out);
}

// How many levels this machine runs: base (0), then x86-64-v3 (1) and v4 (2) where it has them.
int machine_levels() {
#if defined(__x86_64__)
    __builtin_cpu_init();  // this runs as the library loads, perhaps before the compiler's runtime has looked
    if (__builtin_cpu_supports("x86-64-v4")) return 3;
    if (__builtin_cpu_supports("x86-64-v3")) return 2;
#endif
    return 1;
}

const int LEVELS = machine_levels();

ScoreRows at_level(int level) {
#if defined(__x86_64__)
    if (level == 1) return score_rows_v3;
    if (level == 2) return score_rows_v4;
#endif
    return score_rows_base;
}

}  // namespace

extern "C" {

// The largest k aftgen_top_scores keeps.
int aftgen_top_scores_most() { return MOST; }

// How many levels of the kernel this machine runs (aftgen_top_scores's levels 0 .. this - 1).
int aftgen_top_scores_levels() { return LEVELS; }

// Each row's record through one level of the kernel (0: base; the server runs the highest this machine runs, tests
// each). Returns 0, or -1 where the level is one this machine cannot run, k is out of range (0..min(vocab, MOST)),
// the vocabulary is empty, or a token id is outside the vocabulary (the rows before it written, the rest not).
int aftgen_top_scores(int level, const float* logits, int64_t rows, int64_t vocab, const int64_t* tokens, int k,
                      int32_t* out) {
    if (level < 0 || level >= LEVELS || k < 0 || k > MOST || k > vocab || vocab < 1) return -1;
    return at_level(level)(logits, rows, vocab, tokens, k, out);
}

}  // extern "C"
