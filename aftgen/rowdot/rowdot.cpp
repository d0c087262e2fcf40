// y = x @ w^T, each output summed over the input in one fixed order whatever the number of rows: the product
// of aftgen's batch-invariant step (aftgen/rowdot/__init__.py says why and how it is built and called).
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
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#define INLINE inline __attribute__((always_inline))
#if defined(__x86_64__)  // the vector kernel compiled for each level, the best one taken as the library loads
#define FOR_EACH_LEVEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FOR_EACH_LEVEL
#endif

constexpr int LANES = 16;  // partial sums per output in the vector kernel
typedef float Lanes __attribute__((vector_size(LANES * 4)));
typedef uint16_t Halves __attribute__((vector_size(LANES * 2)));
typedef uint32_t Words __attribute__((vector_size(LANES * 4)));

INLINE Lanes lanes_of(const float* p) {
    Lanes v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

INLINE Lanes lanes_of(const uint16_t* p) {  // bf16 widened: its bits are a float32's top half
    Halves h;
    std::memcpy(&h, p, sizeof h);
    Words bits = __builtin_convertvector(h, Words) << 16;
    Lanes v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
}

INLINE float widened(uint16_t bf16) {
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

INLINE float tree_sum(const float* lanes) {  // lanes[0..16): pairs at distance 8, 4, 2, 1
    float s8[8], s4[4];
    for (int l = 0; l < 8; ++l) s8[l] = lanes[l] + lanes[l + 8];
    for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// y[r][o] for ROWS rows of x (from x, stride K) and OUTS rows of w (from w, stride K), into y (stride N). Each
// output the same arithmetic whatever ROWS and OUTS: input k into partial sum k mod 16, then tree_sum.
template <int ROWS, int OUTS, typename W>
INLINE void vector_block(const float* x, int64_t K, const W* w, int64_t N, float* y) {
    Lanes sums[ROWS][OUTS] = {};
    const int64_t whole = K - K % LANES;
    for (int64_t k = 0; k < whole; k += LANES) {
        Lanes inputs[ROWS];
        for (int r = 0; r < ROWS; ++r) inputs[r] = lanes_of(x + r * K + k);
        for (int o = 0; o < OUTS; ++o) {
            const Lanes weights = lanes_of(w + o * K + k);
            for (int r = 0; r < ROWS; ++r) sums[r][o] += inputs[r] * weights;
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int o = 0; o < OUTS; ++o) {
            float partial[LANES];
            std::memcpy(partial, &sums[r][o], sizeof partial);
            for (int64_t k = whole; k < K; ++k) partial[k - whole] += x[r * K + k] * widened(w[o * K + k]);
            y[r * N + o] = tree_sum(partial);
        }
}

template <int ROWS, typename W>
INLINE void vector_rows(const float* x, int64_t K, const W* w, int64_t n_from, int64_t N, float* y) {
    int64_t n = n_from;
    for (; n + 4 <= N; n += 4) vector_block<ROWS, 4>(x, K, w + n * K, N, y + n);
    for (; n < N; ++n) vector_block<ROWS, 1>(x, K, w + n * K, N, y + n);
}

template <typename W>
INLINE void vector_product(const float* x, int64_t M, int64_t K, const W* w, int64_t n_from, int64_t N, float* y) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) vector_rows<2>(x + m * K, K, w, n_from, N, y + m * N);
    for (; m < M; ++m) vector_rows<1>(x + m * K, K, w, n_from, N, y + m * N);
}

FOR_EACH_LEVEL void vector_product_bf16(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n_from,
                                        int64_t N, float* y) {
    vector_product(x, M, K, w, n_from, N, y);
}

FOR_EACH_LEVEL void vector_product_f32(const float* x, int64_t M, int64_t K, const float* w, int64_t n_from,
                                       int64_t N, float* y) {
    vector_product(x, M, K, w, n_from, N, y);
}

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
const char* aftgen_rowdot_kernel(int w_is_bf16, int64_t N, int64_t K) {
#if defined(__x86_64__)
    if (w_is_bf16 && HAS_AMX && K % TILE_INPUTS == 0 && N >= TILE) return "amx";
#endif
    (void)w_is_bf16, (void)N, (void)K;
    return "vector";
}

// y (M, N) = x (M, K) @ w (N, K)^T, w float32 or bf16 (`w_is_bf16`). `vector_only`: skip AMX (for tests).
void aftgen_rowdot(const float* x, int64_t M, int64_t K, const void* w, int w_is_bf16, int64_t N, float* y,
                   int vector_only) {
    int64_t vector_from = 0;
#if defined(__x86_64__)
    std::vector<float> x_in_bf16;
    if (!vector_only && std::strcmp(aftgen_rowdot_kernel(w_is_bf16, N, K), "amx") == 0) {
        amx_product(x, M, K, static_cast<const uint16_t*>(w), N, y);
        vector_from = N - N % TILE;  // the last outputs, fewer than a tile: x rounded as the tiles round it
        if (vector_from < N) {
            x_in_bf16.resize(size_t(M * K));
            for (int64_t i = 0; i < M * K; ++i) x_in_bf16[size_t(i)] = widened(rounded_to_bf16(x[i]));
            x = x_in_bf16.data();
        }
    }
#endif
    if (w_is_bf16)
        vector_product_bf16(x, M, K, static_cast<const uint16_t*>(w), vector_from, N, y);
    else
        vector_product_f32(x, M, K, static_cast<const float*>(w), vector_from, N, y);
}

// The package's call (AOTInductor's custom-op shim, aot_inductor.custom_ops_to_c_shims): a new y for x and w.
AOTITorchError aoti_torch_cpu_rowdot(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0) {
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
    aftgen_rowdot(static_cast<const float*>(x_data), M, K, w_data, w_is_bf16, N, static_cast<float*>(y_data), 0);
    *ret0 = y;
    return AOTI_TORCH_SUCCESS;
}

}  // extern "C"
