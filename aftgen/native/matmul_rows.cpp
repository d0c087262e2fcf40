// y = x @ w^T, each output summed over the input in one fixed order whatever the number of rows: the product
// of aftgen's batch-invariant step (aftgen/native/matmul_rows.py says why; aftgen/native/library.py builds it).
//
// x (M, K) float32, w (N, K) float32 or bf16, y (M, N) float32, all contiguous. Output (m, n) depends on row m
// of x, row n of w and the kernel alone; the kernel is chosen from the machine and the shapes of w, never from M.
//   amx:    bf16 w on CPUs with AMX. C^T = w x^T in tiles: w's rows are the A tiles as they lie in memory (no
//           packing of the weights), x is rounded to bf16 and laid out pairwise as B tiles. Each output is one
//           tile element, accumulated over K in 32-input steps, in the same order in every tile.
//   vector: everything else. 16 partial sums per output (input k into sum k mod 16), then a fixed tree.

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#define INLINE inline __attribute__((always_inline))

constexpr int LANES = 16;  // partial sums per output in the vector kernel

// WIDTH floats, one machine register: the partial sums of an output are 16 / WIDTH of them.
template <int WIDTH>
struct Register;
template <>
struct Register<16> {
    typedef float Floats __attribute__((vector_size(64)));
};
template <>
struct Register<8> {
    typedef float Floats __attribute__((vector_size(32)));
};
template <>
struct Register<4> {
    typedef float Floats __attribute__((vector_size(16)));
};
template <int WIDTH>
using Floats = typename Register<WIDTH>::Floats;

