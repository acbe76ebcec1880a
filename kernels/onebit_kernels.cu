// onebit CUDA kernels: worker / server sign-pack with error feedback, and decode.
//
// Loaded at run time by onebit/kernels/cuda.py (CuPy RawModule, NVRTC) and launched on torch's
// current stream. They equal onebit.kernels.reference bit for bit:
//
// * sign: bit set (q = +1) where !(v < 0): 0, -0.0 and NaN give +1; 8 elements per byte, the
//   first element in the most significant bit;
// * error: e <- v - (q ? s : -s), one float32 subtraction;
// * server: acc = q_0 s_0; acc += q_i s_i for i = 1..n-1 in rank order; c = acc / n + e, each a
//   single IEEE float32 operation (explicit _rn intrinsics, so no contraction or fast division);
// * scale: the blocked float64 sum of onebit/kernels/blocked.py, whose order is fixed: lane l of
//   block k (1024 elements = 32 steps x 32 lanes) sums v[1024k + 32j + l]^2 for j = 0..31, then the
//   lane sums are reduced by the adjacent pairwise tree, here in groups of 32 per thread per
//   launch (an aligned group of 32 is exactly a subtree, and padding with +0.0 changes nothing).
//   Squares of floats are exact in double, so the order is all that matters, and it is the same
//   as on the CPU: the scale is bit-identical, not merely within a tolerance.
//
// Every kernel is a per-thread *body* (a __host__ __device__ function of the thread index, with
// no shared memory, shuffles or atomics) plus a one-line __global__ wrapper. Compiled as plain
// C++ (g++ -x c++, no __CUDACC__), this file instead defines host launchers host_<kernel>(nthreads,
// args...) that run the same bodies in a loop, which is how the tests check the logic on machines
// without a GPU. Integer parameters are all long long, pointers are passed as 64-bit values.

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define ONEBIT_DEVICE_BUILD 1
#define ONEBIT_HD __host__ __device__ __forceinline__
#else
#define ONEBIT_DEVICE_BUILD 0
#define ONEBIT_HD inline
#endif

#if defined(__CUDA_ARCH__)
// Device code: explicit round-to-nearest intrinsics, never contracted into FMAs or approximated.
#define ONEBIT_FADD(a, b) __fadd_rn((a), (b))
#define ONEBIT_FSUB(a, b) __fsub_rn((a), (b))
#define ONEBIT_FDIV(a, b) __fdiv_rn((a), (b))
#define ONEBIT_DADD(a, b) __dadd_rn((a), (b))
#define ONEBIT_DMUL(a, b) __dmul_rn((a), (b))
#define ONEBIT_DDIV(a, b) __ddiv_rn((a), (b))
#define ONEBIT_DSQRT(a) __dsqrt_rn(a)
#define ONEBIT_D2F(a) __double2float_rn(a)
#define ONEBIT_UNROLL _Pragma("unroll")
#else
// Host code (the test harness; build it with -ffp-contract=off): plain IEEE operations.
#include <cmath>
#define ONEBIT_FADD(a, b) ((a) + (b))
#define ONEBIT_FSUB(a, b) ((a) - (b))
#define ONEBIT_FDIV(a, b) ((a) / (b))
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

ONEBIT_HD int onebit_sign_bit(float v) { return !(v < 0.0f); }

ONEBIT_HD float onebit_error(float v, int bit, float s) { return ONEBIT_FSUB(v, bit ? s : -s); }

ONEBIT_HD int onebit_bit_of(const onebit_u8* row, onebit_i64 i) { return (row[i >> 3] >> (7 - (int)(i & 7))) & 1; }

ONEBIT_HD float onebit_worker_value(const float* x, const float* e, onebit_i64 i) { return ONEBIT_FADD(x[i], e[i]); }

