/* Element arithmetic of the native engine (engine.h): the types' sizes, float16 and
 * bfloat16 rounding as numpy and ml_dtypes do it, the reductions and avg's division,
 * and the clock. Used by the program runner (program.c) and the net ops (net.c). */
#include "engine.h"

#include <math.h>
#include <string.h>
#include <time.h>

/* ---------------------------------------------------------------- element types */

static const uint32_t ITEMSIZE[LPN_DTYPE_END] = {0, 2, 2, 4, 8, 1, 4, 8, 1};

uint32_t lpn_itemsize(uint32_t dtype) { return dtype < LPN_DTYPE_END ? ITEMSIZE[dtype] : 0; }

/* float16 and bfloat16 are computed in float and rounded to nearest even, as numpy and
 * ml_dtypes do (float's 24 bits make the double rounding exact for + - * /). */
static float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, x;
    if (exp == 0) {
        if (man == 0) {
            x = sign;
        } else {
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400u));
            x = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 0x1f) {
        x = sign | 0x7f800000u | (man << 13);
    } else {
        x = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static uint16_t f2h(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t exp = (x >> 23) & 0xffu, man = x & 0x7fffffu;
    if (exp == 0xff) {
        if (man) { /* NaN: numpy keeps the payload's top bits */
            uint16_t r = (uint16_t)(0x7c00u | (man >> 13));
            return (uint16_t)(sign | (r == 0x7c00u ? 0x7c01u : r));
        }
        return (uint16_t)(sign | 0x7c00u);
    }
    int e = (int)exp - 112;
    if (e >= 0x1f) return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return sign;
        uint32_t m = man | 0x800000u, shift = (uint32_t)(14 - e);
        uint32_t h = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)e << 10) | (man >> 13), rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; /* a carry rounds up to inf */
    return (uint16_t)(sign | h);
}

static float b2f(uint16_t b) {
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static uint16_t f2b(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if (isnan(f)) return (x & 0x80000000u) ? 0xffc0u : 0x7fc0u; /* ml_dtypes' quiet NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* ---------------------------------------------------------------- reductions */

/* Floats' sum and product; min and max are min_max_* below. */
#define COMBINE_FLOAT(T)                                                              \
    static void combine_##T(T *d, const T *a, const T *b, uint64_t n, uint32_t op) { \
        uint64_t i;                                                                   \
        if (op == LPN_SUM)                                                            \
            for (i = 0; i < n; i++) d[i] = a[i] + b[i];                               \
        else                                                                          \
            for (i = 0; i < n; i++) d[i] = a[i] * b[i];                               \
    }
COMBINE_FLOAT(float)
COMBINE_FLOAT(double)

static float f32_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static double f64_of(uint64_t u) {
    double f;
    memcpy(&f, &u, 8);
    return f;
}

/* Floats' min and max, numpy's bit for bit (docs/architecture.md, "Bitwise"): the result
 * is always one operand's bits, never recomputed (a signalling NaN stays as it is); a
 * NaN propagates, the first operand's where it is one, else the second's; on a tie (-0.0
 * and +0.0) float16 gives the first operand (numpy's scalar half loop: a <= b ? a : b)
 * and bfloat16, float32 and float64 the second (ml_dtypes' loop; numpy's SIMD loops, x86's
 * minps/maxps: a < b ? a : b). program.py checks this against numpy once per process and
 * leaves float min/max to numpy where they differ (another machine's numpy). */
#define MIN_MAX(NAME, U, VALUE, TIE_FIRST)                                                        \
    static void min_max_##NAME(U *d, const U *a, const U *b, uint64_t n, uint32_t op) {          \
        uint64_t i;                                                                               \
        if (op == LPN_MIN)                                                                        \
            for (i = 0; i < n; i++) {                                                             \
                U x = a[i], y = b[i];                                                             \
                d[i] = isnan(VALUE(x)) || (TIE_FIRST ? VALUE(x) <= VALUE(y) : VALUE(x) < VALUE(y)) \
                           ? x                                                                    \
                           : y;                                                                   \
            }                                                                                     \
        else                                                                                      \
            for (i = 0; i < n; i++) {                                                             \
                U x = a[i], y = b[i];                                                             \
                d[i] = isnan(VALUE(x)) || (TIE_FIRST ? VALUE(x) >= VALUE(y) : VALUE(x) > VALUE(y)) \
                           ? x                                                                    \
                           : y;                                                                   \
            }                                                                                     \
    }

/* Integers wrap around as numpy's do: computed unsigned (signed overflow is undefined). */
#define COMBINE_INT(T, U)                                                                     \
    static void combine_##T(T *d, const T *a, const T *b, uint64_t n, uint32_t op) {         \
        uint64_t i;                                                                           \
        switch (op) {                                                                         \
        case LPN_SUM: for (i = 0; i < n; i++) d[i] = (T)(U)((U)a[i] + (U)b[i]); break;        \
        case LPN_PROD: for (i = 0; i < n; i++) d[i] = (T)(U)((U)a[i] * (U)b[i]); break;       \
        case LPN_MIN: for (i = 0; i < n; i++) d[i] = a[i] <= b[i] ? a[i] : b[i]; break;       \
        default: for (i = 0; i < n; i++) d[i] = a[i] >= b[i] ? a[i] : b[i]; break;            \
        }                                                                                     \
    }
