// Fused CPU sign-pack kernels for onebit, loaded with ctypes by onebit/kernels/cpu.py.
//
// Every function equals onebit.kernels.reference bit for bit (see that module for the sign, bit
// order and error conventions). No torch or Python headers: this file compiles in a few seconds.
//
// Segments. Every operation takes the segment table bounds = [0, o_1, ..., M] (k + 1 int64s) of a
// buffer of M elements over n ranks; each segment is a multiple of 8n elements and has its own
// scale. Chunk j of segment i (L_i = (o_{i+1} - o_i) / n elements) travels in wire row j at
// element offset o_i / n; the server's chunk has the table bounds / n. One call does all
// segments, with the same passes as for one segment: the blocked sums of squares of all
// segments' blocks in one parallel pass, a pairwise tree per segment, then one parallel pass of
// pack and error update over all bytes (each with its segment's scale and wire position).
//
// Scale. The sum of squares of a segment is the *blocked sum* of onebit/kernels/blocked.py, which
// the CUDA kernels in kernels/onebit_kernels.cu compute too:
//   * the segment is cut into blocks of 1024 elements (32 steps of 32 lanes) from its own start,
//     the last one zero-padded; lane l of block b sums (double)v[1024b + 32j + l]^2 for
//     j = 0..31 in increasing j, starting from 0.0;
//   * the list of the segment's lane sums (block-major) is reduced by the adjacent pairwise tree
//     (level by level, v[i] = v[2i] + v[2i+1], a lone last element carried up unchanged);
//   * scale = (float)sqrt(S / (double)len).
// A float's square is exact in double, so an FMA (acc + b*b) rounds exactly like a separate
// multiply and add, and the result depends neither on vector width nor on thread count.
//
// Every other operation is one IEEE float32 operation per element (add, subtract, multiply,
// divide by n), in the same order as the reference. Negation only flips the sign bit, so q*s is s with its sign
// bit flipped where q = -1. Build with -ffp-contract=off (cpu.py does).
//
// Errors. The compression errors are float32, or bfloat16 held as their 16 bits (error_dtype):
// read exactly (the bits shifted up), each new error computed in float32 and rounded once to
// nearest even, as torch rounds a float32 to bfloat16 (a NaN stays a NaN, its payload unspecified:
// torch's own conversions differ there).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ONEBIT_X86 1
#else
#define ONEBIT_X86 0
#endif