// c = (sum_r q_r s_r) / nrows + e, in rank order.
ONEBIT_HD float onebit_server_value(const onebit_u8* signs, onebit_i64 sign_stride, const float* scales,
                                    onebit_i64 nrows, const float* e, onebit_i64 i) {
    float acc = 0.0f;
    for (onebit_i64 r = 0; r < nrows; ++r) {
        const float s = scales[r];
        const float v = onebit_bit_of(signs + r * sign_stride, i) ? s : -s;
        acc = r == 0 ? v : ONEBIT_FADD(acc, v);
    }
    return ONEBIT_FADD(ONEBIT_FDIV(acc, (float)nrows), e[i]);
}

ONEBIT_HD double onebit_square(float v) {
    const double d = (double)v;
    return ONEBIT_DMUL(d, d);  // exact: a float's square fits in a double
}

ONEBIT_HD float onebit_scale_from_sumsq(double sumsq, onebit_i64 count) {
    return ONEBIT_D2F(ONEBIT_DSQRT(ONEBIT_DDIV(sumsq, (double)count)));
}

// ----------------------------------------------------------------------------------------------
// Kernel bodies: t is the global thread index; each returns at once when t is out of range.

// Thread t = 32k + l computes lane l of block k of the blocked sum of squares of b = x + e.
ONEBIT_HD void onebit_worker_sumsq_body(onebit_i64 t, const float* x, const float* e, onebit_i64 n,
                                        double* lanes, onebit_i64 nlanes) {
    if (t >= nlanes) return;
    const onebit_i64 first = (t / ONEBIT_LANES) * ONEBIT_BLOCK + t % ONEBIT_LANES;
    double acc = 0.0;
    for (int j = 0; j < ONEBIT_STEPS; ++j) {
        const onebit_i64 i = first + (onebit_i64)j * ONEBIT_LANES;
        if (i < n) acc = ONEBIT_DADD(acc, onebit_square(onebit_worker_value(x, e, i)));
    }
    lanes[t] = acc;
}

// The same for the server's c.
ONEBIT_HD void onebit_server_sumsq_body(onebit_i64 t, const onebit_u8* signs, onebit_i64 sign_stride,
                                        const float* scales, onebit_i64 nrows, const float* e, onebit_i64 n,
                                        double* lanes, onebit_i64 nlanes) {
    if (t >= nlanes) return;
    const onebit_i64 first = (t / ONEBIT_LANES) * ONEBIT_BLOCK + t % ONEBIT_LANES;
    double acc = 0.0;
    for (int j = 0; j < ONEBIT_STEPS; ++j) {
        const onebit_i64 i = first + (onebit_i64)j * ONEBIT_LANES;
        if (i < n) acc = ONEBIT_DADD(acc, onebit_square(onebit_server_value(signs, sign_stride, scales, nrows, e, i)));
    }
    lanes[t] = acc;
}

