/* The native engine: program checks and execution, and the doorbell thread (engine.h). */
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#include <linux/futex.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

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

/* ---------------------------------------------------------------- programs */

static int fits(uint64_t off, uint64_t n, uint64_t size) { return off <= size && n <= size - off; }

static int aligned(const uint64_t *bases, uint32_t buf, uint64_t off, uint64_t item) {
    uint64_t base = buf ? bases[buf - 1] : 0; /* buffer 0, the scratch: aligned by the engine */
    return (base + off) % item == 0;
}

/* A net op's checks (engine.h says what each kind reads and writes); NULL when sound. */
static const char *check_net_op(const lpn_op *o, const uint64_t *sizes, uint32_t nbuf, const uint64_t *bases) {
    if (o->b >= LPN_MAX_CHANNELS) return "a message names a channel out of range";
    if (o->kind == LPN_SEND) { /* writes nothing: no destination */
        if (o->dst != 0 || o->dst_off != 0) return "a send names a destination";
        if (o->a >= nbuf) return "an op names a buffer the program does not have";
        if (!fits(o->a_off, o->n, sizes[o->a])) return "an op reaches past the end of its buffer";
        return NULL;
    }
    if (o->kind == LPN_RECV) {
        if (!fits(o->dst_off, o->n, sizes[o->dst]) || !fits(o->b_off, o->n, sizes[0]))
            return "an op reaches past the end of its buffer";
        return NULL;
    }
    /* LPN_RECV_COMBINE */
    if (o->dtype == 0 || o->dtype >= LPN_DTYPE_END || o->redop == 0 || o->redop >= LPN_REDOP_END)
        return "an op has an unknown kind, type or reduction";
    if (o->a >= nbuf) return "an op names a buffer the program does not have";
    uint64_t item = ITEMSIZE[o->dtype];
    if (o->n > UINT64_MAX / item) return "an op reaches past the end of its buffer";
    uint64_t bytes = o->n * item;
    if (!fits(o->dst_off, bytes, sizes[o->dst]) || !fits(o->a_off, bytes, sizes[o->a]) ||
        !fits(o->b_off, bytes, sizes[0]))
        return "an op reaches past the end of its buffer";
    if (!aligned(bases, o->dst, o->dst_off, item) || !aligned(bases, o->a, o->a_off, item) ||
        !aligned(bases, 0, o->b_off, item))
        return "an element range is not aligned to its type";
    return NULL;
}

/* A star program (engine.h): no other net ops, and nothing but the scratch written
 * before its last UP_RECV or DOWN_RECV (until then every node may still fall back). */
static const char *check_star(const lpn_program *p) {
    uint32_t last = 0, i;
    for (i = 0; i < p->nops; i++) {
        uint32_t k = p->ops[i].kind;
        if (k == LPN_UP_RECV || k == LPN_DOWN_RECV) last = i;
        if (k == LPN_GO || (k >= LPN_SEND && k <= LPN_RECV_COMBINE)) return "a star program with other messages";
    }
    for (i = 0; i < last; i++) {
        uint32_t k = p->ops[i].kind;
        if ((k == LPN_COPY || k == LPN_COMBINE || k == LPN_DIVIDE) && p->ops[i].dst != 0)
            return "a star program writes a buffer before every node said GO";
    }
    return NULL;
}

/* List each channel's sends and receives by message number (net.c matches messages by
 * it): sends numbered 0, 1, ... in program order, receives each number once. */
static const char *index_messages(lpn_program *p) {
    uint32_t nsend[LPN_MAX_CHANNELS] = {0}, nrecv[LPN_MAX_CHANNELS] = {0}, c, i;
    p->msg = calloc(p->nops, sizeof(uint32_t));
    p->tx = calloc(p->nops, sizeof(uint32_t));
    p->rx = malloc((size_t)p->nops * sizeof(uint32_t));
    if (!p->msg || !p->tx || !p->rx) return "out of memory";
    memset(p->rx, 0xff, (size_t)p->nops * sizeof(uint32_t));
    for (i = 0; i < p->nops; i++) {
        const lpn_op *o = &p->ops[i];
        if (o->kind == LPN_SEND) {
            if (o->arg != nsend[o->b]) return "a channel's sends are not numbered in program order";
            nsend[o->b]++;
        } else if (o->kind == LPN_RECV || o->kind == LPN_RECV_COMBINE) {
            nrecv[o->b]++;
        }
    }
    p->tx_start[0] = p->rx_start[0] = 0;
    for (c = 0; c < LPN_MAX_CHANNELS; c++) {
        p->tx_start[c + 1] = p->tx_start[c] + nsend[c];
        p->rx_start[c + 1] = p->rx_start[c] + nrecv[c];
    }
    for (i = 0; i < p->nops; i++) {
        const lpn_op *o = &p->ops[i];
        if (o->kind == LPN_SEND) {
            p->msg[i] = (uint32_t)o->arg;
            p->tx[p->tx_start[o->b] + o->arg] = i;
        } else if (o->kind == LPN_RECV || o->kind == LPN_RECV_COMBINE) {
            if (o->arg >= nrecv[o->b]) return "a receive's message number is out of range";
            uint32_t *at = &p->rx[p->rx_start[o->b] + o->arg];
            if (*at != UINT32_MAX) return "two receives take the same message";
            *at = i;
            p->msg[i] = (uint32_t)o->arg;
        }
    }
    return NULL;
}

/* ---------------------------------------------------------------- tiles */

/* Bytes an op covers (its ranges' common length); parse checked that it does not wrap. */
static uint64_t op_bytes(const lpn_op *o) { return o->kind == LPN_COPY ? o->n : o->n * ITEMSIZE[o->dtype]; }