namespace {

constexpr int64_t kLanes = 32;
constexpr int64_t kSteps = 32;
constexpr int64_t kBlock = kLanes * kSteps;  // elements per block of the blocked sum
constexpr int64_t kMinElementsPerThread = int64_t{1} << 18;
constexpr int64_t kStreamBytes = int64_t{64} << 20;  // decode outputs from 64 MiB on: streaming stores

bool g_force_scalar = false;  // testing hook: run the portable paths on an AVX2 machine

// ---------------------------------------------------------------------------------------------
// Threading: a plain fork-join over [0, n) in `threads` contiguous ranges.

template <typename F>
void parallel_ranges(int64_t n, int threads, F&& fn) {
    if (threads <= 1 || n <= 1) {
        fn(int64_t{0}, n);
        return;
    }
    if (threads > n) threads = static_cast<int>(n);
    const int64_t per = (n + threads - 1) / threads;
    std::vector<std::thread> pool;
    pool.reserve(threads - 1);
    for (int t = 1; t < threads; ++t) {
        const int64_t lo = t * per;
        const int64_t hi = lo + per < n ? lo + per : n;
        if (lo >= hi) break;
        pool.emplace_back([&fn, lo, hi] { fn(lo, hi); });
    }
    fn(int64_t{0}, per < n ? per : n);
    for (auto& th : pool) th.join();
}

int clamp_threads(int threads, int64_t work_items) {
    if (threads < 1) threads = 1;
    const int64_t useful = work_items / kMinElementsPerThread;
    if (useful < threads) threads = useful < 1 ? 1 : static_cast<int>(useful);
    return threads;
}

// Adjacent pairwise tree, level by level; a lone last element is carried up unchanged.
double pairwise_tree(double* v, int64_t n) {
    if (n == 0) return 0.0;
    while (n > 1) {
        const int64_t half = n / 2;
        for (int64_t i = 0; i < half; ++i) v[i] = v[2 * i] + v[2 * i + 1];
        if (n & 1) v[half] = v[n - 1];
        n = half + (n & 1);
    }
    return v[0];
}

float scale_from_sumsq(double sumsq, int64_t n) {
    return static_cast<float>(std::sqrt(sumsq / static_cast<double>(n)));
}

inline bool positive(float v) { return !(v < 0.0f); }  // 0, -0.0 and NaN code as +1

// The two error types: T is what one element is stored as; get reads it as a float, put stores one.
struct F32Err {
    using T = float;
    static float get(const T* e, int64_t i) { return e[i]; }
    static void put(T* e, int64_t i, float v) { e[i] = v; }
};

struct Bf16Err {
    using T = uint16_t;
    static float get(const T* e, int64_t i) {
        const uint32_t u = static_cast<uint32_t>(e[i]) << 16;
        float f;
        std::memcpy(&f, &u, sizeof f);
        return f;
    }
    static void put(T* e, int64_t i, float v) {
        uint32_t u;
        std::memcpy(&u, &v, sizeof u);
        e[i] = v != v ? uint16_t{0x7fc0} : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
};

// q_j * s for bit (7 - j) of `byte`: s, or s with its sign bit flipped (which is exactly -s).
inline float signed_value(float s, unsigned byte, int j) {
    uint32_t u;
    std::memcpy(&u, &s, sizeof u);
    u ^= ((~byte >> (7 - j)) & 1u) << 31;
    std::memcpy(&s, &u, sizeof s);
    return s;
}

// A byte-addressed buffer made of rows: byte i lives at base + (i / row_len) * stride + i % row_len.
struct ByteRows {
    uint8_t* base;
    int64_t row_len;
    int64_t stride;
    uint8_t* at(int64_t i) const { return base + (i / row_len) * stride + i % row_len; }
};

// Calls fn(first_byte, count, pointer) for the contiguous runs of bytes [lo, hi) of `rows`.
template <typename F>
void for_each_run(const ByteRows& rows, int64_t lo, int64_t hi, F&& fn) {
    while (lo < hi) {
        const int64_t in_row = rows.row_len - lo % rows.row_len;
        const int64_t count = in_row < hi - lo ? in_row : hi - lo;
        fn(lo, count, rows.at(lo));
        lo += count;
    }
}

// A segment table: segment i covers elements [bounds[i] / div, bounds[i + 1] / div), i < k
// (div = 1 for the worker's buffer and decode's output, n for the server's chunk).
struct Segments {
    const int64_t* bounds;
    int64_t k;
    int64_t div;
    int64_t lo(int64_t i) const { return bounds[i] / div; }
    int64_t hi(int64_t i) const { return bounds[i + 1] / div; }
    // The segment holding element `element` (0 <= element < hi(k - 1)).
    int64_t find(int64_t element) const {
        return std::upper_bound(bounds + 1, bounds + k + 1, element * div) - (bounds + 1);
    }
};

// The pieces of bytes [lo, hi) of a segmented buffer whose segments are each cut into `rows`
// equal chunks, chunk j of segment i going to wire row j (`row_bytes` bytes a row) at byte
// lo(i) / (8 rows): calls fn(i, j, first, count, wire) where bytes first .. first + count - 1
// (of chunk j of segment i) are wire bytes wire .. wire + count - 1. With rows = 1, wire = first.
template <typename F>
void for_each_piece(const Segments& seg, int64_t rows, int64_t row_bytes, int64_t lo, int64_t hi, F&& fn) {
    if (lo >= hi) return;
    int64_t i = seg.find(lo * 8);
    while (lo < hi) {
        const int64_t s0 = seg.lo(i) / 8, s1 = seg.hi(i) / 8;
        const int64_t chunk = (s1 - s0) / rows;
        const int64_t j = (lo - s0) / chunk;
        const int64_t end = s0 + (j + 1) * chunk < hi ? s0 + (j + 1) * chunk : hi;
        fn(i, j, lo, end - lo, j * row_bytes + s0 / rows + (lo - s0 - j * chunk));
        lo = end;
        if (lo == s1) ++i;
    }
}

// ---------------------------------------------------------------------------------------------
// Element sources, portable: value(i) gives element i; value8(i, v) elements i..i+7 (i % 8 == 0).

struct PlainSource {  // the sum-of-squares test hook
    const float* b;
    float value(int64_t i) const { return b[i]; }
    void value8(int64_t i, float* v) const {
        for (int j = 0; j < 8; ++j) v[j] = b[i + j];
    }
};

template <typename E>
struct WorkerSource {  // b = x + e
    const float* x;
    const typename E::T* e;
    float value(int64_t i) const { return x[i] + E::get(e, i); }
    void value8(int64_t i, float* v) const {
        for (int j = 0; j < 8; ++j) v[j] = x[i + j] + E::get(e, i + j);
    }
};

// b = clamp(x * m, -limit, limit) + e: two roundings, as the reference's two operations (the
// clamp rounds nothing; a NaN product stays NaN; limit +inf: no clamp). Read once, in the pass of
// the sums of squares, which also stores b into `b_out` (the error's output: the pack pass then
// reads b alone, and overwrites it with the new error).
inline float clamped(float p, float limit) { return p > limit ? limit : (p < -limit ? -limit : p); }

template <typename M>  // the multiplier's type (F32Err or Bf16Err: float32, or bfloat16 read exactly)
struct ScaledWorkerSource {
    const float* x;
    const typename M::T* m;
    const float* e;
    float* b_out;
    float limit;
    float value(int64_t i) const { return b_out[i] = clamped(x[i] * M::get(m, i), limit) + e[i]; }
    void value8(int64_t i, float* v) const {
        for (int j = 0; j < 8; ++j) v[j] = b_out[i + j] = clamped(x[i + j] * M::get(m, i + j), limit) + e[i + j];
    }
};

// The same b, computed again in each pass (an error narrower than b cannot hold it in between).
template <typename E, typename M>
struct ScaledAgainSource {
    const float* x;
    const typename M::T* m;
    const typename E::T* e;
    float limit;
    float value(int64_t i) const { return clamped(x[i] * M::get(m, i), limit) + E::get(e, i); }
    void value8(int64_t i, float* v) const {
        for (int j = 0; j < 8; ++j) v[j] = clamped(x[i + j] * M::get(m, i + j), limit) + E::get(e, i + j);
    }
};

template <typename E>
struct ServerSource {  // c = (s_0 q_0 + s_1 q_1 + ... ) / nrows + e, in rank order
    const uint8_t* signs;
    int64_t sign_stride;  // bytes between the rows of signs
    const float* scales;  // rank r's scale at scales[r * scale_stride]
    int64_t scale_stride;
    int64_t nrows;
    const typename E::T* e;
    float value(int64_t i) const {
        float v[8];
        value8(i & ~int64_t{7}, v);
        return v[i & 7];
    }
    void value8(int64_t i, float* v) const {  // nrows >= 1
        const int64_t byte = i >> 3;
        for (int j = 0; j < 8; ++j) v[j] = signed_value(scales[0], signs[byte], j);
        for (int64_t r = 1; r < nrows; ++r) {
            const unsigned bits = signs[r * sign_stride + byte];
            const float s = scales[r * scale_stride];
            for (int j = 0; j < 8; ++j) v[j] = v[j] + signed_value(s, bits, j);
        }
        const float n = static_cast<float>(nrows);
        for (int j = 0; j < 8; ++j) v[j] = v[j] / n + E::get(e, i + j);
    }
};

// Lane sums of one block [start, end) (at most 1024 elements, start % 8 == 0) into lanes[32]:
// element start + t adds to lane t % 32, in increasing t.
template <typename Src>
void block_lanes_scalar(const Src& src, int64_t start, int64_t end, double* lanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] = 0.0;
    float v[8];
    int64_t i = start;
    for (; i + 8 <= end; i += 8) {
        src.value8(i, v);
        double* lane = lanes + (i - start) % kLanes;
        for (int t = 0; t < 8; ++t) {
            const double d = static_cast<double>(v[t]);
            lane[t] += d * d;
        }
    }
    for (; i < end; ++i) {  // a length that is not a multiple of 8 (the sum-of-squares test hook)
        const double d = static_cast<double>(src.value(i));
        lanes[(i - start) % kLanes] += d * d;
    }
}

// Pack bytes [b0, b0 + count) into out[0..count), with the error update.
template <typename E, typename Src>
void pack_scalar(const Src& src, typename E::T* e, float s, int64_t b0, int64_t count, uint8_t* out) {
    float v[8];
    for (int64_t k = 0; k < count; ++k) {
        const int64_t i0 = (b0 + k) * 8;
        src.value8(i0, v);
        unsigned byte = 0;
        for (int j = 0; j < 8; ++j) {
            const bool bit = positive(v[j]);
            byte = (byte << 1) | static_cast<unsigned>(bit);
            E::put(e, i0 + j, v[j] - (bit ? s : -s));
        }
        out[k] = static_cast<uint8_t>(byte);
    }
}

// What decode does to each value q s of element i (relative to the run's start): nothing, a
// multiply by mult[i], or a division by div[i] (+0.0 where div[i] is 0).
struct AsIs {
    float apply(float v, int64_t) const { return v; }
};
struct Times {
    const float* mult;
    float apply(float v, int64_t i) const { return v * mult[i]; }
};
template <typename D>
struct Over {
    const typename D::T* div;
    float apply(float v, int64_t i) const {
        const float d = D::get(div, i);
        return d != 0.0f ? v / d : 0.0f;
    }
};

// keep (may be null): where bit (7 - j) of keep[k] is clear, out[k * 8 + j] is +0.0 instead.
template <typename Op>
void decode_scalar(const uint8_t* in, int64_t count, float s, const uint8_t* keep, const Op& op, float* out) {
    for (int64_t k = 0; k < count; ++k) {
        const unsigned kept = keep ? keep[k] : 0xffu;
        for (int j = 0; j < 8; ++j) {
            const float v = signed_value(s, in[k], j);
            out[k * 8 + j] = ((kept >> (7 - j)) & 1u) ? op.apply(v, k * 8 + j) : 0.0f;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// AVX2 paths (compiled for AVX2+FMA, used only when the CPU has them). Sources give load32(i, v):
// elements i..i+31 as 4 vectors, and load8(i) for a single group of 8.

#if ONEBIT_X86
#define ONEBIT_AVX2 __attribute__((target("avx2,fma")))

bool cpu_has_avx2() {
    static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return has;
}

// Lane j of kNegMask.mask[byte] is 0x80000000 where bit (7 - j) of `byte` is clear (q = -1),
// else 0: q * s is s ^ mask[byte].
struct NegMaskTable {
    alignas(32) uint32_t mask[256][8];
    NegMaskTable() {
        for (int b = 0; b < 256; ++b)
            for (int j = 0; j < 8; ++j) mask[b][j] = ((b >> (7 - j)) & 1) ? 0u : 0x80000000u;
    }
};
const NegMaskTable kNegMask;

ONEBIT_AVX2 inline __m256 signed_scale(__m256 s, unsigned byte) {
    return _mm256_xor_ps(s, _mm256_load_ps(reinterpret_cast<const float*>(kNegMask.mask[byte])));
}

// The byte (MSB = element 0) of the signs of 8 floats: bit set where !(v < 0).
ONEBIT_AVX2 inline unsigned sign_byte(__m256 v) {
    const __m256 neg = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256i reverse = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    const int m = _mm256_movemask_ps(_mm256_permutevar8x32_ps(neg, reverse));
    return static_cast<unsigned>(~m) & 0xffu;
}

struct PlainAvx2 {
    const float* b;
    ONEBIT_AVX2 __m256 load8(int64_t i) const { return _mm256_loadu_ps(b + i); }
    ONEBIT_AVX2 void load32(int64_t i, __m256* v) const {
        for (int q = 0; q < 4; ++q) v[q] = load8(i + 8 * q);
    }
};

// Eight errors (or multipliers, divisors) as floats, and eight floats stored as errors (bfloat16:
// rounded to nearest even).
ONEBIT_AVX2 inline __m256 load_errors(const float* e) { return _mm256_loadu_ps(e); }
ONEBIT_AVX2 inline __m256 load_errors(const uint16_t* e) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(e));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
ONEBIT_AVX2 inline void store_errors(float* e, __m256 v) { _mm256_storeu_ps(e, v); }
ONEBIT_AVX2 inline void store_errors(uint16_t* e, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(e), packed);
}

template <typename E>
struct WorkerAvx2 {
    const float* x;
    const typename E::T* e;
    ONEBIT_AVX2 __m256 load8(int64_t i) const {
        return _mm256_add_ps(_mm256_loadu_ps(x + i), load_errors(e + i));
    }
    ONEBIT_AVX2 void load32(int64_t i, __m256* v) const {
        for (int q = 0; q < 4; ++q) v[q] = load8(i + 8 * q);
    }
};

template <typename M>
struct ScaledWorkerAvx2 {
    const float* x;
    const typename M::T* m;
    const float* e;
    float* b_out;
    float limit;
    ONEBIT_AVX2 __m256 load8(int64_t i) const {  // a multiply, the clamp, then an add: no FMA
        // min(hi, p) and max(lo, p) return p when p is NaN (the second operand), as the scalar clamp
        const __m256 hi = _mm256_set1_ps(limit);
        const __m256 lo = _mm256_set1_ps(-limit);
        const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(x + i), load_errors(m + i));
        const __m256 b = _mm256_add_ps(_mm256_max_ps(lo, _mm256_min_ps(hi, p)), _mm256_loadu_ps(e + i));
        _mm256_storeu_ps(b_out + i, b);
        return b;
    }
    ONEBIT_AVX2 void load32(int64_t i, __m256* v) const {
        for (int q = 0; q < 4; ++q) v[q] = load8(i + 8 * q);
    }
};

template <typename E, typename M>
struct ScaledAgainAvx2 {
    const float* x;
    const typename M::T* m;
    const typename E::T* e;
    float limit;
    ONEBIT_AVX2 __m256 load8(int64_t i) const {  // as ScaledWorkerAvx2, without storing b
        const __m256 hi = _mm256_set1_ps(limit);
        const __m256 lo = _mm256_set1_ps(-limit);
        const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(x + i), load_errors(m + i));
        return _mm256_add_ps(_mm256_max_ps(lo, _mm256_min_ps(hi, p)), load_errors(e + i));
    }
    ONEBIT_AVX2 void load32(int64_t i, __m256* v) const {
        for (int q = 0; q < 4; ++q) v[q] = load8(i + 8 * q);
    }
};