COMBINE_INT(int8_t, uint8_t)
COMBINE_INT(int32_t, uint32_t)
COMBINE_INT(int64_t, uint64_t)
COMBINE_INT(uint8_t, uint32_t)

#define COMBINE_HALF(NAME, TO, FROM)                                                          \
    static void combine_##NAME(uint16_t *d, const uint16_t *a, const uint16_t *b, uint64_t n, \
                               uint32_t op) {                                                 \
        uint64_t i;                                                                           \
        if (op == LPN_SUM)                                                                    \
            for (i = 0; i < n; i++) d[i] = FROM(TO(a[i]) + TO(b[i]));                         \
        else                                                                                  \
            for (i = 0; i < n; i++) d[i] = FROM(TO(a[i]) * TO(b[i]));                         \
    }
COMBINE_HALF(f16, h2f, f2h)
COMBINE_HALF(bf16, b2f, f2b)
MIN_MAX(f16, uint16_t, h2f, 1)
MIN_MAX(bf16, uint16_t, b2f, 0)
MIN_MAX(f32, uint32_t, f32_of, 0)
MIN_MAX(f64, uint64_t, f64_of, 0)

/* avg's last step: floats divided by the count (as the dtype holds it), integers floored. */
void lpn_divide(uint8_t *p, uint32_t dtype, uint64_t n, uint64_t by) {
    uint64_t i;
    switch (dtype) {
    case LPN_F16: {
        uint16_t *d = (uint16_t *)p;
        float q = h2f(f2h((float)by));
        for (i = 0; i < n; i++) d[i] = f2h(h2f(d[i]) / q);
        break;
    }
    case LPN_BF16: {
        uint16_t *d = (uint16_t *)p;
        float q = b2f(f2b((float)by));
        for (i = 0; i < n; i++) d[i] = f2b(b2f(d[i]) / q);
        break;
    }
    case LPN_F32: {
        float *d = (float *)p, q = (float)by;
        for (i = 0; i < n; i++) d[i] = d[i] / q;
        break;
    }
    case LPN_F64: {
        double *d = (double *)p, q = (double)by;
        for (i = 0; i < n; i++) d[i] = d[i] / q;
        break;
    }
#define FLOOR_DIV(T)                                                   \
    {                                                                  \
        T *d = (T *)p;                                                 \
        const T q = (T)by;                                             \
        for (i = 0; i < n; i++) {                                      \
            T r = (T)(d[i] / q);                                       \
            if ((T)(d[i] % q) != 0 && (d[i] < 0) != (q < 0)) r--;     \
            d[i] = r;                                                  \
        }                                                              \
    }
    case LPN_I8: FLOOR_DIV(int8_t) break;
    case LPN_I32: FLOOR_DIV(int32_t) break;
    case LPN_I64: FLOOR_DIV(int64_t) break;
    default: { /* LPN_U8 */
        for (i = 0; i < n; i++) p[i] = (uint8_t)(p[i] / by);
        break;
    }
    }
}

void lpn_combine(uint8_t *d, const uint8_t *a, const uint8_t *b, uint32_t dtype, uint64_t n, uint32_t op) {
    if (op >= LPN_MIN && dtype <= LPN_F64) {
        switch (dtype) {
        case LPN_F16: min_max_f16((uint16_t *)d, (const uint16_t *)a, (const uint16_t *)b, n, op); break;
        case LPN_BF16: min_max_bf16((uint16_t *)d, (const uint16_t *)a, (const uint16_t *)b, n, op); break;
        case LPN_F32: min_max_f32((uint32_t *)d, (const uint32_t *)a, (const uint32_t *)b, n, op); break;
        default: min_max_f64((uint64_t *)d, (const uint64_t *)a, (const uint64_t *)b, n, op); break;
        }
        return;
    }
    switch (dtype) {
    case LPN_F16: combine_f16((uint16_t *)d, (const uint16_t *)a, (const uint16_t *)b, n, op); break;
    case LPN_BF16: combine_bf16((uint16_t *)d, (const uint16_t *)a, (const uint16_t *)b, n, op); break;
    case LPN_F32: combine_float((float *)d, (const float *)a, (const float *)b, n, op); break;
    case LPN_F64: combine_double((double *)d, (const double *)a, (const double *)b, n, op); break;
    case LPN_I8: combine_int8_t((int8_t *)d, (const int8_t *)a, (const int8_t *)b, n, op); break;
    case LPN_I32: combine_int32_t((int32_t *)d, (const int32_t *)a, (const int32_t *)b, n, op); break;
    case LPN_I64: combine_int64_t((int64_t *)d, (const int64_t *)a, (const int64_t *)b, n, op); break;
    default: combine_uint8_t(d, a, b, n, op); break;
    }
}

/* ---------------------------------------------------------------- time */

double lpn_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}