typedef struct {
    uint64_t start, end; /* scratch offsets (space 0) or addresses (space 1) */
    uint32_t space, write, op, which; /* which: the op's dst, a or b */
} access_range;

static int by_start(const void *x, const void *y) {
    const access_range *a = x, *b = y;
    if (a->space != b->space) return a->space < b->space ? -1 : 1;
    return a->start < b->start ? -1 : a->start > b->start;
}

/* Whether the first op to touch a cluster of ``n`` ranges (ending at ``end``) only
 * writes it, all of it: then no tile reads what an earlier run or tile left there, and a
 * thread's own tile of it gives the bytes the whole scratch would. */
static int written_first(const access_range *r, uint32_t n, uint64_t end) {
    uint32_t op = UINT32_MAX, j;
    for (j = 0; j < n; j++)
        if (r[j].op < op) op = r[j].op;
    for (j = 0; j < n; j++)
        if (r[j].op == op && (!r[j].write || r[j].end != end)) return 0;
    return 1;
}

/* Sets program->tiled, ->span and the scratch's slots (engine.h): the ranges every op
 * reads and writes, sorted, in clusters of overlapping ones; a cluster with a write must
 * have one start. Stricter than it must be (two reads that overlap at different starts
 * beside a write refuse it), never looser. Where every cluster of the scratch has one
 * start and is written whole before it is read, each is a slot: a tile's part of it may
 * live in a tile of its own. -1: out of memory. */
static int tileable(lpn_program *p, const uint64_t *bases) {
    access_range *r = malloc((size_t)(p->nops ? p->nops : 1) * 3u * sizeof *r);
    p->slot = malloc((size_t)(p->nops ? p->nops : 1) * 3u * sizeof(uint32_t));
    if (!r || !p->slot) {
        free(r);
        return -1;
    }
    memset(p->slot, 0xff, (size_t)(p->nops ? p->nops : 1) * 3u * sizeof(uint32_t));
    uint32_t n = 0, i, slots = 0;
    int sound = 1, slotted = 1;
    p->span = 0;
    for (i = 0; i < p->nops && sound; i++) {
        const lpn_op *o = &p->ops[i];
        uint64_t bytes = op_bytes(o);
        if (bytes > p->span) p->span = bytes;
        if (bytes == 0) continue;
        uint32_t bufs[3] = {o->dst, o->a, o->b};
        uint64_t offs[3] = {o->dst_off, o->a_off, o->b_off};
        uint32_t k, touched = o->kind == LPN_COMBINE ? 3 : o->kind == LPN_COPY ? 2 : 1;
        for (k = 0; k < touched; k++) {
            uint64_t start = offs[k], end = 0;
            if (bufs[k] && __builtin_add_overflow(bases[bufs[k] - 1], offs[k], &start)) sound = 0;
            if (__builtin_add_overflow(start, bytes, &end)) sound = 0;
            r[n++] = (access_range){start, end, bufs[k] ? 1u : 0u, k == 0, i, k};
        }
    }
    if (sound && n) {
        qsort(r, n, sizeof *r, by_start);
        uint32_t first = 0; /* the cluster's first range */
        uint64_t end = r[0].end;
        int write = (int)r[0].write, one_start = 1;
        for (i = 1; i <= n; i++) {
            if (i < n && r[i].space == r[first].space && r[i].start < end) { /* the same cluster */
                if (r[i].end > end) end = r[i].end;
                write |= (int)r[i].write;
                one_start &= r[i].start == r[first].start;
                continue;
            }
            if (write && !one_start) sound = 0;
            if (r[first].space == 0) { /* a cluster of the scratch: a slot */
                slotted &= one_start && written_first(r + first, i - first, end);
                for (uint32_t j = first; j < i; j++) p->slot[r[j].op * 3u + r[j].which] = slots;
                slots++;
            }
            if (i == n) break;
            first = i;
            end = r[i].end;
            write = (int)r[i].write;
            one_start = 1;
        }
    }
    free(r);
    p->tiled = sound;
    p->slots = sound && slotted ? slots : 0;
    if (!p->slots) { /* the whole scratch, as op by op */
        free(p->slot);
        p->slot = NULL;
    }
    return 0;
}

/* Where access ``which`` of op ``i`` starts in tile ``lo``: its buffer's bytes, or its
 * slot in this thread's tiles of the scratch (``local``). */
static uint8_t *at(const lpn_program *p, uint8_t *const *bufs, uint8_t *local, uint64_t tile, uint32_t i,
                   uint32_t which, uint32_t buf, uint64_t off, uint64_t lo) {
    if (local && buf == 0) return local + (uint64_t)p->slot[i * 3u + which] * tile;
    return bufs[buf] + off + lo;
}

/* A copy into a participant's buffer that bypasses the cache (streaming stores): the
 * lines are not read first, and a big message's outputs, which would not stay cached,
 * do not push out the tile's scratch. Overlapping ranges and other machines: memmove. */
static void copy_streaming(uint8_t *d, const uint8_t *s, uint64_t n) {
#ifdef __SSE2__
    if (n >= 1024 && (d >= s + n || s >= d + n)) {
        uint64_t head = (16u - ((uintptr_t)d & 15u)) & 15u;
        memcpy(d, s, head);
        d += head;
        s += head;
        n -= head;
        for (; n >= 64; n -= 64, d += 64, s += 64) {
            __m128i w = _mm_loadu_si128((const __m128i *)s), x = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i y = _mm_loadu_si128((const __m128i *)(s + 32)), z = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, w);
            _mm_stream_si128((__m128i *)(d + 16), x);
            _mm_stream_si128((__m128i *)(d + 32), y);
            _mm_stream_si128((__m128i *)(d + 48), z);
        }
    }
#endif
    memmove(d, s, n);
}