template <typename E>
struct ServerAvx2 {
    ServerSource<E> src;
    // For a power-of-two rank count, acc * (1/n) is exactly acc / n (the reciprocal is exact, and
    // both round the same real number once); a multiply is much cheaper than a divide.
    bool pow2 = src.nrows > 0 && (src.nrows & (src.nrows - 1)) == 0;

    ONEBIT_AVX2 __m256 finish(__m256 acc, int64_t i) const {
        const float n = static_cast<float>(src.nrows);
        const __m256 mean = pow2 ? _mm256_mul_ps(acc, _mm256_set1_ps(1.0f / n)) : _mm256_div_ps(acc, _mm256_set1_ps(n));
        return _mm256_add_ps(mean, load_errors(src.e + i));
    }
    ONEBIT_AVX2 __m256 load8(int64_t i) const {
        const int64_t byte = i >> 3;
        __m256 acc = signed_scale(_mm256_set1_ps(src.scales[0]), src.signs[byte]);
        for (int64_t r = 1; r < src.nrows; ++r)
            acc = _mm256_add_ps(acc, signed_scale(_mm256_set1_ps(src.scales[r * src.scale_stride]),
                                                  src.signs[r * src.sign_stride + byte]));
        return finish(acc, i);
    }
    // Four bytes of every row at once: one 32-bit load and one broadcast per row for 32 elements.
    ONEBIT_AVX2 void load32(int64_t i, __m256* v) const {
        const int64_t byte = i >> 3;
        uint32_t w;
        std::memcpy(&w, src.signs + byte, 4);
        __m256 s = _mm256_set1_ps(src.scales[0]);
        for (int q = 0; q < 4; ++q) v[q] = signed_scale(s, (w >> (8 * q)) & 0xffu);
        for (int64_t r = 1; r < src.nrows; ++r) {
            std::memcpy(&w, src.signs + r * src.sign_stride + byte, 4);
            s = _mm256_set1_ps(src.scales[r * src.scale_stride]);
            for (int q = 0; q < 4; ++q) v[q] = _mm256_add_ps(v[q], signed_scale(s, (w >> (8 * q)) & 0xffu));
        }
        for (int q = 0; q < 4; ++q) v[q] = finish(v[q], i + 8 * q);
    }
};