// Thread t reduces in[32t .. 32t+31] (zeros past n) by the adjacent pairwise tree into out[t];
// with a scale pointer and a single output, it also writes float(sqrt(sum / count)).
ONEBIT_HD void onebit_tree_sum_body(onebit_i64 t, const double* in, onebit_i64 n, double* out, onebit_i64 nout,
                                    onebit_i64 count, float* scale) {
    if (t >= nout) return;
    double v[ONEBIT_TREE_GROUP];
    ONEBIT_UNROLL
    for (int k = 0; k < ONEBIT_TREE_GROUP; ++k) {
        const onebit_i64 i = t * ONEBIT_TREE_GROUP + k;
        v[k] = i < n ? in[i] : 0.0;
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
    if (scale != 0 && nout == 1) *scale = onebit_scale_from_sumsq(v[0], count);
}

// Thread t writes output byte t (at packed + (t / row_len) * row_stride + t % row_len) and the
// errors of elements 8t .. 8t+7, given the scale at *scale.
ONEBIT_HD void onebit_worker_pack_body(onebit_i64 t, const float* x, float* e, onebit_i64 nbytes, const float* scale,
                                       onebit_u8* packed, onebit_i64 row_len, onebit_i64 row_stride) {
    if (t >= nbytes) return;
    const float s = *scale;
    int byte = 0;
    for (int j = 0; j < 8; ++j) {
        const onebit_i64 i = t * 8 + j;
        const float v = onebit_worker_value(x, e, i);
        const int bit = onebit_sign_bit(v);
        byte = (byte << 1) | bit;
        e[i] = onebit_error(v, bit, s);
    }
    packed[(t / row_len) * row_stride + t % row_len] = (onebit_u8)byte;
}

ONEBIT_HD void onebit_server_pack_body(onebit_i64 t, const onebit_u8* signs, onebit_i64 sign_stride,
                                       const float* scales, onebit_i64 nrows, float* e, onebit_i64 nbytes,
                                       const float* scale, onebit_u8* packed, onebit_i64 row_len,
                                       onebit_i64 row_stride) {
    if (t >= nbytes) return;
    const float s = *scale;
    int byte = 0;
    for (int j = 0; j < 8; ++j) {
        const onebit_i64 i = t * 8 + j;
        const float v = onebit_server_value(signs, sign_stride, scales, nrows, e, i);
        const int bit = onebit_sign_bit(v);
        byte = (byte << 1) | bit;
        e[i] = onebit_error(v, bit, s);
    }
    packed[(t / row_len) * row_stride + t % row_len] = (onebit_u8)byte;
}

// Thread t decodes byte t of the (nrows, row_bytes) signs (rows sign_stride apart) into
// out[8t .. 8t+7] with its row's scale; where bit (7 - j) of keep[t] is clear (keep not null),
// out is +0.0 instead.
ONEBIT_HD void onebit_decode_body(onebit_i64 t, const onebit_u8* signs, onebit_i64 sign_stride, onebit_i64 row_bytes,
                                  const float* scales, const onebit_u8* keep, onebit_i64 nbytes, float* out) {
    if (t >= nbytes) return;
    const onebit_i64 r = t / row_bytes;
    const int byte = signs[r * sign_stride + t % row_bytes];
    const int kept = keep ? keep[t] : 0xff;
    const float s = scales[r];
    for (int j = 0; j < 8; ++j) out[t * 8 + j] = ((kept >> (7 - j)) & 1) ? (((byte >> (7 - j)) & 1) ? s : -s) : 0.0f;
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
              (const float* x, const float* e, onebit_i64 n, double* lanes, onebit_i64 nlanes),
              (x, e, n, lanes, nlanes))
ONEBIT_KERNEL(onebit_server_sumsq,
              (const onebit_u8* signs, onebit_i64 sign_stride, const float* scales, onebit_i64 nrows, const float* e,
               onebit_i64 n, double* lanes, onebit_i64 nlanes),
              (signs, sign_stride, scales, nrows, e, n, lanes, nlanes))
ONEBIT_KERNEL(onebit_tree_sum,
              (const double* in, onebit_i64 n, double* out, onebit_i64 nout, onebit_i64 count, float* scale),
              (in, n, out, nout, count, scale))
ONEBIT_KERNEL(onebit_worker_pack,
              (const float* x, float* e, onebit_i64 nbytes, const float* scale, onebit_u8* packed, onebit_i64 row_len,
               onebit_i64 row_stride),
              (x, e, nbytes, scale, packed, row_len, row_stride))
ONEBIT_KERNEL(onebit_server_pack,
              (const onebit_u8* signs, onebit_i64 sign_stride, const float* scales, onebit_i64 nrows, float* e,
               onebit_i64 nbytes, const float* scale, onebit_u8* packed, onebit_i64 row_len, onebit_i64 row_stride),
              (signs, sign_stride, scales, nrows, e, nbytes, scale, packed, row_len, row_stride))
ONEBIT_KERNEL(onebit_decode,
              (const onebit_u8* signs, onebit_i64 sign_stride, onebit_i64 row_bytes, const float* scales,
               const onebit_u8* keep, onebit_i64 nbytes, float* out),
              (signs, sign_stride, row_bytes, scales, keep, nbytes, out))
