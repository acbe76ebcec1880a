// onebit CUDA kernels: worker / server sign-pack with error feedback, and decode.
//
// Loaded at run time by onebit/kernels/cuda.py (CuPy RawModule, NVRTC) and launched on torch's
// current stream. They equal onebit.kernels.reference bit for bit:
//
// * worker value: v = x + e; with a multiplier m (not null), v = clamp(x * m, -limit, limit) + e: a
//   float32 multiply and a float32 add, each rounded once; the clamp rounds nothing (what torch's
//   clamp gives: -0.0 and subnormals inside the range stay, +-inf go to +-limit, NaN stays NaN);
//   limit = +inf (the caller's "no limit") clamps nothing;
// * sign: bit set (q = +1) where !(v < 0): 0, -0.0 and NaN give +1; 8 elements per byte, the
//   first element in the most significant bit;
// * error: e <- v - (q ? s : -s), one float32 subtraction, written to e_out where it is not null
//   (e then left as it is), else to e in place;
// * decode: q s, times m (one float32 multiply) where a multiplier is given, then +0.0 where the
//   keep bit is clear;
// * server: acc = q_0 s_0; acc += q_i s_i for i = 1..n-1 in rank order; c = acc / n + e, each a
//   single IEEE float32 operation (explicit _rn intrinsics, so no contraction or fast division);
// * scale: the blocked float64 sum of onebit/kernels/blocked.py, whose order is fixed: lane l of
//   block k (1024 elements = 32 steps x 32 lanes) sums v[1024k + 32j + l]^2 for j = 0..31, then the
//   lane sums are reduced by the adjacent pairwise tree, here in groups of 32 per thread per
//   launch (an aligned group of 32 is exactly a subtree, and padding with +0.0 changes nothing).
//   Squares of floats are exact in double, so the order is all that matters, and it is the same
//   as on the CPU: the scale is bit-identical, not merely within a tolerance.
//
// Segments. A buffer of M elements is cut by its segment table bounds = [0, o_1, ..., M] into k
// segments, each a multiple of 8 n elements (n ranks), each with its own scale (blocks aligned to
// the segment's start, the last block of a segment partial). Chunk j of segment i (L_i elements)
// travels in wire row j at element o_i / n. One launch covers every segment, so the number of
// launches per call does not grow with k; the host builds these tables once per distinct
// segment table (onebit/kernels/cuda.py keeps their device copies):
//
// * bounds: the k + 1 element offsets (the server's are the worker's divided by n);
// * blocks: 3 entries per 1024-element block of every segment, segment by segment: the block's
//   first element, its segment's end (elements past it are the zero padding) and its segment;
// * one group table per tree level: 2 entries per group of at most 32 values, the input range
//   [lo, hi) within one segment's values (each segment's list, padded with +0.0 to a multiple of
//   32, is cut into aligned groups: exactly the pairwise tree). Group g writes output g, so the
//   outputs are again grouped by segment; the levels go on until every segment has one value,
//   and the last level (k groups, group i = segment i) writes the float32 scales.
//
// Every kernel is a per-thread *body* (a __host__ __device__ function of the thread index, with
// no shared memory, shuffles or atomics) plus a one-line __global__ wrapper. Compiled as plain
// C++ (g++ -x c++, no __CUDACC__), this file instead defines host launchers host_<kernel>(nthreads,
// args...) that run the same bodies in a loop, which is how the tests check the logic on machines
// without a GPU. Integer parameters are all long long, pointers are passed as 64-bit values; the
// worker's limit is passed as the bits of its float32 value in a long long.

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define ONEBIT_DEVICE_BUILD 1
#define ONEBIT_HD __host__ __device__ __forceinline__
#else
#define ONEBIT_DEVICE_BUILD 0
#define ONEBIT_HD inline
#endif