// acc[2q], acc[2q + 1] (lanes 8q .. 8q + 7) += the squares of the 8 floats of v.
ONEBIT_AVX2 inline void add_squares(__m256 v, __m256d* acc) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    acc[0] = _mm256_fmadd_pd(lo, lo, acc[0]);  // exact square: FMA == mul + add
    acc[1] = _mm256_fmadd_pd(hi, hi, acc[1]);
}

// Lane sums of one block of `count` elements (a multiple of 8, at most 1024): lanes 0..31 in 8
// registers of 4 doubles; a partial last step fills the first count % 32 lanes.
template <typename Src>
ONEBIT_AVX2 void block_lanes_avx2(const Src& src, int64_t start, int64_t count, double* lanes) {
    __m256d acc[8];
    for (int q = 0; q < 8; ++q) acc[q] = _mm256_setzero_pd();
    __m256 v[4];
    const int64_t steps = count / kLanes;
    for (int64_t j = 0; j < steps; ++j) {
        src.load32(start + j * kLanes, v);
        for (int q = 0; q < 4; ++q) add_squares(v[q], acc + 2 * q);
    }
    const int64_t rest = (count % kLanes) / 8;
    for (int64_t q = 0; q < rest; ++q) add_squares(src.load8(start + steps * kLanes + 8 * q), acc + 2 * q);
    for (int q = 0; q < 8; ++q) _mm256_storeu_pd(lanes + 4 * q, acc[q]);
}