/* Streaming stores are weakly ordered: each thread fences them before it says it is done. */
static void fence_streaming(void) {
#ifdef __SSE2__
    _mm_sfence();
#endif
}

/* Every op's bytes [lo, lo + tile) of its own range, in program order. */
static void run_tile(const lpn_program *p, uint8_t *const *bufs, uint8_t *local, uint64_t lo, uint64_t tile,
                     int stream) {
    for (uint32_t i = 0; i < p->nops; i++) {
        const lpn_op *o = &p->ops[i];
        uint64_t bytes = op_bytes(o);
        if (lo >= bytes) continue;
        uint64_t len = bytes - lo < tile ? bytes - lo : tile, item = o->kind == LPN_COPY ? 1 : ITEMSIZE[o->dtype];
        uint8_t *d = at(p, bufs, local, tile, i, 0, o->dst, o->dst_off, lo);
        switch (o->kind) {
        case LPN_COPY:
            if (stream && o->dst != 0)
                copy_streaming(d, at(p, bufs, local, tile, i, 1, o->a, o->a_off, lo), len);
            else
                memmove(d, at(p, bufs, local, tile, i, 1, o->a, o->a_off, lo), len);
            break;
        case LPN_COMBINE:
            lpn_combine(d, at(p, bufs, local, tile, i, 1, o->a, o->a_off, lo),
                        at(p, bufs, local, tile, i, 2, o->b, o->b_off, lo), o->dtype, len / item, o->redop);
            break;
        case LPN_DIVIDE: lpn_divide(d, o->dtype, len / item, o->arg); break;
        default: break;
        }
    }
}

uint64_t lpn_program_tile_scratch(const lpn_program *program, uint64_t tile) {
    return program->tiled ? (uint64_t)program->slots * tile : 0;
}

/* One program's tiles, shared: each thread takes the next one until none is left. */
typedef struct {
    const lpn_program *program;
    uint8_t *const *bufs;
    uint8_t *local; /* thread k's tiles of the scratch at local + k * per_thread; NULL: none */
    uint64_t tile, ntiles, per_thread;
    uint32_t threads; /* those with a number below it take tiles */
    int stream;       /* copies into the participants' buffers with streaming stores */
} tile_task;

static void take_tiles(const tile_task *t, uint64_t *next, uint32_t thread) {
    uint8_t *local = t->local ? t->local + thread * t->per_thread : NULL;
    for (;;) {
        uint64_t k = __atomic_fetch_add(next, 1u, __ATOMIC_RELAXED);
        if (k >= t->ntiles) break;
        run_tile(t->program, t->bufs, local, k * t->tile, t->tile, t->stream);
    }
    if (t->stream) fence_streaming();
}

typedef struct {
    lpn_pool *pool;
    uint32_t thread; /* 1, 2, ...: the caller of a run is 0 */
} worker_arg;

/* Invariant: a worker touches a task only while counted in ``active``, which it joins
 * under ``mu`` while the task is ``open``; the runner closes it under ``mu`` once its
 * own take_tiles returned and ``active`` is 0, so no tile is running or left then. */
struct lpn_pool {
    pthread_mutex_t mu;
    pthread_cond_t work, idle;
    pthread_t *threads;
    worker_arg *args;
    uint32_t workers, started, active;
    int stopping, open;
    uint64_t gen, next;
    tile_task task;
};

static void timed_wait(pthread_cond_t *cv, pthread_mutex_t *mu) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 1; /* bounded: the caller's loop looks again */
    pthread_cond_timedwait(cv, mu, &ts);
}

static void *worker(void *arg) {
    lpn_pool *pool = ((worker_arg *)arg)->pool;
    uint32_t thread = ((worker_arg *)arg)->thread;
    pthread_setname_np(pthread_self(), "lpsync-tiles");
    pthread_mutex_lock(&pool->mu);
    uint64_t seen = 0;
    while (!pool->stopping) {
        if (!pool->open || pool->gen == seen) {
            timed_wait(&pool->work, &pool->mu);
            continue;
        }
        seen = pool->gen;
        tile_task task = pool->task;
        if (thread >= task.threads) continue; /* a run on fewer threads than the pool has */
        pool->active++;
        pthread_mutex_unlock(&pool->mu);
        take_tiles(&task, &pool->next, thread);
        pthread_mutex_lock(&pool->mu);
        if (--pool->active == 0) pthread_cond_broadcast(&pool->idle);
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

lpn_pool *lpn_pool_create(uint32_t workers) {
    if (workers == 0) return NULL;
    lpn_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->threads = calloc(workers, sizeof(pthread_t));
    pool->args = calloc(workers, sizeof(worker_arg));
    if (!pool->threads || !pool->args) {
        free(pool->threads);
        free(pool->args);
        free(pool);
        return NULL;
    }
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->work, NULL);
    pthread_cond_init(&pool->idle, NULL);
    for (pool->started = 0; pool->started < workers; pool->started++) {
        pool->args[pool->started] = (worker_arg){pool, pool->started + 1u};
        if (pthread_create(&pool->threads[pool->started], NULL, worker, &pool->args[pool->started]) != 0) break;
    }
    pool->workers = pool->started; /* fewer started: fewer take tiles */
    if (pool->workers == 0) {
        lpn_pool_destroy(pool);
        return NULL;
    }
    return pool;
}

void lpn_pool_destroy(lpn_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->mu);
    pool->stopping = 1;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->mu);
    for (uint32_t i = 0; i < pool->started; i++) pthread_join(pool->threads[i], NULL);
    pthread_cond_destroy(&pool->work);
    pthread_cond_destroy(&pool->idle);
    pthread_mutex_destroy(&pool->mu);
    free(pool->threads);
    free(pool->args);
    free(pool);
}

uint32_t lpn_pool_workers(const lpn_pool *pool) { return pool ? pool->workers : 0; }

