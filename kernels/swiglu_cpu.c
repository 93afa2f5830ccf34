/* Weighted SwiGLU on the CPU in one pass each way: the loops of kernels/swiglu_cpu.py.
 *
 * forward:  out[i, j] = silu(gate[i, j]) * up[i, j] * p[i]
 * backward: d_up[i, j]   = g[i, j] * silu(gate[i, j]) * p[i]
 *           d_gate[i, j] = g[i, j] * up[i, j] * p[i] * silu'(gate[i, j])
 *           d_p[i]       = sum_j g[i, j] * silu(gate[i, j]) * up[i, j]
 * where x[i] = [gate | up] (F values each), rows of x, g, out and d_x have their own row
 * strides (in elements), p may be NULL (no prob: 1) and d_p may be NULL (not wanted).
 * Each call works on rows [row0, row1); the caller splits the rows over its threads.
 *
 * float: exp is a polynomial the compiler vectorises (libm's expf is a call per element);
 * relative error about 2 ulp. Inputs are clamped to exp's finite range, a NaN stays NaN.
 * double (the tests' gradcheck): libm's exp.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : x;  /* comparisons are false for NaN: it passes through */
    x = x > 88.3f ? 88.3f : x;
    float k = __builtin_rintf(x * 1.44269504088896341f);  /* x = k ln2 + r, |r| <= ln2 / 2 */
    float r = x - k * 0.693359375f - k * -2.12194440e-4f;  /* ln2 in two parts (Cody-Waite) */
    float p = 1.9875691500e-4f;  /* minimax polynomial of (e^r - 1 - r) / r^2 */
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;  /* 2^k */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline double exp_f64(double x) { return exp(x); }

#define SWIGLU_KERNELS(T, SUFFIX, EXP)                                                       \
void swiglu_forward_##SUFFIX(const T *x, int64_t x_stride, const T *p, T *out,               \
                             int64_t out_stride, int64_t f, int64_t row0, int64_t row1) {    \
    for (int64_t i = row0; i < row1; i++) {                                                   \
        const T *gate = x + i * x_stride, *up = gate + f;                                     \
        T *o = out + i * out_stride;                                                          \
        const T scale = p ? p[i] : (T)1;                                                      \
        _Pragma("omp simd")                                                                   \
        for (int64_t j = 0; j < f; j++) {                                                     \
            const T gj = gate[j];                                                             \
            o[j] = gj / ((T)1 + EXP(-gj)) * up[j] * scale;                                    \
        }                                                                                     \
    }                                                                                         \
}                                                                                             \
                                                                                              \
void swiglu_backward_##SUFFIX(const T *g, int64_t g_stride, const T *x, int64_t x_stride,    \
                              const T *p, T *dx, int64_t dx_stride, T *dp, int64_t f,        \
                              int64_t row0, int64_t row1) {                                  \
    for (int64_t i = row0; i < row1; i++) {                                                   \
        const T *gi = g + i * g_stride, *gate = x + i * x_stride, *up = gate + f;             \
        T *d_gate = dx + i * dx_stride, *d_up = d_gate + f;                                   \
        const T scale = p ? p[i] : (T)1;                                                      \
        T dot = 0;                                                                            \
        _Pragma("omp simd reduction(+:dot)")                                                  \
        for (int64_t j = 0; j < f; j++) {                                                     \
            const T a = gate[j], b = up[j], d = gi[j];                                        \
            const T sig = (T)1 / ((T)1 + EXP(-a));                                            \
            const T silu = a * sig;                                                           \
            dot += d * silu * b;                                                              \
            d_up[j] = d * silu * scale;                                                       \
            d_gate[j] = d * b * scale * sig * ((T)1 + a * ((T)1 - sig));                      \
        }                                                                                     \
        if (dp) dp[i] = dot;                                                                  \
    }                                                                                         \
}

SWIGLU_KERNELS(float, f32, exp_f32)
SWIGLU_KERNELS(double, f64, exp_f64)