template <typename T>
ONEBIT_AVX2 inline unsigned pack8_avx2(__m256 v, __m256 ps, T* e) {
    const unsigned byte = sign_byte(v);
    store_errors(e, _mm256_sub_ps(v, signed_scale(ps, byte)));  // e = v - q*s
    return byte;
}

template <typename T, typename Src>
ONEBIT_AVX2 void pack_avx2(const Src& src, T* e, float s, int64_t b0, int64_t count, uint8_t* out) {
    const __m256 ps = _mm256_set1_ps(s);
    int64_t k = 0;
    __m256 v[4];
    for (; k + 4 <= count; k += 4) {
        const int64_t i = (b0 + k) * 8;
        src.load32(i, v);
        for (int q = 0; q < 4; ++q) out[k + q] = static_cast<uint8_t>(pack8_avx2(v[q], ps, e + i + 8 * q));
    }
    for (; k < count; ++k) {
        const int64_t i = (b0 + k) * 8;
        out[k] = static_cast<uint8_t>(pack8_avx2(src.load8(i), ps, e + i));
    }
}

// Streaming stores skip reading the output's cache lines first; used for outputs far larger than
// the caches, which would be evicted before they are read again anyway.
// All-ones lanes where bit (7 - j) of `byte` is set, zero lanes elsewhere.
ONEBIT_AVX2 inline __m256 bit_lanes(unsigned byte) {
    const __m256i bits = _mm256_set_epi32(1, 2, 4, 8, 16, 32, 64, 128);  // lane 0 = MSB
    const __m256i b = _mm256_set1_epi32(static_cast<int>(byte));
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, bits), bits));
}

// The vector forms of AsIs, Times and Over (a lane divided by 0 is +0.0).
struct AsIsAvx2 {
    ONEBIT_AVX2 __m256 apply(__m256 v, int64_t) const { return v; }
};
struct TimesAvx2 {
    const float* mult;
    ONEBIT_AVX2 __m256 apply(__m256 v, int64_t i) const { return _mm256_mul_ps(v, _mm256_loadu_ps(mult + i)); }
};
template <typename D>
struct OverAvx2 {
    const typename D::T* div;
    ONEBIT_AVX2 __m256 apply(__m256 v, int64_t i) const {
        const __m256 d = load_errors(div + i);
        const __m256 zero = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_EQ_OQ);
        return _mm256_andnot_ps(zero, _mm256_div_ps(v, d));
    }
};

template <bool kMasked, typename Op>
ONEBIT_AVX2 inline __m256 decoded(__m256 ps, const uint8_t* in, const uint8_t* keep, const Op& op, int64_t k) {
    const __m256 v = op.apply(signed_scale(ps, in[k]), 8 * k);
    return kMasked ? _mm256_and_ps(v, bit_lanes(keep[k])) : v;  // cleared lanes: +0.0
}

template <bool kMasked, typename Op>
ONEBIT_AVX2 void decode_avx2_impl(const uint8_t* in, int64_t count, float s, const uint8_t* keep, const Op& op,
                                  float* out, bool stream) {
    const __m256 ps = _mm256_set1_ps(s);
    int64_t k = 0;
    if (stream) {
        for (; k < count && (reinterpret_cast<uintptr_t>(out + 8 * k) & 31) != 0; ++k)
            _mm256_storeu_ps(out + 8 * k, decoded<kMasked>(ps, in, keep, op, k));
        for (; k < count; ++k) _mm256_stream_ps(out + 8 * k, decoded<kMasked>(ps, in, keep, op, k));
        _mm_sfence();
        return;
    }
    for (; k < count; ++k) _mm256_storeu_ps(out + 8 * k, decoded<kMasked>(ps, in, keep, op, k));
}

template <typename Op>
ONEBIT_AVX2 void decode_avx2(const uint8_t* in, int64_t count, float s, const uint8_t* keep, const Op& op,
                             float* out, bool stream) {
    if (keep)
        decode_avx2_impl<true>(in, count, s, keep, op, out, stream);
    else
        decode_avx2_impl<false>(in, count, s, keep, op, out, stream);
}
#else
bool cpu_has_avx2() { return false; }
#endif

bool use_avx2() { return cpu_has_avx2() && !g_force_scalar; }