void lpn_program_run_tiles(const lpn_program *program, uint8_t *const *bufs, uint64_t tile, lpn_pool *pool,
                           uint8_t *local, int stream) {
    if (!program->tiled || tile == 0 || program->span == 0) {
        lpn_program_run(program, bufs);
        return;
    }
    uint64_t ntiles = program->span / tile + (program->span % tile != 0);
    uint32_t threads = pool ? pool->workers + 1u : 1u;
    if (threads > ntiles) threads = (uint32_t)ntiles;
    tile_task task = {program, bufs, program->slots ? local : NULL, tile, ntiles, program->slots * tile, threads,
                      stream};
    if (!pool || task.ntiles < 2) {
        uint64_t next = 0;
        take_tiles(&task, &next, 0);
        return;
    }
    pthread_mutex_lock(&pool->mu);
    pool->task = task;
    pool->next = 0;
    pool->gen++;
    pool->open = 1;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->mu);
    take_tiles(&task, &pool->next, 0);
    pthread_mutex_lock(&pool->mu);
    while (pool->active > 0) timed_wait(&pool->idle, &pool->mu); /* their last tiles */
    pool->open = 0;
    pthread_mutex_unlock(&pool->mu);
}

int lpn_program_parse(const uint8_t *data, size_t len, const uint64_t *bases, const uint64_t *sizes,
                      uint32_t nbases, lpn_program *out, const char **why) {
    memset(out, 0, sizeof *out);
    lpn_program_header h;
    if (len < sizeof h) return *why = "shorter than its header", -1;
    memcpy(&h, data, sizeof h);
    if (h.magic != LPN_PROGRAM_MAGIC) return *why = "not a program (magic)", -1;
    if (h.version != LPN_VERSION) return *why = "another program version", -1;
    if (h.nbuf == 0 || h.nbuf > LPN_MAX_BUFFERS) return *why = "buffer count out of range", -1;
    if (h.nops > LPN_MAX_OPS) return *why = "too many ops", -1;
    if (nbases != h.nbuf - 1) return *why = "buffer addresses do not match the program", -1;
    size_t need = sizeof h + (size_t)h.nbuf * 8u + (size_t)h.nops * sizeof(lpn_op);
    if (len != need) return *why = "length does not match its counts", -1;
    out->sizes = calloc(h.nbuf, sizeof(uint64_t));
    out->ops = calloc(h.nops ? h.nops : 1, sizeof(lpn_op));
    if (!out->sizes || !out->ops) {
        lpn_program_free(out);
        return *why = "out of memory", -1;
    }
    memcpy(out->sizes, data + sizeof h, (size_t)h.nbuf * 8u);
    memcpy(out->ops, data + sizeof h + (size_t)h.nbuf * 8u, (size_t)h.nops * sizeof(lpn_op));
    out->nbuf = h.nbuf;
    out->nops = h.nops;
    if (out->sizes[0] > LPN_MAX_SCRATCH) {
        lpn_program_free(out);
        return *why = "scratch too large", -1;
    }
    for (uint32_t i = 1; i < h.nbuf; i++)
        if (out->sizes[i] != sizes[i - 1]) {
            lpn_program_free(out);
            return *why = "a buffer's size differs from the program's", -1;
        }
    for (uint32_t i = 0; i < h.nops; i++) {
        const lpn_op *o = &out->ops[i];
        uint64_t item = 1, bytes;
        if (o->dst >= h.nbuf) goto bad_buffer;
        if (o->kind == LPN_GO) { /* before anything else: nothing is written until every GO */
            if (o->b >= LPN_MAX_CHANNELS || o->dst != 0 || o->dst_off != 0 || o->a > 1) goto bad;
            if (i > 0 && (out->ops[i - 1].kind != LPN_GO || out->ops[i - 1].a != o->a || !o->a)) {
                lpn_program_free(out);
                return *why = "GO ops open a program: one to the root, or the root's to every other node", -1;
            }
            out->net = 1;
            continue;
        }
        if (o->kind >= LPN_UP_SEND && o->kind <= LPN_DOWN_RECV) {
            if (o->b >= LPN_MAX_CHANNELS) goto bad;
            int sends = o->kind == LPN_UP_SEND || o->kind == LPN_DOWN_SEND;
            if (o->dst != 0 || o->dst_off != 0 || (sends && o->a >= h.nbuf)) goto bad;
            if (sends ? !fits(o->a_off, o->n, out->sizes[o->a]) : !fits(o->b_off, o->n, out->sizes[0]))
                goto bad_range;
            out->net = out->star = 1;
            continue;
        }
        if (o->kind >= LPN_SEND && o->kind <= LPN_RECV_COMBINE) {
            const char *net_why = check_net_op(o, out->sizes, h.nbuf, bases);
            if (net_why) {
                lpn_program_free(out);
                return *why = net_why, -1;
            }
            out->net = 1;
            continue;
        }
        if (o->kind == LPN_COPY) {
            if (o->a >= h.nbuf) goto bad_buffer;
            if (!fits(o->dst_off, o->n, out->sizes[o->dst]) || !fits(o->a_off, o->n, out->sizes[o->a]))
                goto bad_range;
            continue;
        }
        if (o->dtype == 0 || o->dtype >= LPN_DTYPE_END) goto bad;
        item = ITEMSIZE[o->dtype];
        if (o->n > UINT64_MAX / item) goto bad_range;
        bytes = o->n * item;
        if (!fits(o->dst_off, bytes, out->sizes[o->dst])) goto bad_range;
        if (o->kind == LPN_COMBINE) {
            if (o->redop == 0 || o->redop >= LPN_REDOP_END) goto bad;
            if (o->a >= h.nbuf || o->b >= h.nbuf) goto bad_buffer;
            if (!fits(o->a_off, bytes, out->sizes[o->a]) || !fits(o->b_off, bytes, out->sizes[o->b]))
                goto bad_range;
        } else if (o->kind == LPN_DIVIDE) {
            if (o->arg == 0 || o->arg > 0x7fffffffu) goto bad;
        } else {
            goto bad;
        }
        /* Aligned element access: buffer 0 (the scratch) is aligned by the engine. */
        uint32_t touched[3] = {o->dst, o->a, o->b};
        uint64_t offs[3] = {o->dst_off, o->a_off, o->b_off};
        for (int k = 0; k < (o->kind == LPN_COMBINE ? 3 : 1); k++) {
            uint64_t base = touched[k] ? bases[touched[k] - 1] : 0;
            if ((base + offs[k]) % item) {
                lpn_program_free(out);
                return *why = "an element range is not aligned to its type", -1;
            }
        }
    }
    const char *unindexed = out->star ? check_star(out) : out->net ? index_messages(out) : NULL;
    if (unindexed) {
        lpn_program_free(out);
        return *why = unindexed, -1;
    }
    if (!out->net && tileable(out, bases) < 0) {
        lpn_program_free(out);
        return *why = "out of memory", -1;
    }
    return 0;
bad_buffer:
    lpn_program_free(out);
    return *why = "an op names a buffer the program does not have", -1;
bad_range:
    lpn_program_free(out);
    return *why = "an op reaches past the end of its buffer", -1;
bad:
    lpn_program_free(out);
    return *why = "an op has an unknown kind, type or reduction", -1;
}