template <int WIDTH>
INLINE Floats<WIDTH> floats_at(const float* p) {
    Floats<WIDTH> v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

INLINE float widened(uint16_t bf16) {  // its bits are a float32's top half
    uint32_t bits = uint32_t(bf16) << 16;
    float value;
    std::memcpy(&value, &bits, 4);
    return value;
}

INLINE float widened(float value) { return value; }

inline uint16_t rounded_to_bf16(float value) {  // round to nearest even, as torch's .to(torch.bfloat16)
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);  // NaN stays NaN
    return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// An output's 16 partial sums are summed by a fixed tree: pairs at distance 8, then 4, 2 and 1, whatever the
// register width. The levels at distances of a register or more add whole registers of one output; those
// below add pairs of lanes, two outputs' at a time, so that the adds stay vector ones.

// COUNT outputs' registers (parts[p][i]: output i's lanes p WIDTH ..) summed at the distances of a register or
// more, into parts[0]: each output's first WIDTH sums of the tree.
template <int WIDTH, int COUNT>
INLINE void register_sums(Floats<WIDTH> (*parts)[COUNT]) {
    for (int distance = LANES / 2; distance >= WIDTH; distance /= 2)
        for (int p = 0; p < distance / WIDTH; ++p)
            for (int i = 0; i < COUNT; ++i) parts[p][i] += parts[p + distance / WIDTH][i];
}

// One level below a register, for two outputs' registers a and b, each holding every output's sums in groups
// of 2 DISTANCE lanes: lane i + DISTANCE of a group added to lane i, a's sums then b's in the result.
template <int DISTANCE, int WIDTH, int... LANE>
INLINE Floats<WIDTH> pairs_summed(Floats<WIDTH> a, Floats<WIDTH> b, std::integer_sequence<int, LANE...>) {
    return __builtin_shufflevector(a, b, (LANE / DISTANCE * 2 * DISTANCE + LANE % DISTANCE)...) +
           __builtin_shufflevector(a, b, (LANE / DISTANCE * 2 * DISTANCE + LANE % DISTANCE + DISTANCE)...);
}

// The levels below a register for COUNT outputs (a power of two up to WIDTH), output o into lane o of sums[0].
template <int WIDTH, int DISTANCE, int COUNT>
INLINE void lane_sums(Floats<WIDTH>* sums) {
    if constexpr (DISTANCE >= 1) {
        constexpr auto lanes = std::make_integer_sequence<int, WIDTH>();
        if (COUNT == 1) sums[0] = pairs_summed<DISTANCE, WIDTH>(sums[0], sums[0], lanes);
        for (int i = 0; i < COUNT / 2; ++i) sums[i] = pairs_summed<DISTANCE, WIDTH>(sums[2 * i], sums[2 * i + 1], lanes);
        lane_sums<WIDTH, DISTANCE / 2, (COUNT + 1) / 2>(sums);
    }
}

// The tree's sums of COUNT outputs (their register_sums) into outputs[0 .. COUNT), by as many at a time as a
// power of two up to WIDTH allows.
template <int WIDTH, int COUNT>
INLINE void tree_sums(Floats<WIDTH>* sums, float* outputs) {
    constexpr int GROUP = COUNT >= WIDTH ? WIDTH : COUNT >= 8 ? 8 : COUNT >= 4 ? 4 : COUNT >= 2 ? 2 : 1;
    lane_sums<WIDTH, WIDTH / 2, GROUP>(sums);
    std::memcpy(outputs, sums, sizeof(float) * GROUP);
    if constexpr (COUNT > GROUP) tree_sums<WIDTH, COUNT - GROUP>(sums + GROUP, outputs + GROUP);
}

// y[r][o] for ROWS rows of x (from x, stride x_stride) and OUTS rows of w (from w, stride w_stride, both
// readable up to K rounded up to 16), into y (stride N), the first `stored` outputs kept. Each output the same
// arithmetic whatever ROWS and OUTS: input k into partial sum k mod 16 (the last K % 16 inputs into the first
// sums, the others left as they are), then the tree.
template <int WIDTH, int ROWS, int OUTS>
INLINE void vector_block(const float* x, int64_t x_stride, const float* w, int64_t w_stride, int64_t K, float* y,
                         int64_t N, int stored) {
    constexpr int PARTS = LANES / WIDTH;
    Floats<WIDTH> sums[PARTS][ROWS * OUTS] = {};  // [part][r][o]
    const int64_t whole = K - K % LANES;
    for (int64_t k = 0; k < whole; k += LANES)
        for (int p = 0; p < PARTS; ++p) {
            Floats<WIDTH> inputs[ROWS];
            for (int r = 0; r < ROWS; ++r) inputs[r] = floats_at<WIDTH>(x + r * x_stride + k + p * WIDTH);
            for (int o = 0; o < OUTS; ++o) {
                const Floats<WIDTH> weights = floats_at<WIDTH>(w + o * w_stride + k + p * WIDTH);
                for (int r = 0; r < ROWS; ++r) sums[p][r * OUTS + o] += inputs[r] * weights;
            }
        }
    if (whole < K)
        for (int p = 0; p < PARTS; ++p) {
            Floats<WIDTH> lane;
            for (int i = 0; i < WIDTH; ++i) lane[i] = float(p * WIDTH + i);
            const auto taken = lane < float(K - whole);
            for (int o = 0; o < OUTS; ++o) {
                const Floats<WIDTH> weights = floats_at<WIDTH>(w + o * w_stride + whole + p * WIDTH);
                for (int r = 0; r < ROWS; ++r) {
                    Floats<WIDTH>& sum = sums[p][r * OUTS + o];
                    sum = taken ? sum + floats_at<WIDTH>(x + r * x_stride + whole + p * WIDTH) * weights : sum;
                }
            }
        }
    register_sums<WIDTH, ROWS * OUTS>(sums);
    float outputs[ROWS * OUTS];
    tree_sums<WIDTH, ROWS * OUTS>(sums[0], outputs);
    for (int r = 0; r < ROWS; ++r)
        if (stored == OUTS)
            std::memcpy(y + r * N, outputs + r * OUTS, sizeof(float) * OUTS);
        else
            for (int o = 0; o < stored; ++o) y[r * N + o] = outputs[r * OUTS + o];
}

INLINE int64_t rounded_up(int64_t K) { return (K + LANES - 1) / LANES * LANES; }

// Rows [from, from + count) of w (N, K), widened to float32, as `count` rows of rounded_up(K) floats: inputs
// past K and rows past N zero.
template <typename W>
INLINE void padded_rows(const W* w, int64_t N, int64_t K, int64_t from, int64_t count, float* rows) {
    const int64_t stride = rounded_up(K);
    for (int64_t o = 0; o < count; ++o) {
        float* row = rows + o * stride;
        const int64_t copied = from + o < N ? K : 0;
        for (int64_t k = 0; k < copied; ++k) row[k] = widened(w[(from + o) * K + k]);
        std::memset(row + copied, 0, sizeof(float) * (stride - copied));
    }
}

// Outputs n_from .. N of every row, OUTS outputs at a time, by blocks of ROWS rows and then one row at a time
// for the rows left over. The outer loop is over outputs so that their weights stay in cache for all the rows.
// The weights are read in place where they are float32 rows of whole 16s, else from a copy widened and padded
// with zeros (the copy changes no value: the sums only read as far as K), as are the inputs.
template <int WIDTH, int ROWS, int OUTS, typename W>
INLINE void blocked_product(const float* x, int64_t M, int64_t K, const W* w, int64_t n_from, int64_t N, float* y) {
    const int64_t stride = rounded_up(K);
    std::vector<float> x_copy, w_copy(size_t(OUTS * stride));
    if (stride != K) {
        x_copy.resize(size_t(M * stride));
        padded_rows(x, M, K, 0, M, x_copy.data());
    }
    const float* inputs = stride == K ? x : x_copy.data();
    for (int64_t n = n_from; n < N; n += OUTS) {
        const int outputs = int(N - n < OUTS ? N - n : OUTS);
        const float* weights = w_copy.data();
        if (std::is_same<W, float>::value && stride == K && outputs == OUTS)
            weights = reinterpret_cast<const float*>(w) + n * K;
        else
            padded_rows(w, N, K, n, OUTS, w_copy.data());
        int64_t m = 0;
        for (; m + ROWS <= M; m += ROWS)
            vector_block<WIDTH, ROWS, OUTS>(inputs + m * stride, stride, weights, stride, K, y + m * N + n, N,
                                            outputs);
        for (; m < M; ++m)
            vector_block<WIDTH, 1, OUTS>(inputs + m * stride, stride, weights, stride, K, y + m * N + n, N, outputs);
    }
}

// The vector kernel with registers of WIDTH floats in blocks of ROWS x OUTS outputs. Which of them runs
// changes how fast, never what: each output is summed alone, in the same order.
template <int WIDTH, int ROWS, int OUTS>
INLINE void vector_product(const float* x, int64_t M, int64_t K, const void* w, bool w_is_bf16, int64_t n_from,
                           int64_t N, float* y) {
    if (w_is_bf16)
        blocked_product<WIDTH, ROWS, OUTS>(x, M, K, static_cast<const uint16_t*>(w), n_from, N, y);
    else
        blocked_product<WIDTH, ROWS, OUTS>(x, M, K, static_cast<const float*>(w), n_from, N, y);
}

// One per level of the machine, compiled for it, each block's sums filling its registers: AVX-512's 32 of 16
// floats hold 4 x 6 outputs' sums, AVX2's 16 of 8 hold 2 x 3 (2 registers an output); 128-bit ones 2 x 2.
typedef void (*VectorProduct)(const float* x, int64_t M, int64_t K, const void* w, bool w_is_bf16, int64_t n_from,
                              int64_t N, float* y);

#if defined(__x86_64__)
__attribute__((target("arch=x86-64-v4"))) void vector_product_v4(const float* x, int64_t M, int64_t K, const void* w,
                                                                  bool w_is_bf16, int64_t n_from, int64_t N, float* y) {
    vector_product<16, 4, 6>(x, M, K, w, w_is_bf16, n_from, N, y);
}

__attribute__((target("arch=x86-64-v3"))) void vector_product_v3(const float* x, int64_t M, int64_t K, const void* w,
                                                                  bool w_is_bf16, int64_t n_from, int64_t N, float* y) {
    vector_product<8, 2, 3>(x, M, K, w, w_is_bf16, n_from, N, y);
}
#endif

void vector_product_base(const float* x, int64_t M, int64_t K, const void* w, bool w_is_bf16, int64_t n_from,
                         int64_t N, float* y) {
    vector_product<4, 2, 2>(x, M, K, w, w_is_bf16, n_from, N, y);
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

VectorProduct at_level(int level) {
#if defined(__x86_64__)
    if (level == 2) return vector_product_v4;
    if (level == 1) return vector_product_v3;
#endif
    (void)level;
    return vector_product_base;
}

const int LEVELS = machine_levels();
// The machine's highest level, unless a test asks for a lower one (aftgen_matmul_rows_use).
VectorProduct VECTOR_PRODUCT = at_level(LEVELS - 1);

#if defined(__x86_64__)

constexpr int TILE = 16;         // a tile's rows, and fp32 columns
constexpr int TILE_INPUTS = 32;  // bf16 inputs a tile row holds (64 bytes)
constexpr int TILE_HALVES = TILE * TILE_INPUTS;

struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
};

bool cpu_has_amx_bf16() {
    unsigned eax, ebx, ecx, edx;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const bool tile = edx & (1u << 24), bf16 = edx & (1u << 22);
    if (!tile || !bf16) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;  // the kernel lends AMX on request
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

const bool HAS_AMX = cpu_has_amx_bf16();
bool USE_AMX = HAS_AMX;  // unless a test leaves the tiles out (aftgen_matmul_rows_use)

// x (M, K) as B tiles, one per (input block, row block): tile[p][2 m + j] = bf16(x[row0 + m][k0 + 2 p + j]),
// rows past M zero (an even number of row blocks). Laid out tiles[k_block][m_block][16 * 32].
void pairwise_tiles(const float* x, int64_t M, int64_t K, int64_t m_blocks, uint16_t* tiles) {
    const int64_t k_blocks = K / TILE_INPUTS;
    std::memset(tiles, 0, size_t(k_blocks * m_blocks * TILE_HALVES) * 2);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t kb = 0; kb < k_blocks; ++kb) {
            uint16_t* tile = tiles + (kb * m_blocks + m / TILE) * TILE_HALVES + (m % TILE) * 2;
            const float* inputs = x + m * K + kb * TILE_INPUTS;
            for (int i = 0; i < TILE_INPUTS; ++i) tile[(i / 2) * TILE_INPUTS + i % 2] = rounded_to_bf16(inputs[i]);
        }
}

// Outputs 0 .. N - N % 16 of every row. tmm0-3 sum 2 blocks of 16 outputs x 2 blocks of 16 rows (C^T), tmm4-5
// hold those outputs' weights (A, w's rows in place), tmm6-7 the rows' inputs (B).
__attribute__((target("amx-tile,amx-bf16"))) void amx_product(const float* x, int64_t M, int64_t K,
                                                               const uint16_t* w, int64_t N, float* y) {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.rows[t] = TILE, config.bytes_per_row[t] = 64;
    _tile_loadconfig(&config);
    const int64_t m_blocks = ((M + TILE - 1) / TILE + 1) / 2 * 2, k_blocks = K / TILE_INPUTS, n_blocks = N / TILE;
    std::vector<uint16_t> tiles(size_t(k_blocks * m_blocks * TILE_HALVES));
    pairwise_tiles(x, M, K, m_blocks, tiles.data());
    alignas(64) float out[4][TILE][TILE];
    for (int64_t mb = 0; mb < m_blocks; mb += 2)
        for (int64_t nb = 0; nb < n_blocks; nb += 2) {
            const bool pair = nb + 1 < n_blocks, two_row_blocks = mb * TILE + TILE < M;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < k_blocks; ++kb) {
                const uint16_t* inputs = tiles.data() + (kb * m_blocks + mb) * TILE_HALVES;
                const uint16_t* weights = w + nb * TILE * K + kb * TILE_INPUTS;
                _tile_loadd(6, inputs, 64);
                _tile_loadd(4, weights, K * 2);
                _tile_dpbf16ps(0, 4, 6);
                if (two_row_blocks) {
                    _tile_loadd(7, inputs + TILE_HALVES, 64);
                    _tile_dpbf16ps(2, 4, 7);
                }
                if (pair) {
                    _tile_loadd(5, weights + TILE * K, K * 2);
                    _tile_dpbf16ps(1, 5, 6);
                    if (two_row_blocks) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, out[0], TILE * 4);
            _tile_stored(1, out[1], TILE * 4);
            _tile_stored(2, out[2], TILE * 4);
            _tile_stored(3, out[3], TILE * 4);
            for (int block = 0; block < 4; ++block) {
                const int64_t row0 = (mb + block / 2) * TILE, n0 = (nb + block % 2) * TILE;
                if (n0 >= n_blocks * TILE) continue;
                for (int64_t m = row0; m < M && m < row0 + TILE; ++m)
                    for (int n = 0; n < TILE; ++n) y[m * N + n0 + n] = out[block][n][m - row0];
            }
        }
    _tile_release();
}

#endif

}  // namespace