// ---------------------------------------------------------------------------------------------
// Drivers shared by worker and server: pass 1 (blocked sums of squares of every segment), pass 2
// (pack + error update of every byte). `src_of(i)` / `vec_of(i)` give segment i's element source
// (portable / vector); both index elements of the whole buffer.

template <typename Src, typename Vec>
void block_lanes(const Src& src, const Vec& vec, bool avx2, int64_t start, int64_t end, double* lanes) {
#if ONEBIT_X86
    if (avx2 && (end - start) % 8 == 0) {
        block_lanes_avx2(vec, start, end - start, lanes);
        return;
    }
#else
    (void)avx2;
    (void)vec;
#endif
    block_lanes_scalar(src, start, end, lanes);
}

// sums[i] = the blocked sum of squares of segment i. All blocks of all segments (each segment's
// from its own start) form one list, split between the threads; then a tree per segment over its
// blocks' partials, which equals the tree over its lane sums: each block's 32 lanes are an aligned
// power-of-two group, i.e. a subtree.
template <typename SrcOf, typename VecOf>
void segment_sumsq(const Segments& seg, const SrcOf& src_of, const VecOf& vec_of, int threads, double* sums) {
    std::vector<int64_t> first(seg.k + 1, 0);  // first block of each segment
    for (int64_t i = 0; i < seg.k; ++i) first[i + 1] = first[i] + (seg.hi(i) - seg.lo(i) + kBlock - 1) / kBlock;
    const int64_t nblocks = first[seg.k];
    std::vector<double> partial(nblocks);
    const bool avx2 = use_avx2();
    parallel_ranges(nblocks, threads, [&](int64_t lo, int64_t hi) {
        alignas(32) double lanes[kLanes];
        int64_t i = std::upper_bound(first.begin() + 1, first.end(), lo) - (first.begin() + 1);
        for (int64_t b = lo; b < hi; ++b) {
            while (b >= first[i + 1]) ++i;
            const int64_t start = seg.lo(i) + (b - first[i]) * kBlock;
            const int64_t end = start + kBlock < seg.hi(i) ? start + kBlock : seg.hi(i);
            block_lanes(src_of(i), vec_of(i), avx2, start, end, lanes);
            partial[b] = pairwise_tree(lanes, kLanes);
        }
    });
    for (int64_t i = 0; i < seg.k; ++i) sums[i] = pairwise_tree(partial.data() + first[i], first[i + 1] - first[i]);
}

template <typename E, typename Src, typename Vec>
void pack(const Src& src, const Vec& vec, bool avx2, typename E::T* e, float s, int64_t b0, int64_t count,
          uint8_t* out) {
#if ONEBIT_X86
    if (avx2) {
        pack_avx2(vec, e, s, b0, count, out);
        return;
    }
#else
    (void)avx2;
    (void)vec;
#endif
    pack_scalar<E>(src, e, s, b0, count, out);
}

// Every segment's scale from its sum of squares, then the pack and error update of the `total / 8`
// input bytes: chunk j of segment i into row j of `out` (`rows` rows of total / (8 rows) bytes).
// (The sums read the sources of sum_src_of / sum_vec_of, the pack those of src_of / vec_of: the
// same values, read again or stored by the first pass.)
template <typename E, typename SumSrcOf, typename SumVecOf, typename SrcOf, typename VecOf>
void compress(const Segments& seg, const SumSrcOf& sum_src_of, const SumVecOf& sum_vec_of, const SrcOf& src_of,
              const VecOf& vec_of, typename E::T* e, int64_t total, int64_t rows, const ByteRows& out, float* scales,
              int threads) {
    std::vector<double> sums(seg.k);
    segment_sumsq(seg, sum_src_of, sum_vec_of, threads, sums.data());
    for (int64_t i = 0; i < seg.k; ++i) scales[i] = scale_from_sumsq(sums[i], seg.hi(i) - seg.lo(i));
    const bool avx2 = use_avx2();
    const int64_t nbytes = total / 8;
    parallel_ranges(nbytes, threads, [&](int64_t lo, int64_t hi) {
        for_each_piece(seg, rows, nbytes / rows, lo, hi, [&](int64_t i, int64_t, int64_t first, int64_t count,
                                                             int64_t wire) {
            const auto src = src_of(i);
            const auto vec = vec_of(i);
            for_each_run(out, wire, wire + count, [&](int64_t w0, int64_t c, uint8_t* dst) {
                pack<E>(src, vec, avx2, e, scales[i], first + (w0 - wire), c, dst);
            });
        });
    });
}

#if ONEBIT_X86
using PlainVec = PlainAvx2;
template <typename E> using WorkerVec = WorkerAvx2<E>;
template <typename M> using ScaledWorkerVec = ScaledWorkerAvx2<M>;
template <typename E, typename M> using ScaledAgainVec = ScaledAgainAvx2<E, M>;
template <typename E> using ServerVec = ServerAvx2<E>;
#else
using PlainVec = PlainSource;
template <typename E> using WorkerVec = WorkerSource<E>;
template <typename M> using ScaledWorkerVec = ScaledWorkerSource<M>;
template <typename E, typename M> using ScaledAgainVec = ScaledAgainSource<E, M>;
template <typename E> using ServerVec = ServerSource<E>;
#endif