void lpn_program_free(lpn_program *program) {
    free(program->ops);
    free(program->sizes);
    free(program->msg);
    free(program->tx);
    free(program->rx);
    free(program->slot);
    memset(program, 0, sizeof *program);
}

void lpn_program_run(const lpn_program *program, uint8_t *const *bufs) {
    for (uint32_t i = 0; i < program->nops; i++) {
        const lpn_op *o = &program->ops[i];
        uint8_t *d = bufs[o->dst] + o->dst_off;
        switch (o->kind) {
        case LPN_COPY:
            if (o->n) memmove(d, bufs[o->a] + o->a_off, o->n);
            break;
        case LPN_COMBINE:
            lpn_combine(d, bufs[o->a] + o->a_off, bufs[o->b] + o->b_off, o->dtype, o->n, o->redop);
            break;
        case LPN_DIVIDE:
            lpn_divide(d, o->dtype, o->n, o->arg);
            break;
        default: /* net ops: a program with them runs in lpn_program_run_net (net.c) */
            break;
        }
    }
}

/* ---------------------------------------------------------------- the doorbell */

double lpn_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint32_t *bell(lpn_engine *e) { return (uint32_t *)(e->page + LPN_BELL_OFFSET); }
static uint8_t *slot(lpn_engine *e, uint32_t i) { return e->page + LPN_HEADER_BYTES + (size_t)i * LPN_SLOT_BYTES; }