extern "C" {

// Which kernel a w of this dtype and shape goes through on this machine: "amx" or "vector".
const char* aftgen_matmul_rows_kernel(int w_is_bf16, int64_t N, int64_t K) {
#if defined(__x86_64__)
    if (w_is_bf16 && USE_AMX && K % TILE_INPUTS == 0 && N >= TILE) return "amx";
#endif
    (void)w_is_bf16, (void)N, (void)K;
    return "vector";
}

// How many levels of the vector kernel this machine runs (aftgen_matmul_rows_use's levels 0 .. this - 1).
int aftgen_matmul_rows_levels() { return LEVELS; }

// For tests: every later product, the step packages' too, through the vector kernel of `level` (-1: the machine's
// highest) and the AMX tiles or not. Returns 0, or -1 where this machine cannot run that level or has no tiles.
int aftgen_matmul_rows_use(int level, int amx) {
    if (level < -1 || level >= LEVELS) return -1;
#if defined(__x86_64__)
    if (amx && !HAS_AMX) return -1;
    USE_AMX = amx;
#else
    if (amx) return -1;
#endif
    VECTOR_PRODUCT = at_level(level == -1 ? LEVELS - 1 : level);
    return 0;
}

// y (M, N) = x (M, K) @ w (N, K)^T, w float32 or bf16 (`w_is_bf16`). `vector_only`: skip AMX (for tests).
void aftgen_matmul_rows(const float* x, int64_t M, int64_t K, const void* w, int w_is_bf16, int64_t N, float* y,
                   int vector_only) {
    int64_t vector_from = 0;
#if defined(__x86_64__)
    std::vector<float> x_in_bf16;
    if (!vector_only && std::strcmp(aftgen_matmul_rows_kernel(w_is_bf16, N, K), "amx") == 0) {
        amx_product(x, M, K, static_cast<const uint16_t*>(w), N, y);
        vector_from = N - N % TILE;  // the last outputs, fewer than a tile: x rounded as the tiles round it
        if (vector_from < N) {
            x_in_bf16.resize(size_t(M * K));
            for (int64_t i = 0; i < M * K; ++i) x_in_bf16[size_t(i)] = widened(rounded_to_bf16(x[i]));
            x = x_in_bf16.data();
        }
    }
#endif
    VECTOR_PRODUCT(x, M, K, w, w_is_bf16, vector_from, N, y);
}

// The package's call (AOTInductor's custom-op shim, aot_inductor.custom_ops_to_c_shims): a new y for x and w.
AOTITorchError aoti_torch_cpu_matmul_rows(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0) {
    int64_t *x_sizes, *w_sizes, *x_strides, *w_strides, x_dim, w_dim;
    int32_t x_dtype, w_dtype;
    aoti_torch_get_dim(x, &x_dim);
    aoti_torch_get_dim(w, &w_dim);
    aoti_torch_get_dtype(x, &x_dtype);
    aoti_torch_get_dtype(w, &w_dtype);
    if (x_dim != 2 || w_dim != 2 || x_dtype != aoti_torch_dtype_float32()) return AOTI_TORCH_FAILURE;
    const bool w_is_bf16 = w_dtype == aoti_torch_dtype_bfloat16();
    if (!w_is_bf16 && w_dtype != aoti_torch_dtype_float32()) return AOTI_TORCH_FAILURE;
    aoti_torch_get_sizes(x, &x_sizes);
    aoti_torch_get_sizes(w, &w_sizes);
    aoti_torch_get_strides(x, &x_strides);
    aoti_torch_get_strides(w, &w_strides);
    const int64_t M = x_sizes[0], K = x_sizes[1], N = w_sizes[0];
    const bool laid_out = (M < 2 || x_strides[0] == K) && (K < 2 || x_strides[1] == 1) && w_strides[1] == 1 &&
                          w_strides[0] == K && w_sizes[1] == K;
    if (!laid_out) return AOTI_TORCH_FAILURE;
    void *x_data, *w_data, *y_data;
    aoti_torch_get_data_ptr(x, &x_data);
    aoti_torch_get_data_ptr(w, &w_data);
    int64_t sizes[2] = {M, N}, strides[2] = {N, 1};
    AtenTensorHandle y;
    AOTITorchError error = aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_float32(),
                                                    aoti_torch_device_type_cpu(), 0, &y);
    if (error) return error;
    aoti_torch_get_data_ptr(y, &y_data);
    aftgen_matmul_rows(static_cast<const float*>(x_data), M, K, w_data, w_is_bf16, N, static_cast<float*>(y_data), 0);
    *ret0 = y;
    return AOTI_TORCH_SUCCESS;
}

}  // extern "C"