// The worker of onebit_cpu_worker for one error type E and multiplier type M.
template <typename E, typename M>
void worker(const float* x, const typename M::T* m, float limit, const typename E::T* e, typename E::T* e_out,
            int64_t total, const Segments& seg, int64_t nrows, const ByteRows& rows, float* scales_out, int t) {
    if constexpr (std::is_same_v<E, F32Err>) {
        if (m) {  // b stored into e_out by the sums' pass, packed from there
            float* b = e_out;
            const float* ef = e;
            const auto stored = [b](int64_t) { return PlainSource{b}; };
            const auto stored_vec = [b](int64_t) { return PlainVec{b}; };
            compress<F32Err>(seg, [=](int64_t) { return ScaledWorkerSource<M>{x, m, ef, b, limit}; },
                             [=](int64_t) { return ScaledWorkerVec<M>{x, m, ef, b, limit}; }, stored, stored_vec, b,
                             total, nrows, rows, scales_out, t);
            return;
        }
    }
    if (m) {  // (a narrower error) b computed again by the pack pass
        const auto src_of = [=](int64_t) { return ScaledAgainSource<E, M>{x, m, e, limit}; };
        const auto vec_of = [=](int64_t) { return ScaledAgainVec<E, M>{x, m, e, limit}; };
        compress<E>(seg, src_of, vec_of, src_of, vec_of, e_out, total, nrows, rows, scales_out, t);
        return;
    }
    const auto src_of = [x, e](int64_t) { return WorkerSource<E>{x, e}; };
    const auto vec_of = [x, e](int64_t) { return WorkerVec<E>{x, e}; };
    compress<E>(seg, src_of, vec_of, src_of, vec_of, e_out, total, nrows, rows, scales_out, t);
}

// The server of onebit_cpu_server for one error type.
template <typename E>
void server(const uint8_t* signs, int64_t nrows, int64_t sign_stride, const float* scales, const typename E::T* e,
            typename E::T* e_out, int64_t n, const int64_t* bounds, int64_t k, const ByteRows& out, float* scales_out,
            int t) {
    const auto src_of = [=](int64_t i) { return ServerSource<E>{signs, sign_stride, scales + i, k, nrows, e}; };
#if ONEBIT_X86
    const auto vec_of = [=](int64_t i) { return ServerVec<E>{src_of(i)}; };
#else
    const auto vec_of = src_of;
#endif
    compress<E>(Segments{bounds, k, nrows}, src_of, vec_of, src_of, vec_of, e_out, n, 1, out, scales_out, t);
}

}  // namespace

#define ONEBIT_EXPORT __attribute__((visibility("default")))