static void futex_wake(uint32_t *word) {
    syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

static void ring_bell(lpn_engine *e) {
    __atomic_add_fetch(bell(e), 1u, __ATOMIC_SEQ_CST);
    futex_wake(bell(e));
}

/* Serial-number order of 32-bit sequence numbers (they wrap). */
static int seq_le(uint32_t a, uint32_t b) { return (int32_t)(a - b) <= 0; }

/* abandoned = max(abandoned, seq), lock-free: lpn_engine_yield runs on the daemon's event
 * loop and must never wait behind a program that runs under the lock. Whether it rose. */
static int raise_abandoned(lpn_engine *e, uint32_t seq) {
    uint32_t seen = __atomic_load_n(&e->abandoned, __ATOMIC_ACQUIRE);
    while (!seq_le(seq, seen))
        if (__atomic_compare_exchange_n(&e->abandoned, &seen, seq, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return 1;
    return 0;
}

static void answer(lpn_engine *e, uint32_t i, uint32_t seq, uint32_t code) {
    uint8_t *s = slot(e, i);
    __atomic_store_n((uint32_t *)(s + 12), code, __ATOMIC_RELAXED);
    __atomic_store_n((uint32_t *)(s + 8), seq, __ATOMIC_RELEASE);
    futex_wake((uint32_t *)(s + 8));
    e->served[i] = seq;
    e->first_seen[i] = 0;
}

static void record(lpn_engine *e, uint32_t seq, uint32_t plan, uint32_t code, double first, double last,
                   double done) {
    lpn_record *r = &e->records[e->nrecords % LPN_RECORDS];
    r->seq = seq;
    r->plan = plan;
    r->code = code;
    r->first_arrival = first;
    r->last_arrival = last;
    r->done = done;
    e->nrecords++;
}

static void observe(lpn_engine *e, lpn_plan *p, double seconds) {
    uint32_t b = 0;
    while (b < e->nbounds && seconds > e->bounds[b]) b++;
    p->buckets[b]++;
    p->calls++;
    p->seconds += seconds;
}

static void release_plan(lpn_plan *p);

/* Every channel closed and every plan with messages disarmed (lock held): after a failed
 * run the channels are mid-message; the daemon connects and arms again. */
static void drop_net(lpn_engine *e) {
    uint64_t drained;
    if (e->abort_fd >= 0 && read(e->abort_fd, &drained, sizeof drained) < 0) { /* not aborted: fine */
    }
    for (uint32_t c = 0; c < LPN_MAX_CHANNELS; c++)
        if (e->fds[c] >= 0) {
            close(e->fds[c]);
            e->fds[c] = -1;
        }
    for (uint32_t i = 0; i < LPN_MAX_PLANS; i++)
        if (e->plans[i].armed && e->plans[i].program.net) {
            e->plans[i].gen = (e->plans[i].gen + 1u) & 0xffffffu;
            release_plan(&e->plans[i]);
        }
}

/* Run plan ``p`` for ``seq`` (lock held). A failed net run leaves its channels
 * mid-message: they are closed, and the plan is disarmed (the daemon connects and arms
 * again once it has settled what failed). */
static uint32_t run_plan(lpn_engine *e, lpn_plan *p, uint32_t seq) {
    if (!p->program.net) {
        lpn_program_run_tiles(&p->program, p->bufs, p->tile, p->threads > 1 ? e->pool : NULL,
                              p->local ? p->bufs[0] : NULL, p->stream);
        return p->last_code = LPN_OK;
    }
    int failed = -1;
    uint32_t code =
        lpn_program_run_net(&p->program, p->bufs, e->fds, p->key, seq, p->timeout, e->abort_fd, e->lowat, &failed);
    p->last_code = code;
    e->failed_channel = failed;
    if (code == LPN_OK || code == LPN_FALLBACK) return code; /* a fallback wrote nothing */
    drop_net(e);
    return code;
}

/* One pass over the slots (lock held): answer what can be answered. Returns whether
 * anything was answered, and the earliest deadline of what still waits (0: none). */
static int serve(lpn_engine *e, double *deadline) {
    uint64_t rings[LPN_MAX_SLOTS];
    uint32_t target = 0, i;
    int have = 0, answered = 0;
    double t = lpn_now();
    *deadline = 0;
    for (i = 0; i < e->slots; i++) {
        if (!e->active[i]) continue; /* a rank of another node */
        rings[i] = __atomic_load_n((uint64_t *)slot(e, i), __ATOMIC_ACQUIRE);
        uint32_t seq = (uint32_t)(rings[i] >> 32);
        if (seq == e->served[i]) continue; /* nothing new in this slot */
        if (e->stopping || seq_le(seq, __atomic_load_n(&e->abandoned, __ATOMIC_ACQUIRE))) {
            /* it runs on the general path */
            answer(e, i, seq, LPN_FALLBACK);
            e->fallbacks++;
            answered = 1;
            continue;
        }
        if (e->first_seen[i] == 0) e->first_seen[i] = t;
        if (!have || seq_le(seq, target)) target = seq;
        have = 1;
    }
    if (!have) return answered;
    /* The lowest pending seq: do all slots ring it, for one armed plan? */
    uint32_t plan = 0, gen = 0, arrived = 0;
    int agree = 1;
    double first = 0, last = 0;
    for (i = 0; i < e->slots; i++) {
        if (!e->active[i]) continue;
        uint32_t seq = (uint32_t)(rings[i] >> 32);
        if (seq == e->served[i]) continue;
        if (seq != target) { /* a slot is past ``target``: it went to the general path */
            agree = 0;
            continue;
        }
        uint32_t p = (uint32_t)(rings[i] & 0xffu), g = (uint32_t)((rings[i] >> 8) & 0xffffffu);
        if (arrived == 0) {
            plan = p;
            gen = g;
            first = last = e->first_seen[i];
        } else if (p != plan || g != gen) {
            agree = 0;
        }
        if (e->first_seen[i] < first) first = e->first_seen[i];
        if (e->first_seen[i] > last) last = e->first_seen[i];
        arrived++;
    }
    lpn_plan *p = plan < LPN_MAX_PLANS ? &e->plans[plan] : NULL;
    if (!p || !p->armed || p->gen != gen) agree = 0;
    if (agree && arrived < e->nactive) { /* still arriving: until the plan's timeout */
        double due = first + p->timeout;
        if (t < due) {
            *deadline = due;
            return answered;
        }
        agree = 0;
    }
    if (!agree) { /* mismatch, disarmed or late: the general path says what went wrong */
        raise_abandoned(e, target);
        record(e, target, plan, LPN_FALLBACK, first, last, lpn_now());
        for (i = 0; i < e->slots; i++)
            if (e->active[i] && (uint32_t)(rings[i] >> 32) == target && target != e->served[i]) {
                answer(e, i, target, LPN_FALLBACK);
                e->fallbacks++;
            }
        return 1;
    }
    uint32_t code = run_plan(e, p, target);
    double done = lpn_now();
    /* Counted before the answers: a client that asks for status next finds it there. */
    if (code == LPN_OK) observe(e, p, done - last);
    record(e, target, plan, code, first, last, done);
    for (i = 0; i < e->slots; i++)
        if (e->active[i]) answer(e, i, target, code);
    return 1;
}

static void *loop(void *arg) {
    lpn_engine *e = arg;
    pthread_setname_np(pthread_self(), "lpsync-engine"); /* top, ps -L: which thread is busy */
    pthread_mutex_lock(&e->mu);
    while (!e->stopping) {
        uint32_t seen = __atomic_load_n(bell(e), __ATOMIC_SEQ_CST);
        double deadline;
        if (serve(e, &deadline)) continue;
        pthread_mutex_unlock(&e->mu);
        /* Sleep until a ring or the earliest deadline; a bounded wait all the same. */
        double wait = deadline > 0 ? deadline - lpn_now() : 1.0;
        if (wait > 1.0) wait = 1.0;
        if (wait < 0) wait = 0;
        struct timespec ts = {(time_t)wait, (long)((wait - (double)(time_t)wait) * 1e9)};
        syscall(SYS_futex, bell(e), FUTEX_WAIT, seen, &ts, NULL, 0);
        pthread_mutex_lock(&e->mu);
    }
    double ignored;
    serve(e, &ignored); /* stopping: every pending ring falls back */
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

int lpn_engine_init(lpn_engine *e, uint8_t *page, size_t page_len, uint32_t slots,
                    const double *bounds, uint32_t nbounds, const char **why) {
    memset(e, 0, sizeof *e);
    if (slots == 0 || slots > LPN_MAX_SLOTS) return *why = "slot count out of range", -1;
    if (page_len < LPN_HEADER_BYTES + (size_t)slots * LPN_SLOT_BYTES) return *why = "page too small", -1;
    if ((uintptr_t)page % 64u) return *why = "page not aligned", -1;
    if (nbounds > LPN_BUCKETS) return *why = "too many histogram bounds", -1;
    e->page = page;
    e->slots = slots;
    e->nactive = slots;
    memset(e->active, 1, slots);
    memcpy(e->bounds, bounds, nbounds * sizeof(double));
    e->nbounds = nbounds;
    uint32_t header[3] = {LPN_MAGIC, LPN_VERSION, slots};
    memset(page, 0, LPN_HEADER_BYTES + (size_t)slots * LPN_SLOT_BYTES);
    memcpy(page, header, sizeof header);
    for (uint32_t c = 0; c < LPN_MAX_CHANNELS; c++) e->fds[c] = -1;
    e->failed_channel = -1;
    e->tile = LPN_TILE;
    e->parallel = LPN_PARALLEL;
    e->stream = LPN_STREAM;
    e->abort_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (e->abort_fd < 0) return *why = "no eventfd for aborts", -1;
    pthread_mutex_init(&e->mu, NULL);
    return 0;
}

int lpn_engine_tune(lpn_engine *e, uint64_t tile, uint64_t parallel, uint32_t threads, uint64_t stream,
                    const char **why) {
    if (tile % 64u || tile > LPN_MAX_SCRATCH) return *why = "a tile is a multiple of 64 bytes, at most 4 GiB", -1;
    if (threads > LPN_MAX_SLOTS) return *why = "thread count out of range", -1;
    pthread_mutex_lock(&e->mu);
    int armed = e->armed_once;
    if (!armed) {
        e->tile = tile;
        e->parallel = parallel;
        e->threads = threads;
        e->stream = stream;
    }
    pthread_mutex_unlock(&e->mu);
    return armed ? (*why = "tuned after a plan was armed", -1) : 0;
}

/* The threads a run of ``program`` takes (lock held). */
static uint32_t program_threads(const lpn_engine *e, const lpn_program *program) {
    if (program->net || !program->tiled || !e->tile || !e->pool || program->span < e->parallel) return 1;
    uint64_t ntiles = program->span / e->tile + (program->span % e->tile != 0);
    uint64_t threads = lpn_pool_workers(e->pool) + 1u;
    return (uint32_t)(ntiles < threads ? ntiles : threads);
}

void lpn_engine_shape(lpn_engine *e, uint32_t index, uint64_t *tile, uint32_t *threads, uint64_t *scratch,
                      int *stream) {
    *tile = *scratch = 0;
    *threads = 0;
    *stream = 0;
    if (index >= LPN_MAX_PLANS) return;
    pthread_mutex_lock(&e->mu);
    const lpn_plan *p = &e->plans[index];
    if (p->armed) {
        *tile = p->tile;
        *threads = p->threads;
        *scratch = p->scratch;
        *stream = p->stream;
    }
    pthread_mutex_unlock(&e->mu);
}

/* The pool, where a plan of ``program`` would use it and there is none yet (lock held):
 * min(CPUs this process may run on, this node's participants) threads in all, or the
 * tuned count. None started: the engine's thread runs every tile. */
static void want_pool(lpn_engine *e, const lpn_program *program) {
    if (e->pool || program->net || !program->tiled || !e->tile || program->span < e->parallel) return;
    uint32_t threads = e->threads;
    if (threads == 0) {
        cpu_set_t cpus;
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        threads = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? (uint32_t)CPU_COUNT(&cpus)
                  : online > 0                                  ? (uint32_t)online
                                                                : 1u;
        if (threads > e->nactive) threads = e->nactive;
    }
    if (threads > 1) e->pool = lpn_pool_create(threads - 1u);
}

int lpn_engine_start(lpn_engine *e) {
    if (pthread_create(&e->thread, NULL, loop, e) != 0) return -1;
    e->started = 1;
    return 0;
}

void lpn_engine_stop(lpn_engine *e) {
    if (!e->started) return;
    pthread_mutex_lock(&e->mu);
    e->stopping = 1;
    pthread_mutex_unlock(&e->mu);
    ring_bell(e);
    pthread_join(e->thread, NULL);
    e->started = 0;
}

static void release_plan(lpn_plan *p) {
    if (p->bufs) free(p->bufs[0]);
    free(p->bufs);
    lpn_program_free(&p->program);
    p->bufs = NULL;
    p->armed = 0;
}

void lpn_engine_destroy(lpn_engine *e) {
    lpn_engine_stop(e);
    lpn_pool_destroy(e->pool);
    e->pool = NULL;
    for (uint32_t i = 0; i < LPN_MAX_PLANS; i++) release_plan(&e->plans[i]);
    for (uint32_t c = 0; c < LPN_MAX_CHANNELS; c++)
        if (e->fds[c] >= 0) close(e->fds[c]);
    if (e->abort_fd >= 0) close(e->abort_fd);
    pthread_mutex_destroy(&e->mu);
}

long lpn_engine_arm(lpn_engine *e, uint32_t index, const uint8_t *data, size_t len,
                    const uint64_t *bases, const uint64_t *sizes, uint32_t nbases, double timeout,
                    uint64_t key, const char **why) {
    if (index >= LPN_MAX_PLANS) return *why = "plan index out of range", -1;
    if (!(timeout > 0) || timeout > 1e7) return *why = "timeout out of range", -1;
    lpn_program program;
    if (lpn_program_parse(data, len, bases, sizes, nbases, &program, why) != 0) return -1;
    /* How it runs, fixed now (lpn_engine_tune refuses from here on): by tiles, on threads,
     * each with its own tiles of the scratch where they take less than the whole. */
    pthread_mutex_lock(&e->mu);
    e->armed_once = 1;
    want_pool(e, &program);
    uint64_t tile = !program.net && program.tiled ? e->tile : 0;
    uint32_t threads = program_threads(e, &program);
    int stream = tile && program.span >= e->stream;
    pthread_mutex_unlock(&e->mu);
    uint64_t tiles = lpn_program_tile_scratch(&program, tile) * threads;
    int local = tile && tiles && tiles < program.sizes[0];
    uint8_t **bufs = calloc(program.nbuf, sizeof(uint8_t *));
    /* The scratch: 64-byte aligned, at least one line so that it is never NULL. */
    size_t scratch = (size_t)(((local ? tiles : program.sizes[0]) + 63u) & ~(uint64_t)63u);
    if (bufs) bufs[0] = aligned_alloc(64, scratch ? scratch : 64);
    if (!bufs || !bufs[0]) {
        free(bufs);
        lpn_program_free(&program);
        return *why = "out of memory", -1;
    }
    for (uint32_t i = 1; i < program.nbuf; i++) bufs[i] = (uint8_t *)(uintptr_t)bases[i - 1];
    pthread_mutex_lock(&e->mu);
    lpn_plan *p = &e->plans[index];
    release_plan(p);
    p->program = program;
    p->bufs = bufs;
    p->timeout = timeout;
    p->key = key;
    p->last_code = LPN_OK;
    p->gen = (p->gen + 1u) & 0xffffffu;
    p->calls = 0;
    p->seconds = 0;
    memset(p->buckets, 0, sizeof p->buckets);
    p->tile = tile;
    p->threads = threads;
    p->local = local;
    p->stream = stream;
    p->scratch = scratch;
    p->armed = 1;
    long gen = (long)p->gen;
    pthread_mutex_unlock(&e->mu);
    return gen;
}

void lpn_engine_disarm(lpn_engine *e, uint32_t index) {
    if (index >= LPN_MAX_PLANS) return;
    pthread_mutex_lock(&e->mu); /* waits for a run of it: its buffers are unmapped next */
    lpn_plan *p = &e->plans[index];
    if (p->armed) {
        p->gen = (p->gen + 1u) & 0xffffffu;
        release_plan(p);
    }
    pthread_mutex_unlock(&e->mu);
    ring_bell(e); /* rings of it that wait fall back now */
}

void lpn_engine_yield(lpn_engine *e, uint32_t seq) {
    if (raise_abandoned(e, seq)) ring_bell(e); /* the engine's thread falls back its rings */
}

uint32_t lpn_engine_run(lpn_engine *e, uint32_t index, uint32_t gen, uint32_t seq) {
    if (index >= LPN_MAX_PLANS) return LPN_FALLBACK;
    pthread_mutex_lock(&e->mu);
    lpn_plan *p = &e->plans[index];
    uint32_t code = p->armed && p->gen == gen ? run_plan(e, p, seq) : LPN_FALLBACK;
    pthread_mutex_unlock(&e->mu);
    return code;
}

void lpn_engine_drop_net(lpn_engine *e) {
    pthread_mutex_lock(&e->mu);
    drop_net(e);
    pthread_mutex_unlock(&e->mu);
    ring_bell(e); /* rings of a disarmed plan fall back */
}

void lpn_engine_abort(lpn_engine *e) {
    uint64_t one = 1;
    if (write(e->abort_fd, &one, sizeof one) < 0) { /* full (aborted many times): still set */
    }
}

void lpn_engine_notice(lpn_engine *e, uint32_t seq, int chan) {
    pthread_mutex_lock(&e->mu); /* never between a run's messages */
    for (uint32_t c = 0; c < LPN_MAX_CHANNELS; c++)
        if ((chan < 0 || (uint32_t)chan == c) && e->fds[c] >= 0 && lpn_send_notice(e->fds[c], seq) != 0) {
            close(e->fds[c]); /* a channel that does not take 32 bytes is of no use */
            e->fds[c] = -1;
        }
    pthread_mutex_unlock(&e->mu);
}

int lpn_engine_activate(lpn_engine *e, const uint8_t *active, uint32_t n, const char **why) {
    if (n != e->slots) return *why = "one flag per slot", -1;
    uint32_t count = 0;
    for (uint32_t i = 0; i < n; i++) count += active[i] ? 1u : 0u;
    if (count == 0) return *why = "no slot of this node", -1;
    pthread_mutex_lock(&e->mu);
    for (uint32_t i = 0; i < n; i++) e->active[i] = active[i] ? 1 : 0;
    e->nactive = count;
    pthread_mutex_unlock(&e->mu);
    ring_bell(e);
    return 0;
}

int lpn_engine_connect(lpn_engine *e, uint32_t chan, int fd, const char **why) {
    if (chan >= LPN_MAX_CHANNELS) return *why = "channel out of range", -1;
    int mine = -1;
    if (fd >= 0) {
        mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (mine < 0) return *why = "cannot duplicate the socket", -1;
        int flags = fcntl(mine, F_GETFL);
        if (flags < 0 || fcntl(mine, F_SETFL, flags | O_NONBLOCK) < 0) {
            close(mine);
            return *why = "cannot make the socket non-blocking", -1;
        }
    }
    pthread_mutex_lock(&e->mu); /* never under a run that uses the channel */
    if (e->fds[chan] >= 0) close(e->fds[chan]);
    e->fds[chan] = mine;
    e->lowat[chan] = 1; /* a socket's default */
    pthread_mutex_unlock(&e->mu);
    return 0;
}