#if defined(__CUDA_ARCH__)
// Device code: every float32 operation, and the conversions between float and double, as inline PTX
// with an explicit rounding and without .ftz. CuPy appends -ftz=true to the options of every module it
// compiles (after ours, so that flag wins); NVRTC then flushes subnormal inputs and results of the
// float32 intrinsics (__fadd_rn included), of comparisons, negations and conversions to +-0. Inline
// PTX is what the flag cannot change. Double operations never flush; no contraction into FMAs.
__device__ __forceinline__ float onebit_fadd_rn(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float onebit_fsub_rn(float a, float b) {
    float r;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float onebit_fmul_rn(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float onebit_fdiv_rn(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ double onebit_f2d(float a) {
    double r;
    asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(a));
    return r;
}
__device__ __forceinline__ float onebit_d2f_rn(double a) {
    float r;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(a));
    return r;
}
#define ONEBIT_FADD(a, b) onebit_fadd_rn((a), (b))
#define ONEBIT_FSUB(a, b) onebit_fsub_rn((a), (b))
#define ONEBIT_FMUL(a, b) onebit_fmul_rn((a), (b))
#define ONEBIT_FDIV(a, b) onebit_fdiv_rn((a), (b))
#define ONEBIT_F2U(a) __float_as_uint(a)
#define ONEBIT_U2F(a) __uint_as_float(a)
#define ONEBIT_FNEG(a) __uint_as_float(__float_as_uint(a) ^ 0x80000000u)
// v < 0 on the bits: the sign bit set on a value that is neither +-0 nor NaN (subnormals count).
#define ONEBIT_IS_NEGATIVE(v) \
    ((__float_as_uint(v) >> 31) && (__float_as_uint(v) & 0x7fffffffu) - 1u < 0x7f800000u)
#define ONEBIT_F2D(a) onebit_f2d(a)
#define ONEBIT_DADD(a, b) __dadd_rn((a), (b))
#define ONEBIT_DMUL(a, b) __dmul_rn((a), (b))
#define ONEBIT_DDIV(a, b) __ddiv_rn((a), (b))
#define ONEBIT_DSQRT(a) __dsqrt_rn(a)
#define ONEBIT_D2F(a) onebit_d2f_rn(a)
#define ONEBIT_UNROLL _Pragma("unroll")
#else
// Host code (the test harness; build it with -ffp-contract=off): plain IEEE operations.
#include <cmath>
#include <cstring>
inline unsigned onebit_f2u(float a) {
    unsigned u;
    std::memcpy(&u, &a, sizeof u);
    return u;
}
inline float onebit_u2f(unsigned u) {
    float a;
    std::memcpy(&a, &u, sizeof a);
    return a;
}
#define ONEBIT_F2U(a) onebit_f2u(a)
#define ONEBIT_U2F(a) onebit_u2f(a)
#define ONEBIT_FADD(a, b) ((a) + (b))
#define ONEBIT_FSUB(a, b) ((a) - (b))
#define ONEBIT_FMUL(a, b) ((a) * (b))
#define ONEBIT_FDIV(a, b) ((a) / (b))
#define ONEBIT_FNEG(a) (-(a))
#define ONEBIT_IS_NEGATIVE(v) ((v) < 0.0f)
#define ONEBIT_F2D(a) static_cast<double>(a)
#define ONEBIT_DADD(a, b) ((a) + (b))
#define ONEBIT_DMUL(a, b) ((a) * (b))
#define ONEBIT_DDIV(a, b) ((a) / (b))
#define ONEBIT_DSQRT(a) std::sqrt(a)
#define ONEBIT_D2F(a) static_cast<float>(a)
#define ONEBIT_UNROLL
#endif

typedef long long onebit_i64;
typedef unsigned char onebit_u8;

#define ONEBIT_LANES 32
#define ONEBIT_STEPS 32
#define ONEBIT_BLOCK (ONEBIT_LANES * ONEBIT_STEPS)
#define ONEBIT_TREE_GROUP 32

// ----------------------------------------------------------------------------------------------
// Per-element logic.

ONEBIT_HD int onebit_sign_bit(float v) { return !ONEBIT_IS_NEGATIVE(v); }

ONEBIT_HD float onebit_error(float v, int bit, float s) { return ONEBIT_FSUB(v, bit ? s : ONEBIT_FNEG(s)); }

ONEBIT_HD int onebit_bit_of(const onebit_u8* row, onebit_i64 i) { return (row[i >> 3] >> (7 - (int)(i & 7))) & 1; }

// clamp(p, -limit, limit) on the bits, for limit_bits the bits of a float32 limit > 0 (+inf: no
// clamp): a magnitude above the limit's that is not NaN's (NaN's magnitude bits exceed +inf's) gives
// the limit with p's sign, anything else is p itself (-0.0, subnormals within the limit and NaN
// included), which is torch's clamp. Integer comparisons: nothing to flush, the same on the host.
ONEBIT_HD float onebit_clamp(float p, unsigned limit_bits) {
    const unsigned u = ONEBIT_F2U(p), magnitude = u & 0x7fffffffu;
    return magnitude > limit_bits && magnitude <= 0x7f800000u ? ONEBIT_U2F((u & 0x80000000u) | limit_bits) : p;
}

// v = x + e, or v = clamp(x * m, -limit, limit) + e where m is not null (limit ignored without m).
ONEBIT_HD float onebit_worker_value(const float* x, const float* m, unsigned limit_bits, const float* e,
                                    onebit_i64 i) {
    return ONEBIT_FADD(m ? onebit_clamp(ONEBIT_FMUL(x[i], m[i]), limit_bits) : x[i], e[i]);
}

// c = (sum_r q_r s_r) / nrows + e, in rank order; rank r's scale is scales[r * scale_stride] (the
// caller points scales at its segment's column of the (nrows, k) table and passes k).
ONEBIT_HD float onebit_server_value(const onebit_u8* signs, onebit_i64 sign_stride, const float* scales,
                                    onebit_i64 scale_stride, onebit_i64 nrows, const float* e, onebit_i64 i) {
    float acc = 0.0f;
    for (onebit_i64 r = 0; r < nrows; ++r) {
        const float s = scales[r * scale_stride];
        const float v = onebit_bit_of(signs + r * sign_stride, i) ? s : ONEBIT_FNEG(s);
        acc = r == 0 ? v : ONEBIT_FADD(acc, v);
    }
    return ONEBIT_FADD(ONEBIT_FDIV(acc, (float)nrows), e[i]);
}

ONEBIT_HD double onebit_square(float v) {
    const double d = ONEBIT_F2D(v);
    return ONEBIT_DMUL(d, d);  // exact: a float's square fits in a double
}

ONEBIT_HD float onebit_scale_from_sumsq(double sumsq, onebit_i64 count) {
    return ONEBIT_D2F(ONEBIT_DSQRT(ONEBIT_DDIV(sumsq, (double)count)));
}

// The segment holding element i: the largest s in [0, nseg) with bounds[s] <= i (bounds has
// nseg + 1 entries, bounds[0] = 0 <= i < bounds[nseg]).
//
// Why a binary search over the bounds rather than a table per byte or per thread block: the table
// stays k + 1 entries (a per-byte table would be as large as the packed signs and cost its own
// memory traffic on every call), the search is ceil(log2 k) loads (none for one segment, 10 for
// 1,000 segments), and the threads of a warp handle 256 consecutive elements, so they nearly always
// load the same entries: broadcasts from L1, no extra DRAM traffic. The pack and decode kernels are
// bound by memory bandwidth (32 to 64 bytes per thread), which these few cached loads do not change.
ONEBIT_HD onebit_i64 onebit_segment_of(const onebit_i64* bounds, onebit_i64 nseg, onebit_i64 i) {
    onebit_i64 lo = 0, hi = nseg;  // invariant: bounds[lo] <= i < bounds[hi]
    while (hi - lo > 1) {
        const onebit_i64 mid = lo + (hi - lo) / 2;
        if (bounds[mid] <= i) lo = mid; else hi = mid;
    }
    return lo;
}

// Where byte t of a buffer of M = 8 * nbytes elements cut by bounds goes on the wire: segment s,
// row j (the chunk of the segment holding it) and column col of that row. Chunk j of segment s
// (L = (o_{s+1} - o_s) / nrows elements, L / 8 bytes) lies at row bytes o_s / (8 nrows) + p.
ONEBIT_HD void onebit_wire_position(const onebit_i64* bounds, onebit_i64 nseg, onebit_i64 nrows, onebit_i64 t,
                                    onebit_i64* s, onebit_i64* j, onebit_i64* col) {
    *s = onebit_segment_of(bounds, nseg, t * 8);
    const onebit_i64 lo = bounds[*s];
    const onebit_i64 chunk_bytes = (bounds[*s + 1] - lo) / (8 * nrows);
    const onebit_i64 local = t - lo / 8;
    *j = local / chunk_bytes;
    *col = lo / (8 * nrows) + (local - *j * chunk_bytes);
}

// ----------------------------------------------------------------------------------------------
// Kernel bodies: t is the global thread index; each returns at once when t is out of range.

// Thread t = 32b + l computes lane l of block b of the block table (start, end, segment) of the
// blocked sum of squares of the worker value v (x + e, or with m and limit: see
// onebit_worker_value): sum of v[start + 32j + l]^2 over j = 0..31, below end.
ONEBIT_HD void onebit_worker_sumsq_body(onebit_i64 t, const float* x, const float* m, onebit_i64 limit,
                                        const float* e, const onebit_i64* blocks, onebit_i64 nblocks,
                                        double* lanes) {
    if (t >= nblocks * ONEBIT_LANES) return;
    const onebit_i64* block = blocks + 3 * (t / ONEBIT_LANES);
    const onebit_i64 first = block[0] + t % ONEBIT_LANES, end = block[1];
    double acc = 0.0;
    for (int j = 0; j < ONEBIT_STEPS; ++j) {
        const onebit_i64 i = first + (onebit_i64)j * ONEBIT_LANES;
        if (i < end) acc = ONEBIT_DADD(acc, onebit_square(onebit_worker_value(x, m, (unsigned)limit, e, i)));
    }
    lanes[t] = acc;
}

// The same for the server's c (block table over the server's chunk; scales is the (nrows, nseg)
// table of the ranks' scales, the block's segment picks the column).
ONEBIT_HD void onebit_server_sumsq_body(onebit_i64 t, const onebit_u8* signs, onebit_i64 sign_stride,
                                        const float* scales, onebit_i64 nrows, onebit_i64 nseg, const float* e,
                                        const onebit_i64* blocks, onebit_i64 nblocks, double* lanes) {
    if (t >= nblocks * ONEBIT_LANES) return;
    const onebit_i64* block = blocks + 3 * (t / ONEBIT_LANES);
    const onebit_i64 first = block[0] + t % ONEBIT_LANES, end = block[1];
    const float* column = scales + block[2];
    double acc = 0.0;
    for (int j = 0; j < ONEBIT_STEPS; ++j) {
        const onebit_i64 i = first + (onebit_i64)j * ONEBIT_LANES;
        if (i < end) {
            const float c = onebit_server_value(signs, sign_stride, column, nseg, nrows, e, i);
            acc = ONEBIT_DADD(acc, onebit_square(c));
        }
    }
    lanes[t] = acc;
}

// Thread t reduces in[lo .. hi) (groups[2t], groups[2t + 1]: at most 32 values of one segment,
// zeros past hi) by the adjacent pairwise tree into out[t]. On the last level (scales not null,
// one group per segment) it also writes scales[t] = float(sqrt(sum / counts[t])).
ONEBIT_HD void onebit_tree_sum_body(onebit_i64 t, const double* in, const onebit_i64* groups, onebit_i64 ngroups,
                                    double* out, const onebit_i64* counts, float* scales) {
    if (t >= ngroups) return;
    const onebit_i64 lo = groups[2 * t], hi = groups[2 * t + 1];
    double v[ONEBIT_TREE_GROUP];
    ONEBIT_UNROLL
    for (int k = 0; k < ONEBIT_TREE_GROUP; ++k) {
        const onebit_i64 i = lo + k;
        v[k] = i < hi ? in[i] : 0.0;
    }
    // Levels of widths 16, 8, 4, 2, 1 (ONEBIT_TREE_GROUP = 32), each loop with a constant bound
    // so that the array stays in registers.
    ONEBIT_UNROLL
    for (int k = 0; k < 16; ++k) v[k] = ONEBIT_DADD(v[2 * k], v[2 * k + 1]);
    ONEBIT_UNROLL
    for (int k = 0; k < 8; ++k) v[k] = ONEBIT_DADD(v[2 * k], v[2 * k + 1]);
    ONEBIT_UNROLL
    for (int k = 0; k < 4; ++k) v[k] = ONEBIT_DADD(v[2 * k], v[2 * k + 1]);
    ONEBIT_UNROLL
    for (int k = 0; k < 2; ++k) v[k] = ONEBIT_DADD(v[2 * k], v[2 * k + 1]);
    v[0] = ONEBIT_DADD(v[0], v[1]);
    out[t] = v[0];
    if (scales != 0) scales[t] = onebit_scale_from_sumsq(v[0], counts[t]);
}

// Thread t packs elements 8t .. 8t+7 of the worker value v (the same as the sum of squares read;
// M = 8 * nbytes elements cut by bounds, nrows wire rows of nbytes / nrows bytes) into their wire
// byte, row j column col, at packed + (lin / row_len) * row_stride + lin % row_len with
// lin = j * (nbytes / nrows) + col, and writes their errors with the scale of their segment to e_out
// (null: to e in place).
ONEBIT_HD void onebit_worker_pack_body(onebit_i64 t, const float* x, const float* m, onebit_i64 limit, float* e,
                                       float* e_out, onebit_i64 nbytes, const onebit_i64* bounds, onebit_i64 nseg,
                                       onebit_i64 nrows, const float* scales, onebit_u8* packed,
                                       onebit_i64 row_len, onebit_i64 row_stride) {
    if (t >= nbytes) return;
    onebit_i64 s, j, col;
    onebit_wire_position(bounds, nseg, nrows, t, &s, &j, &col);
    const float scale = scales[s];
    float* target = e_out ? e_out : e;
    int byte = 0;
    for (int k = 0; k < 8; ++k) {
        const onebit_i64 i = t * 8 + k;
        const float v = onebit_worker_value(x, m, (unsigned)limit, e, i);
        const int bit = onebit_sign_bit(v);
        byte = (byte << 1) | bit;
        target[i] = onebit_error(v, bit, scale);
    }
    const onebit_i64 lin = j * (nbytes / nrows) + col;
    packed[(lin / row_len) * row_stride + lin % row_len] = (onebit_u8)byte;
}

// Thread t computes c for elements 8t .. 8t+7 of the server's chunk (cut by the server's bounds;
// scales the (nrows, nseg) ranks' scales, server_scales the k scales of c), packs sign(c) into
// byte t (the same position as in the signs rows) and writes the errors to e_out (null: to e in place).
ONEBIT_HD void onebit_server_pack_body(onebit_i64 t, const onebit_u8* signs, onebit_i64 sign_stride,
                                       const float* scales, onebit_i64 nrows, float* e, float* e_out,
                                       onebit_i64 nbytes,
                                       const onebit_i64* bounds, onebit_i64 nseg, const float* server_scales,
                                       onebit_u8* packed, onebit_i64 row_len, onebit_i64 row_stride) {
    if (t >= nbytes) return;
    const onebit_i64 seg = onebit_segment_of(bounds, nseg, t * 8);
    const float s = server_scales[seg];
    const float* column = scales + seg;
    float* target = e_out ? e_out : e;
    int byte = 0;
    for (int k = 0; k < 8; ++k) {
        const onebit_i64 i = t * 8 + k;
        const float v = onebit_server_value(signs, sign_stride, column, nseg, nrows, e, i);
        const int bit = onebit_sign_bit(v);
        byte = (byte << 1) | bit;
        target[i] = onebit_error(v, bit, s);
    }
    packed[(t / row_len) * row_stride + t % row_len] = (onebit_u8)byte;
}

// Thread t decodes out[8t .. 8t+7] (M = 8 * nbytes elements cut by bounds): the wire byte of row j
// (rows sign_stride apart) and column col that holds them, times scales[j * nseg + s] of server j
// for segment s, times m[8t + k] (one float32 multiply) where m is not null; where bit (7 - k) of
// keep[t] is clear (keep not null), out is +0.0 instead (whatever the product: 0 * inf is NaN).
ONEBIT_HD void onebit_decode_body(onebit_i64 t, const onebit_u8* signs, onebit_i64 sign_stride, const float* scales,
                                  onebit_i64 nrows, const onebit_i64* bounds, onebit_i64 nseg, const onebit_u8* keep,
                                  const float* m, onebit_i64 nbytes, float* out) {
    if (t >= nbytes) return;
    onebit_i64 s, j, col;
    onebit_wire_position(bounds, nseg, nrows, t, &s, &j, &col);
    const int byte = signs[j * sign_stride + col];
    const int kept = keep ? keep[t] : 0xff;
    const float scale = scales[j * nseg + s], negative = ONEBIT_FNEG(scale);
    for (int k = 0; k < 8; ++k) {
        const onebit_i64 i = t * 8 + k;
        const float q = ((byte >> (7 - k)) & 1) ? scale : negative;
        out[i] = ((kept >> (7 - k)) & 1) ? (m ? ONEBIT_FMUL(q, m[i]) : q) : 0.0f;
    }
}

// ----------------------------------------------------------------------------------------------
// Entry points: __global__ wrappers on the device, host launchers (a loop over t) otherwise.

#define ONEBIT_STRIP(...) __VA_ARGS__
#if ONEBIT_DEVICE_BUILD
#define ONEBIT_KERNEL(name, params, args)                                                  \
    extern "C" __global__ void name(ONEBIT_STRIP params) {                                 \
        const onebit_i64 t = (onebit_i64)blockIdx.x * blockDim.x + threadIdx.x;            \
        name##_body(t, ONEBIT_STRIP args);                                                 \
    }
#else
#define ONEBIT_KERNEL(name, params, args)                                                  \
    extern "C" void host_##name(onebit_i64 nthreads, ONEBIT_STRIP params) {                \
        for (onebit_i64 t = 0; t < nthreads; ++t) name##_body(t, ONEBIT_STRIP args);       \
    }
#endif

ONEBIT_KERNEL(onebit_worker_sumsq,
              (const float* x, const float* m, onebit_i64 limit, const float* e, const onebit_i64* blocks,
               onebit_i64 nblocks, double* lanes),
              (x, m, limit, e, blocks, nblocks, lanes))
ONEBIT_KERNEL(onebit_server_sumsq,
              (const onebit_u8* signs, onebit_i64 sign_stride, const float* scales, onebit_i64 nrows, onebit_i64 nseg,
               const float* e, const onebit_i64* blocks, onebit_i64 nblocks, double* lanes),
              (signs, sign_stride, scales, nrows, nseg, e, blocks, nblocks, lanes))
ONEBIT_KERNEL(onebit_tree_sum,
              (const double* in, const onebit_i64* groups, onebit_i64 ngroups, double* out, const onebit_i64* counts,
               float* scales),
              (in, groups, ngroups, out, counts, scales))
ONEBIT_KERNEL(onebit_worker_pack,
              (const float* x, const float* m, onebit_i64 limit, float* e, float* e_out, onebit_i64 nbytes,
               const onebit_i64* bounds, onebit_i64 nseg, onebit_i64 nrows, const float* scales, onebit_u8* packed,
               onebit_i64 row_len, onebit_i64 row_stride),
              (x, m, limit, e, e_out, nbytes, bounds, nseg, nrows, scales, packed, row_len, row_stride))
ONEBIT_KERNEL(onebit_server_pack,
              (const onebit_u8* signs, onebit_i64 sign_stride, const float* scales, onebit_i64 nrows, float* e,
               float* e_out, onebit_i64 nbytes, const onebit_i64* bounds, onebit_i64 nseg, const float* server_scales,
               onebit_u8* packed, onebit_i64 row_len, onebit_i64 row_stride),
              (signs, sign_stride, scales, nrows, e, e_out, nbytes, bounds, nseg, server_scales, packed, row_len,
               row_stride))
ONEBIT_KERNEL(onebit_decode,
              (const onebit_u8* signs, onebit_i64 sign_stride, const float* scales, onebit_i64 nrows,
               const onebit_i64* bounds, onebit_i64 nseg, const onebit_u8* keep, const float* m, onebit_i64 nbytes,
               float* out),
              (signs, sign_stride, scales, nrows, bounds, nseg, keep, m, nbytes, out))