extern "C" {

ONEBIT_EXPORT int onebit_cpu_abi(void) { return 7; }

// 1 when the AVX2 paths are in use, 0 for the portable paths.
ONEBIT_EXPORT int onebit_cpu_vector_path(void) { return use_avx2() ? 1 : 0; }

// Testing hook: force the portable paths (1) or allow AVX2 again (0).
ONEBIT_EXPORT void onebit_cpu_force_scalar(int on) { g_force_scalar = on != 0; }

// 1 when bounds[0..k] is a valid segment table over `total` elements: 0, ..., total, every segment
// a positive multiple of `unit` elements; else 0 (cpu.py then names the problem).
ONEBIT_EXPORT int onebit_cpu_valid_bounds(const int64_t* bounds, int64_t k, int64_t total, int64_t unit) {
    if (k < 1 || unit < 1 || bounds[0] != 0 || bounds[k] != total) return 0;
    for (int64_t i = 0; i < k; ++i) {
        const int64_t length = bounds[i + 1] - bounds[i];
        if (length <= 0 || length % unit != 0) return 0;
    }
    return 1;
}

// The blocked sum of squares of a float32 buffer of any length (for tests of the definition).
ONEBIT_EXPORT double onebit_cpu_sumsq(const float* b, int64_t n, int threads) {
    const int64_t bounds[2] = {0, n};
    double sum = 0.0;
    segment_sumsq(Segments{bounds, 1, 1}, [b](int64_t) { return PlainSource{b}; },
                  [b](int64_t) { return PlainVec{b}; }, clamp_threads(threads, n), &sum);
    return sum;
}

// Worker over `total` elements in the k segments of `bounds` (k + 1 entries, 0 .. total, each
// segment a multiple of 8 nrows): b = x + e (or clamp(x * m, -limit, limit) + e where m is not
// null; limit +inf: no clamp); per segment i, scale_i = blocked RMS of its b; chunk j
// of it packed into wire row j at byte bounds[i] / (8 nrows); e_out <- b - scale_i * sign(b)
// (e_out may be e, or a buffer of its own: e is then left as it was); scales into
// scales_out[0..k). Wire byte w (row w / (total / (8 nrows))) lives at
// packed + (w / row_len) * row_stride + w % row_len. e and e_out: float32, or bfloat16 where
// error_bf16 is 1; m: float32, or bfloat16 where multiplier_bf16 is 1.
ONEBIT_EXPORT void onebit_cpu_worker(const float* x, const void* m, float limit, const void* e, void* e_out,
                                     int64_t total, const int64_t* bounds, int64_t k, int64_t nrows, uint8_t* packed,
                                     int64_t row_len, int64_t row_stride, float* scales_out, int threads,
                                     int error_bf16, int multiplier_bf16) {
    const Segments seg{bounds, k, 1};
    const ByteRows rows{packed, row_len, row_stride};
    const int t = clamp_threads(threads, total);
    const auto run = [&](auto error, auto multiplier) {
        using E = decltype(error);
        using M = decltype(multiplier);
        worker<E, M>(x, static_cast<const typename M::T*>(m), limit, static_cast<const typename E::T*>(e),
                     static_cast<typename E::T*>(e_out), total, seg, nrows, rows, scales_out, t);
    };
    if (error_bf16)
        multiplier_bf16 ? run(Bf16Err{}, Bf16Err{}) : run(Bf16Err{}, F32Err{});
    else
        multiplier_bf16 ? run(F32Err{}, Bf16Err{}) : run(F32Err{}, F32Err{});
}

// Server over a chunk of n elements whose segments are bounds / nrows (`bounds`: the worker's
// table, k + 1 entries): per segment i, c = (sum_r scales[r * k + i] * q_r) / nrows + e;
// scale_i = blocked RMS of its c; packed <- signs of c (byte w at packed + (w / row_len) *
// row_stride + w % row_len); e_out <- c - scale_i * sign(c) (e_out may be e); scales into
// scales_out[0..k). `signs` holds nrows rows of n / 8 bytes, `sign_stride` bytes apart. e and
// e_out: float32, or bfloat16 where error_bf16 is 1.
ONEBIT_EXPORT void onebit_cpu_server(const uint8_t* signs, int64_t nrows, int64_t sign_stride, const float* scales,
                                     const void* e, void* e_out, int64_t n, const int64_t* bounds, int64_t k,
                                     uint8_t* packed, int64_t row_len, int64_t row_stride, float* scales_out,
                                     int threads, int error_bf16) {
    const ByteRows out{packed, row_len, row_stride};
    const int t = clamp_threads(threads, n);
    if (error_bf16)
        server<Bf16Err>(signs, nrows, sign_stride, scales, static_cast<const uint16_t*>(e), static_cast<uint16_t*>(e_out),
                        n, bounds, k, out, scales_out, t);
    else
        server<F32Err>(signs, nrows, sign_stride, scales, static_cast<const float*>(e), static_cast<float*>(e_out), n,
                       bounds, k, out, scales_out, t);
}

// Decode: for segment i of `bounds` (k + 1 entries over out's nrows * row_bytes * 8 elements),
// chunk j: out[o_i + j L_i + p] = +-scales[j * k + i] from bit (7 - p % 8) of byte
// o_i / (8 nrows) + p / 8 of row j of `signs` (rows `sign_stride` bytes apart), times mult[o_i + j L_i + p]
// where mult (out's length, may be null) is given, or divided by div[...] where div (out's length,
// float32, or bfloat16 where div_bf16 is 1; may be null; not with mult) is given (+0.0 where it is
// 0), or +0.0 where keep (packed bits over out, may be null) has that bit clear.
ONEBIT_EXPORT void onebit_cpu_decode(const uint8_t* signs, int64_t nrows, int64_t sign_stride, int64_t row_bytes,
                                     const float* scales, const int64_t* bounds, int64_t k, const uint8_t* keep,
                                     const float* mult, const void* div, int div_bf16, float* out, int threads) {
    const int64_t total = nrows * row_bytes;
    const int t = clamp_threads(threads, total * 8);
    const Segments seg{bounds, k, 1};
    const ByteRows rows{const_cast<uint8_t*>(signs), row_bytes, sign_stride};
    const bool avx2 = use_avx2();
    const bool stream = total * 8 * static_cast<int64_t>(sizeof(float)) >= kStreamBytes;
    const auto run = [&](const uint8_t* in, int64_t c, float s, const uint8_t* kp, int64_t first, float* o) {
        // first: the run's first element of out (the offset of mult and div)
#if ONEBIT_X86
        if (avx2) {
            if (mult)
                decode_avx2(in, c, s, kp, TimesAvx2{mult + first}, o, stream);
            else if (div && div_bf16)
                decode_avx2(in, c, s, kp, OverAvx2<Bf16Err>{static_cast<const uint16_t*>(div) + first}, o, stream);
            else if (div)
                decode_avx2(in, c, s, kp, OverAvx2<F32Err>{static_cast<const float*>(div) + first}, o, stream);
            else
                decode_avx2(in, c, s, kp, AsIsAvx2{}, o, stream);
            return;
        }
#endif
        (void)avx2;
        (void)stream;
        if (mult)
            decode_scalar(in, c, s, kp, Times{mult + first}, o);
        else if (div && div_bf16)
            decode_scalar(in, c, s, kp, Over<Bf16Err>{static_cast<const uint16_t*>(div) + first}, o);
        else if (div)
            decode_scalar(in, c, s, kp, Over<F32Err>{static_cast<const float*>(div) + first}, o);
        else
            decode_scalar(in, c, s, kp, AsIs{}, o);
    };
    parallel_ranges(total, t, [&](int64_t lo, int64_t hi) {
        for_each_piece(seg, nrows, row_bytes, lo, hi, [&](int64_t i, int64_t j, int64_t first, int64_t count,
                                                          int64_t wire) {
            const float s = scales[j * k + i];
            for_each_run(rows, wire, wire + count, [&](int64_t w0, int64_t c, uint8_t* in) {
                const int64_t b0 = first + (w0 - wire);  // output byte: elements 8 b0 .. 8 b0 + 7
                run(in, c, s, keep ? keep + b0 : nullptr, b0 * 8, out + b0 * 8);
            });
        });
    });
}

}  // extern "C"
