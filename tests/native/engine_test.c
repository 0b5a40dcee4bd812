/* The native engine under AddressSanitizer and UndefinedBehaviorSanitizer (make test-native).
 *
 * Runs without Python: programs against a reference written here (float min and max over
 * NaNs, signed zeros and infinities against numpy's rules too), tiled and threaded runs
 * against the op-by-op run (every type and reduction, in and out of place, sizes that are
 * no multiple of the tile or of the threads; programs whose ops may not run by tiles
 * recognised as such), the doorbell with threads as clients (armed runs, tiled and
 * threaded ones too, a disarm while a ring waits, a yield, a deadline, a stop), and the
 * program parser against every truncation and random corruption of valid programs (a fuzz
 * of its checks: nothing it accepts may reach past its buffers, and what it accepts as
 * tiled gives the op-by-op run's bytes on threads). */
#include "../../lpsync/native/engine.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int failures;
#define CHECK(cond, ...)                                       \
    do {                                                       \
        if (!(cond)) {                                         \
            failures++;                                        \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                      \
            fputc('\n', stderr);                               \
        }                                                      \
    } while (0)

/* ---- encoding, as lpsync/native/program.py writes it */
typedef struct {
    uint8_t bytes[1 << 16];
    size_t len;
} blob;

static void put(blob *b, const void *p, size_t n) {
    memcpy(b->bytes + b->len, p, n);
    b->len += n;
}

static void program(blob *b, uint32_t nbuf, const uint64_t *sizes, uint32_t nops, const lpn_op *ops) {
    lpn_program_header h = {LPN_PROGRAM_MAGIC, LPN_VERSION, nbuf, nops};
    b->len = 0;
    put(b, &h, sizeof h);
    put(b, sizes, nbuf * 8u);
    put(b, ops, nops * sizeof(lpn_op));
}

/* allreduce(sum, float32) of P participants of N elements, as program.direct compiles it:
 * scratch = in0; scratch += in_r; out_r = scratch. */
#define P 3
#define N 1000
static lpn_op allreduce_ops[1 + (P - 1) + P];
static uint64_t allreduce_sizes[1 + 2 * P];

static uint32_t allreduce_program(blob *b, uint32_t redop, uint32_t dtype, uint32_t item) {
    uint32_t k = 0;
    allreduce_sizes[0] = (uint64_t)N * item;
    for (int r = 0; r < P; r++) allreduce_sizes[1 + 2 * r] = allreduce_sizes[2 + 2 * r] = (uint64_t)N * item;
    allreduce_ops[k++] = (lpn_op){LPN_COPY, 0, 0, 0, 1, 0, 0, 0, 0, (uint64_t)N * item, 1};
    for (uint32_t r = 1; r < P; r++)
        allreduce_ops[k++] = (lpn_op){LPN_COMBINE, dtype, redop, 0, 0, 1 + 2 * r, 0, 0, 0, N, P};
    for (uint32_t r = 0; r < P; r++)
        allreduce_ops[k++] = (lpn_op){LPN_COPY, 0, 0, 2 + 2 * r, 0, 0, 0, 0, 0, (uint64_t)N * item, 1};
    program(b, 1 + 2 * P, allreduce_sizes, k, allreduce_ops);
    return k;
}

static float inputs[P][N], outputs[P][N];

static void fill(void) {
    for (int r = 0; r < P; r++)
        for (int i = 0; i < N; i++) {
            inputs[r][i] = (float)((r + 1) * 0.5 + i * 0.25);
            outputs[r][i] = -1.0f;
        }
}

static uint64_t bases[2 * P], real_sizes[2 * P];
static void set_bases(void) {
    for (int r = 0; r < P; r++) {
        bases[2 * r] = (uint64_t)(uintptr_t)inputs[r];
        bases[2 * r + 1] = (uint64_t)(uintptr_t)outputs[r];
        real_sizes[2 * r] = real_sizes[2 * r + 1] = sizeof inputs[r];
    }
}

static void check_sum(const char *what) {
    for (int r = 0; r < P; r++)
        for (int i = 0; i < N; i++) {
            float want = inputs[0][i];
            for (int q = 1; q < P; q++) want = want + inputs[q][i];
            if (outputs[r][i] != want) {
                CHECK(0, "%s: rank %d element %d is %g, want %g", what, r, i, outputs[r][i], want);
                return;
            }
        }
}

static void test_programs(void) {
    blob b;
    lpn_program prog;
    const char *why = NULL;
    allreduce_program(&b, LPN_SUM, LPN_F32, 4);
    set_bases();
    CHECK(lpn_program_parse(b.bytes, b.len, bases, real_sizes, 2 * P, &prog, &why) == 0, "parse: %s", why);
    uint8_t *bufs[1 + 2 * P];
    bufs[0] = aligned_alloc(64, 4096);
    for (int i = 0; i < 2 * P; i++) bufs[1 + i] = (uint8_t *)(uintptr_t)bases[i];
    fill();
    lpn_program_run(&prog, bufs);
    check_sum("run");
    free(bufs[0]);
    lpn_program_free(&prog);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* ---- tiled and threaded runs (lpn_program_run_tiles) against the op-by-op run.
 * TP participants of TN elements: no multiple of a tile, a block or the threads. */
#define TP 4
#define TN 1001
#define TB 250 /* a block of the blocked layouts: TP * TB < TN */
static uint8_t t_in[TP][TN * 8] __attribute__((aligned(64)));
static uint8_t t_out[TP][TN * 8] __attribute__((aligned(64)));
static uint8_t t_in0[TP][TN * 8], t_out0[TP][TN * 8]; /* the inputs, kept */
static uint8_t ref_in[TP][TN * 8], ref_out[TP][TN * 8]; /* after the op-by-op run */

enum layout { ALLREDUCE_OUT, ALLREDUCE_IN, REDUCE_SCATTER_BLOCKS, ALLGATHER_IN, REDUCE_SCATTER_SHARED, SHIFTED, LAYOUTS };
static const char *const LAYOUT_NAMES[LAYOUTS] = {"allreduce", "allreduce in place", "reduce_scatter by block",
                                                   "allgather in place", "reduce_scatter reading across blocks",
                                                   "a copy shifted within the scratch"};
static const int LAYOUT_TILED[LAYOUTS] = {1, 1, 1, 1, 0, 0}; /* what the parser must decide */
static const uint32_t LAYOUT_SLOTS[LAYOUTS] = {1, 1, TP, 0, 0, 0}; /* ranges of the scratch, one start each */

/* A layout's program, as program.direct compiles it (the last two: ones that may not run
 * by tiles). Buffers: 0 scratch, 1 + 2r input r, 2 + 2r output r. */
static void tiles_program(blob *b, enum layout layout, uint32_t dtype, uint32_t redop, int avg, uint64_t *sizes) {
    static lpn_op ops[64];
    uint32_t k = 0, item = lpn_itemsize(dtype), r, q;
    uint64_t all = (uint64_t)TN * item, block = (uint64_t)TB * item;
    for (r = 0; r < TP; r++) sizes[1 + 2 * r] = sizes[2 + 2 * r] = all;
    sizes[0] = all;
    switch (layout) {
    case ALLREDUCE_OUT:
    case ALLREDUCE_IN:
    case SHIFTED:
        ops[k++] = (lpn_op){LPN_COPY, 0, 0, 0, 1, 0, 0, 0, 0, all, 0};
        for (r = 1; r < TP; r++) ops[k++] = (lpn_op){LPN_COMBINE, dtype, redop, 0, 0, 1 + 2 * r, 0, 0, 0, TN, 0};
        if (avg) ops[k++] = (lpn_op){LPN_DIVIDE, dtype, redop, 0, 0, 0, 0, 0, 0, TN, TP};
        if (layout == SHIFTED) ops[k++] = (lpn_op){LPN_COPY, 0, 0, 0, 0, 0, 0, 64, 0, all - 64, 0};
        for (r = 0; r < TP; r++) ops[k++] = (lpn_op){LPN_COPY, 0, 0, 2 + 2 * r, 0, 0, 0, 0, 0, all, 0};
        break;
    case REDUCE_SCATTER_BLOCKS: /* per block: reduce it in the scratch at its offset, copy it out */
        for (r = 0; r < TP; r++) {
            uint64_t at = r * block;
            ops[k++] = (lpn_op){LPN_COPY, 0, 0, 0, 1, 0, at, at, 0, block, 0};
            for (q = 1; q < TP; q++) ops[k++] = (lpn_op){LPN_COMBINE, dtype, redop, 0, 0, 1 + 2 * q, at, at, at, TB, 0};
            if (avg) ops[k++] = (lpn_op){LPN_DIVIDE, dtype, redop, 0, 0, 0, at, 0, 0, TB, TP};
            ops[k++] = (lpn_op){LPN_COPY, 0, 0, 2 + 2 * r, 0, 0, 0, at, 0, block, 0};
        }
        break;
    case REDUCE_SCATTER_SHARED: /* the whole reduction first, then every block out of it */
        ops[k++] = (lpn_op){LPN_COPY, 0, 0, 0, 1, 0, 0, 0, 0, all, 0};
        for (r = 1; r < TP; r++) ops[k++] = (lpn_op){LPN_COMBINE, dtype, redop, 0, 0, 1 + 2 * r, 0, 0, 0, TN, 0};
        for (r = 0; r < TP; r++) ops[k++] = (lpn_op){LPN_COPY, 0, 0, 2 + 2 * r, 0, 0, 0, r * block, 0, block, 0};
        break;
    default: /* ALLGATHER_IN: output r is buffer r, its block r the input r (as the client lays it out) */
        for (r = 0; r < TP; r++) sizes[1 + 2 * r] = block;
        for (r = 0; r < TP; r++)
            for (q = 0; q < TP; q++)
                if (q != r) ops[k++] = (lpn_op){LPN_COPY, 0, 0, 2 + 2 * r, 1 + 2 * q, 0, q * block, 0, 0, block, 0};
        break;
    }
    program(b, 1 + 2 * TP, sizes, k, ops);
}

static void tiles_bases(enum layout layout, uint32_t item, uint64_t *bases) {
    for (uint32_t r = 0; r < TP; r++) {
        bases[2 * r] = (uint64_t)(uintptr_t)t_in[r];
        bases[2 * r + 1] = (uint64_t)(uintptr_t)t_out[r];
        if (layout == ALLREDUCE_IN) bases[2 * r + 1] = bases[2 * r]; /* the input is the output */
        if (layout == ALLGATHER_IN) bases[2 * r] = bases[2 * r + 1] + (uint64_t)r * TB * item;
    }
}

/* Values that neither overflow nor turn NaN (bitwise comparable on every path). */
static void tiles_fill(uint32_t dtype) {
    for (uint32_t r = 0; r < TP; r++)
        for (uint32_t i = 0; i < TN; i++) {
            uint64_t x = next();
            switch (dtype) {
            case LPN_F16: ((uint16_t *)t_in[r])[i] = (uint16_t)((x & 0x83ffu) | ((10u + x % 10u) << 10)); break;
            case LPN_BF16: ((uint16_t *)t_in[r])[i] = (uint16_t)((x & 0x807fu) | ((120u + x % 14u) << 7)); break;
            case LPN_F32: ((float *)t_in[r])[i] = (float)((int64_t)(x % 20001u) - 10000) / 7.0f; break;
            case LPN_F64: ((double *)t_in[r])[i] = (double)((int64_t)(x % 20001u) - 10000) / 7.0; break;
            default: memcpy(t_in[r] + (size_t)i * lpn_itemsize(dtype), &x, lpn_itemsize(dtype)); break;
            }
        }
    for (uint32_t r = 0; r < TP; r++) /* in place, an output holds inputs */
        for (uint32_t i = 0; i < TN * 8; i++) t_out[r][i] = (uint8_t)(next() >> 24);
    memcpy(t_in0, t_in, sizeof t_in);
    memcpy(t_out0, t_out, sizeof t_out);
}

/* Float min and max: the special values of min_max_specials (NaNs, +-0, infinities) at
 * every third element of every input, so that ties and NaNs meet across the tiles. */
static const uint64_t *specials_of(uint32_t dtype, uint32_t *count);
static void tiles_specials(uint32_t dtype) {
    uint32_t count, item = lpn_itemsize(dtype);
    const uint64_t *table = specials_of(dtype, &count);
    for (uint32_t r = 0; r < TP; r++)
        for (uint32_t i = r; i < TN; i += 3) memcpy(t_in[r] + (size_t)i * item, &table[next() % count], item);
    memcpy(t_in0, t_in, sizeof t_in);
}

static void test_tiles(void) {
    lpn_pool *pool = lpn_pool_create(3);
    CHECK(pool && lpn_pool_workers(pool) == 3, "a pool of 3 workers");
    uint64_t tiles[] = {64, 192, 1280, 1u << 20}; /* many, an odd count of lines, streamed copies, one */
    unsigned runs = 0;
    for (int layout = 0; layout < LAYOUTS; layout++)
        for (uint32_t dtype = LPN_F16; dtype < LPN_DTYPE_END; dtype++)
            for (uint32_t redop = LPN_SUM; redop < LPN_REDOP_END; redop++)
                for (int avg = 0; avg < 2; avg++) {
                    if (avg && redop != LPN_SUM) continue;
                    if (layout == ALLGATHER_IN && (redop != LPN_SUM || avg)) continue; /* moves bytes only */
                    blob b;
                    uint64_t sizes[1 + 2 * TP], bases[2 * TP];
                    const char *why = NULL;
                    lpn_program prog;
                    uint32_t item = lpn_itemsize(dtype);
                    tiles_program(&b, (enum layout)layout, dtype, redop, avg, sizes);
                    tiles_bases((enum layout)layout, item, bases);
                    if (lpn_program_parse(b.bytes, b.len, bases, sizes + 1, 2 * TP, &prog, &why) != 0) {
                        CHECK(0, "%s refused: %s", LAYOUT_NAMES[layout], why);
                        continue;
                    }
                    CHECK(prog.tiled == LAYOUT_TILED[layout] && prog.slots == LAYOUT_SLOTS[layout],
                          "%s: tiled %d, %u slots", LAYOUT_NAMES[layout], prog.tiled, prog.slots);
                    uint8_t *bufs[1 + 2 * TP];
                    bufs[0] = aligned_alloc(64, (sizes[0] + 63) & ~(uint64_t)63);
                    for (int i = 0; i < 2 * TP; i++) bufs[1 + i] = (uint8_t *)(uintptr_t)bases[i];
                    tiles_fill(dtype);
                    if (redop >= LPN_MIN && dtype <= LPN_F64) tiles_specials(dtype);
                    lpn_program_run(&prog, bufs);
                    memcpy(ref_in, t_in, sizeof t_in);
                    memcpy(ref_out, t_out, sizeof t_out);
                    for (unsigned t = 0; t < sizeof tiles / sizeof tiles[0]; t++)
                        for (int threaded = 0; threaded < 2; threaded++)
                            for (int own = 0; own < 3; own++) { /* the whole scratch; each thread's tiles;
                                                                  and streaming stores */
                                uint64_t area = lpn_program_tile_scratch(&prog, tiles[t]) * (threaded ? 4u : 1u);
                                uint8_t *local = own && area ? aligned_alloc(64, area) : NULL;
                                memcpy(t_in, t_in0, sizeof t_in);
                                memcpy(t_out, t_out0, sizeof t_out);
                                lpn_program_run_tiles(&prog, bufs, tiles[t], threaded ? pool : NULL, local, own == 2);
                                free(local);
                                runs++;
                                CHECK(!memcmp(t_in, ref_in, sizeof t_in) && !memcmp(t_out, ref_out, sizeof t_out),
                                      "%s, type %u, reduction %u%s, tile %llu, %s, %s: differs from the op-by-op run",
                                      LAYOUT_NAMES[layout], dtype, redop, avg ? " avg" : "",
                                      (unsigned long long)tiles[t], threaded ? "4 threads" : "1 thread",
                                      own == 2 ? "streamed" : own ? "tiles of the scratch" : "the whole scratch");
                            }
                    free(bufs[0]);
                    lpn_program_free(&prog);
                }
    lpn_pool_destroy(pool);
    /* And one against a reference computed here: int32 sums wrap, 4 threads, 64-byte tiles. */
    blob b;
    uint64_t sizes[1 + 2 * TP], bases[2 * TP];
    const char *why = NULL;
    lpn_program prog;
    tiles_program(&b, ALLREDUCE_OUT, LPN_I32, LPN_SUM, 0, sizes);
    tiles_bases(ALLREDUCE_OUT, 4, bases);
    CHECK(lpn_program_parse(b.bytes, b.len, bases, sizes + 1, 2 * TP, &prog, &why) == 0, "parse: %s", why);
    uint8_t *bufs[1 + 2 * TP];
    bufs[0] = aligned_alloc(64, (sizes[0] + 63) & ~(uint64_t)63);
    for (int i = 0; i < 2 * TP; i++) bufs[1 + i] = (uint8_t *)(uintptr_t)bases[i];
    tiles_fill(LPN_I32);
    pool = lpn_pool_create(3);
    uint8_t *local = aligned_alloc(64, lpn_program_tile_scratch(&prog, 64) * 4u);
    lpn_program_run_tiles(&prog, bufs, 64, pool, local, 1);
    free(local);
    lpn_pool_destroy(pool);
    for (uint32_t i = 0; i < TN; i++) {
        uint32_t want = 0;
        for (uint32_t r = 0; r < TP; r++) want += ((uint32_t *)t_in[r])[i];
        for (uint32_t r = 0; r < TP; r++)
            if (((uint32_t *)t_out[r])[i] != want) {
                CHECK(0, "int32 sum at %u of rank %u: %u, want %u", i, r, ((uint32_t *)t_out[r])[i], want);
                i = TN;
                break;
            }
    }
    free(bufs[0]);
    lpn_program_free(&prog);
    printf("tiles: %u tiled and threaded runs, every type and reduction, as op by op; an int32 sum as computed here\n",
           runs);
}

/* ---- float min and max against numpy's rules, written here from the bits alone:
 * a NaN operand wins, the first where both are (its bits, payload and all, signalling ones
 * too); otherwise the smaller (min) or larger (max); where they compare equal (+0 and -0,
 * or the same bits) float16 gives the first operand and bfloat16, float32 and float64 the
 * second (numpy's half loop; ml_dtypes' and numpy's SIMD loops, as read on x86). */
static const uint64_t F16_SPECIALS[] = {0x7e00, 0xfe00, 0x7e2b, 0x7c01, 0xfd55, 0x0000, 0x8000, 0x7c00,
                                        0xfc00, 0x0001, 0x8001, 0x3c00, 0xbc00, 0x4000, 0x7bff, 0xc500};
static const uint64_t BF16_SPECIALS[] = {0x7fc0, 0xffc0, 0x7fd3, 0x7f81, 0xffa5, 0x0000, 0x8000, 0x7f80,
                                         0xff80, 0x0001, 0x8001, 0x3f80, 0xbf80, 0x4000, 0x7f7f, 0xc0a0};
static const uint64_t F32_SPECIALS[] = {0x7fc00000, 0xffc00000, 0x7fc0abcd, 0x7f800001, 0xffa5a5a5, 0,
                                        0x80000000, 0x7f800000, 0xff800000, 1, 0x80000001, 0x3f800000,
                                        0xbf800000, 0x40000000, 0x7f7fffff, 0xc0a00000};
static const uint64_t F64_SPECIALS[] = {
    0x7ff8000000000000ull, 0xfff8000000000000ull, 0x7ff80000deadbeefull, 0x7ff0000000000001ull,
    0xfff5a5a5a5a5a5a5ull, 0, 0x8000000000000000ull, 0x7ff0000000000000ull, 0xfff0000000000000ull, 1,
    0x8000000000000001ull, 0x3ff0000000000000ull, 0xbff0000000000000ull, 0x4000000000000000ull,
    0x7fefffffffffffffull, 0xc014000000000000ull};

static const uint64_t *specials_of(uint32_t dtype, uint32_t *count) {
    *count = 16;
    return dtype == LPN_F16 ? F16_SPECIALS : dtype == LPN_BF16 ? BF16_SPECIALS : dtype == LPN_F32 ? F32_SPECIALS
                                                                                                  : F64_SPECIALS;
}

/* The exponent's bits and the sign's of a float type. */
static void float_bits(uint32_t dtype, uint64_t *exponent, uint64_t *sign) {
    switch (dtype) {
    case LPN_F16: *exponent = 0x7c00u, *sign = 0x8000u; break;
    case LPN_BF16: *exponent = 0x7f80u, *sign = 0x8000u; break;
    case LPN_F32: *exponent = 0x7f800000u, *sign = 0x80000000u; break;
    default: *exponent = 0x7ff0000000000000ull, *sign = 0x8000000000000000ull; break;
    }
}

static uint64_t min_max_reference(uint32_t dtype, uint32_t redop, uint64_t a, uint64_t b) {
    uint64_t exponent, sign;
    float_bits(dtype, &exponent, &sign);
    uint64_t mantissa = (exponent - 1) & ~exponent & ~sign; /* the bits below the exponent */
    int a_nan = (a & exponent) == exponent && (a & mantissa), b_nan = (b & exponent) == exponent && (b & mantissa);
    if (a_nan) return a;
    if (b_nan) return b;
    /* Sign and magnitude as one ordered number; +0 and -0 are both 0. */
    int64_t x = (int64_t)(a & ~sign), y = (int64_t)(b & ~sign);
    if (a & sign) x = -x;
    if (b & sign) y = -y;
    if (x == y) return dtype == LPN_F16 ? a : b;
    return (redop == LPN_MIN) == (x < y) ? a : b;
}

static void test_min_max(void) {
    enum { K = 16 };
    static uint8_t a[K * K * 8], b[K * K * 8], d[K * K * 8];
    unsigned checked = 0;
    for (uint32_t dtype = LPN_F16; dtype <= LPN_F64; dtype++) {
        uint32_t count, item = lpn_itemsize(dtype);
        const uint64_t *table = specials_of(dtype, &count);
        for (uint32_t i = 0; i < K; i++)
            for (uint32_t j = 0; j < K; j++) { /* every ordered pair */
                memcpy(a + (size_t)(i * K + j) * item, &table[i], item);
                memcpy(b + (size_t)(i * K + j) * item, &table[j], item);
            }
        for (uint32_t redop = LPN_MIN; redop <= LPN_MAX; redop++)
            for (int in_place = 0; in_place < 2; in_place++) {
                if (in_place) memcpy(d, a, sizeof a); /* d = d (op) b, as a program's accumulator */
                lpn_combine(d, in_place ? d : a, b, dtype, K * K, redop);
                for (uint32_t e = 0; e < K * K; e++) {
                    uint64_t got = 0, want = min_max_reference(dtype, redop, table[e / K], table[e % K]);
                    memcpy(&got, d + (size_t)e * item, item);
                    checked++;
                    if (got != want) {
                        CHECK(0, "type %u %s(%#llx, %#llx)%s: %#llx, want %#llx", dtype, redop == LPN_MIN ? "min" : "max",
                              (unsigned long long)table[e / K], (unsigned long long)table[e % K],
                              in_place ? " in place" : "", (unsigned long long)got, (unsigned long long)want);
                        break;
                    }
                }
            }
    }
    printf("min/max: %u float pairs (NaNs, signed zeros, infinities) as numpy's rules give them\n", checked);
}

/* ---- the parser: truncations and random corruptions of a valid program */

static void net_program(int r);
static blob net_blob[2];

/* Seed 0: the local allreduce; seed 1: the same with a message each way in the middle
 * (net ops over the same buffers, as across.py compiles them). */
static void fuzz_seed(blob *good, int seed) {
    allreduce_program(good, LPN_SUM, LPN_F32, 4);
    if (seed == 0) return;
    lpn_op extra[2] = {
        {LPN_SEND, 0, 0, 0, 1, 1, 0, 0, 0, (uint64_t)N * 4, 0},
        {LPN_RECV_COMBINE, LPN_F32, LPN_SUM, 2, 1, 1, 0, 0, 0, N, 0},
    };
    uint32_t k = 1 + (P - 1) + P;
    lpn_op ops[1 + (P - 1) + P + 2];
    memcpy(ops, allreduce_ops, sizeof allreduce_ops);
    memcpy(ops + k, extra, sizeof extra);
    program(good, 1 + 2 * P, allreduce_sizes, k + 2, ops);
}

static void test_parser(unsigned rounds, int seed) {
    blob good, bad;
    lpn_program prog;
    const char *why;
    fuzz_seed(&good, seed);
    set_bases();
    for (size_t cut = 0; cut < good.len; cut++) /* every truncation is refused */
        CHECK(lpn_program_parse(good.bytes, cut, bases, real_sizes, 2 * P, &prog, &why) != 0, "truncated at %zu accepted", cut);
    uint8_t *bufs[1 + 2 * P];
    bufs[0] = aligned_alloc(64, 4096);
    for (int i = 0; i < 2 * P; i++) bufs[1 + i] = (uint8_t *)(uintptr_t)bases[i];
    unsigned accepted = 0, tiled = 0;
    lpn_pool *fuzz_pool = lpn_pool_create(2);
    CHECK(fuzz_pool && lpn_pool_workers(fuzz_pool) == 2, "a pool of 2 workers");
    for (unsigned round = 0; round < rounds; round++) {
        bad = good;
        unsigned flips = 1 + (unsigned)(next() % 4);
        for (unsigned f = 0; f < flips; f++) {
            size_t at = (size_t)(next() % bad.len);
            switch (next() % 3) {
            case 0: bad.bytes[at] ^= (uint8_t)(1u << (next() % 8)); break;
            case 1: bad.bytes[at] = (uint8_t)next(); break;
            default: { /* a whole field set to an edge value */
                uint64_t edges[] = {0, 1, 0xffffffffull, 0xffffffffffffffffull, N * 4, N * 4 + 1, 1ull << 63};
                uint64_t v = edges[next() % 7];
                size_t n = bad.len - at < 8 ? bad.len - at : 8;
                memcpy(bad.bytes + at, &v, n);
            }
            }
        }
        if (lpn_program_parse(bad.bytes, bad.len, bases, real_sizes, 2 * P, &prog, &why) == 0) {
            /* Accepted: it must stay inside the buffers (ASan says otherwise); the
             * scratch is as large as the program says, as the engine makes it. */
            accepted++;
            uint8_t *scratch = bufs[0];
            if (prog.sizes[0] > 4096) {
                if (prog.sizes[0] > (1u << 26)) { /* large but allowed: not worth the memory here */
                    lpn_program_free(&prog);
                    continue;
                }
                bufs[0] = aligned_alloc(64, (prog.sizes[0] + 63) & ~(uint64_t)63);
            }
            fill();
            if (prog.net) { /* no channels: it runs up to its first message, then fails */
                int fds[LPN_MAX_CHANNELS], failed;
                for (unsigned c = 0; c < LPN_MAX_CHANNELS; c++) fds[c] = -1;
                uint32_t code = lpn_program_run_net(&prog, bufs, fds, 0, 0, 0.01, -1, NULL, &failed);
                CHECK(code == LPN_LOST, "a program with messages and no channels ended %u", code);
            } else { /* op by op, then by tiles of 64 bytes on 3 threads: the same bytes */
                static float want_in[P][N], want_out[P][N];
                memset(bufs[0], 0, prog.sizes[0]);
                lpn_program_run(&prog, bufs);
                memcpy(want_in, inputs, sizeof inputs);
                memcpy(want_out, outputs, sizeof outputs);
                fill();
                memset(bufs[0], 0, prog.sizes[0]);
                uint64_t tile = round % 2 ? 64 : 1280, area = lpn_program_tile_scratch(&prog, tile) * 3u;
                uint8_t *local = area ? aligned_alloc(64, area) : NULL;
                lpn_program_run_tiles(&prog, bufs, tile, fuzz_pool, local, round % 3 == 0);
                free(local);
                tiled += prog.tiled;
                CHECK(!memcmp(want_in, inputs, sizeof inputs) && !memcmp(want_out, outputs, sizeof outputs),
                      "round %u: a %s run wrote other bytes than the op-by-op one", round,
                      prog.tiled ? "tiled" : "(refused) tiled");
            }
            if (bufs[0] != scratch) {
                free(bufs[0]);
                bufs[0] = scratch;
            }
            lpn_program_free(&prog);
        }
    }
    free(bufs[0]);
    lpn_pool_destroy(fuzz_pool);
    printf("parser (%s): %u corrupted programs, %u accepted and run inside their buffers (%u of them tiled, "
           "on 3 threads, as op by op)\n",
           seed ? "with messages" : "local", rounds, accepted, tiled);
}

/* ---- net ops (net.c): two nodes over a socket pair, each on a thread. Node r's program
 * is a 2-node allreduce as lpsync/native/across.py compiles it: send the input to the
 * peer (channel = the peer node), receive the peer's input and add it into the output. */
typedef struct { /* net.c's header: the wire contract this test writes by hand */
    uint64_t key;
    uint32_t seq, msg;
    uint64_t nbytes;
    uint32_t kind, magic;
} wire_header;

static float net_data[2][N];
static lpn_program net_prog[2];

static void net_program(int r) {
    uint64_t sizes[3] = {(uint64_t)N * 4, (uint64_t)N * 4, (uint64_t)N * 4}; /* scratch, in, out */
    uint32_t peer = 1u - (uint32_t)r;
    lpn_op ops[3] = {
        {LPN_GO, 0, 0, 0, r == 0 ? 1u : 0u, peer, 0, 0, 0, 0, 0}, /* node 0 is the GO round's root */
        {LPN_SEND, 0, 0, 0, 1, peer, 0, 0, 0, (uint64_t)N * 4, 0},
        {LPN_RECV_COMBINE, LPN_F32, LPN_SUM, 2, 1, peer, 0, 0, 0, N, 0},
    };
    program(&net_blob[r], 3, sizes, 3, ops);
}

typedef struct {
    int node, fds[LPN_MAX_CHANNELS], failed, abort_fd;
    uint64_t key;
    uint32_t seq, code;
    double timeout;
} net_node;

static void *net_run(void *arg) {
    net_node *n = arg;
    uint8_t *scratch = aligned_alloc(64, ((size_t)N * 4 + 63) & ~(size_t)63);
    uint8_t *bufs[3] = {scratch, (uint8_t *)net_data[n->node], (uint8_t *)net_data[n->node]};
    n->code = lpn_program_run_net(&net_prog[n->node], bufs, n->fds, n->key, n->seq, n->timeout, n->abort_fd,
                                  NULL, &n->failed);
    free(scratch);
    return NULL;
}

static void net_pair(net_node *nodes, int sv[2]) {
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
    for (int r = 0; r < 2; r++) {
        fcntl(sv[r], F_SETFL, fcntl(sv[r], F_GETFL) | O_NONBLOCK);
        memset(&nodes[r], 0, sizeof nodes[r]);
        nodes[r].node = r;
        for (unsigned c = 0; c < LPN_MAX_CHANNELS; c++) nodes[r].fds[c] = -1;
        nodes[r].fds[1 - r] = sv[r];
        nodes[r].key = 7;
        nodes[r].seq = 3;
        nodes[r].timeout = 5.0;
        nodes[r].abort_fd = -1;
        for (int i = 0; i < N; i++) net_data[r][i] = (float)(r + 1) * (float)i;
    }
}

static void net_both(net_node *nodes, int only) {
    pthread_t t[2];
    for (int r = 0; r < 2; r++)
        if (only < 0 || only == r) pthread_create(&t[r], NULL, net_run, &nodes[r]);
    for (int r = 0; r < 2; r++)
        if (only < 0 || only == r) pthread_join(t[r], NULL);
}

static void test_net(void) {
    const char *why;
    uint64_t net_bases[2][2];
    for (int r = 0; r < 2; r++) {
        net_program(r);
        net_bases[r][0] = net_bases[r][1] = (uint64_t)(uintptr_t)net_data[r];
        uint64_t sizes[2] = {(uint64_t)N * 4, (uint64_t)N * 4};
        CHECK(lpn_program_parse(net_blob[r].bytes, net_blob[r].len, net_bases[r], sizes, 2, &net_prog[r], &why) == 0,
              "net program refused: %s", why);
    }
    net_node nodes[2];
    int sv[2];
    double began;

    net_pair(nodes, sv); /* both run: the sum on both */
    net_both(nodes, -1);
    CHECK(nodes[0].code == LPN_OK && nodes[1].code == LPN_OK, "allreduce codes %u %u", nodes[0].code, nodes[1].code);
    for (int i = 0; i < N; i++)
        CHECK(net_data[0][i] == 3.0f * (float)i && net_data[1][i] == 3.0f * (float)i, "sum at %d", i);
    close(sv[0]);
    close(sv[1]);

    net_pair(nodes, sv); /* another plan on node 1: the GO round sends both back, nothing written */
    nodes[1].key = 8;
    net_both(nodes, -1);
    CHECK(nodes[0].code == LPN_FALLBACK && nodes[1].code == LPN_FALLBACK, "key mismatch codes %u %u",
          nodes[0].code, nodes[1].code);
    CHECK(nodes[0].failed == 1 && net_data[0][5] == 5.0f, "a fallback reduced nothing");
    nodes[1].key = 7; /* and then the same plan, the next seq: the round's leftovers are skipped */
    nodes[0].seq = nodes[1].seq = 4;
    net_both(nodes, -1);
    CHECK(nodes[0].code == LPN_OK && nodes[1].code == LPN_OK, "after a fallback codes %u %u", nodes[0].code,
          nodes[1].code);
    close(sv[0]);
    close(sv[1]);

    net_pair(nodes, sv); /* node 1 runs seq 3 on the general path: node 0 falls back at once */
    CHECK(lpn_send_notice(sv[1], 3) == 0, "notice");
    began = lpn_now();
    net_both(nodes, 0);
    CHECK(nodes[0].code == LPN_FALLBACK && lpn_now() - began < 1.0, "notice code %u", nodes[0].code);
    CHECK(lpn_send_notice(sv[1], 3) == 0, "notice"); /* an old notice: skipped at seq 4 */
    nodes[0].seq = nodes[1].seq = 4;
    net_both(nodes, -1);
    CHECK(nodes[0].code == LPN_OK && nodes[1].code == LPN_OK, "after a notice codes %u %u", nodes[0].code,
          nodes[1].code);
    close(sv[0]);
    close(sv[1]);

    net_pair(nodes, sv); /* a peer that never runs: the deadline */
    nodes[0].timeout = 0.2;
    began = lpn_now();
    net_both(nodes, 0);
    CHECK(nodes[0].code == LPN_TIMEOUT && lpn_now() - began >= 0.19, "timeout code %u", nodes[0].code);
    close(sv[0]);
    close(sv[1]);

    net_pair(nodes, sv); /* a frozen peer (no reset, no data): an abort ends the wait at once */
    int stop[2];
    CHECK(pipe(stop) == 0, "pipe");
    nodes[0].abort_fd = stop[0];
    nodes[0].timeout = 30.0;
    pthread_t aborted;
    began = lpn_now();
    pthread_create(&aborted, NULL, net_run, &nodes[0]);
    usleep(100000);
    CHECK(write(stop[1], "x", 1) == 1, "write");
    pthread_join(aborted, NULL);
    CHECK(nodes[0].code == LPN_LOST && lpn_now() - began < 5.0, "abort code %u", nodes[0].code);
    close(stop[0]);
    close(stop[1]);
    close(sv[0]);
    close(sv[1]);

    net_pair(nodes, sv); /* a peer that is gone: at once */
    close(sv[1]);
    began = lpn_now();
    net_both(nodes, 0);
    CHECK(nodes[0].code == LPN_LOST && lpn_now() - began < 1.0, "lost code %u", nodes[0].code);
    close(sv[0]);

    net_pair(nodes, sv); /* a forged header (right key, wrong message number): a mismatch */
    wire_header forged = {7, 3, 1, (uint64_t)N * 4, 1, 0x4c504e57u};
    CHECK(write(sv[1], &forged, sizeof forged) == (ssize_t)sizeof forged, "write");
    net_both(nodes, 0);
    CHECK(nodes[0].code == LPN_MISMATCH, "forged header code %u", nodes[0].code);
    close(sv[0]);
    close(sv[1]);

    /* Misnumbered messages are refused at parse. */
    lpn_program bad;
    lpn_op *ops = (lpn_op *)(net_blob[0].bytes + sizeof(lpn_program_header) + 3 * 8) + 1; /* past the GO */
    ops[0].arg = 1;
    CHECK(lpn_program_parse(net_blob[0].bytes, net_blob[0].len, net_bases[0], (uint64_t[]){N * 4, N * 4}, 2, &bad,
                            &why) != 0,
          "a send numbered 1 first was accepted");
    ops[0].arg = 0;
    ops[1].arg = 1;
    CHECK(lpn_program_parse(net_blob[0].bytes, net_blob[0].len, net_bases[0], (uint64_t[]){N * 4, N * 4}, 2, &bad,
                            &why) != 0,
          "a receive numbered past its channel's count was accepted");
    ops[1].arg = 0;
    for (int r = 0; r < 2; r++) lpn_program_free(&net_prog[r]);
    printf("net: allreduce, another plan and a notice (fallbacks), deadline, lost peer, forged header, "
           "misnumbered messages\n");
}

/* ---- a small collective's star (net.c): its data on the GO round, two nodes.
 * scratch: [part | landing | result], N floats each. */
static lpn_program star_prog[2];

static void star_program(int r, blob *b) {
    uint64_t sizes[3] = {(uint64_t)N * 12, (uint64_t)N * 4, (uint64_t)N * 4};
    const uint64_t part = 0, landing = (uint64_t)N * 4, result = (uint64_t)N * 8, bytes = (uint64_t)N * 4;
    lpn_op root[6] = {
        {LPN_COPY, 0, 0, 0, 1, 0, part, 0, 0, bytes, 0},
        {LPN_UP_RECV, 0, 0, 0, 0, 1, 0, 0, landing, bytes, 0},
        {LPN_COPY, 0, 0, 0, 0, 0, result, part, 0, bytes, 0},
        {LPN_COMBINE, LPN_F32, LPN_SUM, 0, 0, 0, result, result, landing, N, 0},
        {LPN_DOWN_SEND, 0, 0, 0, 0, 1, 0, result, 0, bytes, 0},
        {LPN_COPY, 0, 0, 2, 0, 0, 0, result, 0, bytes, 0},
    };
    lpn_op leaf[4] = {
        {LPN_COPY, 0, 0, 0, 1, 0, part, 0, 0, bytes, 0},
        {LPN_UP_SEND, 0, 0, 0, 0, 0, 0, part, 0, bytes, 0},
        {LPN_DOWN_RECV, 0, 0, 0, 0, 0, 0, 0, result, bytes, 0},
        {LPN_COPY, 0, 0, 2, 0, 0, 0, result, 0, bytes, 0},
    };
    if (r == 0)
        program(b, 3, sizes, 6, root);
    else
        program(b, 3, sizes, 4, leaf);
}

static void *star_run(void *arg) {
    net_node *n = arg;
    uint8_t *scratch = aligned_alloc(64, ((size_t)N * 12 + 63) & ~(size_t)63);
    uint8_t *bufs[3] = {scratch, (uint8_t *)net_data[n->node], (uint8_t *)net_data[n->node]};
    n->code = lpn_program_run_net(&star_prog[n->node], bufs, n->fds, n->key, n->seq, n->timeout, -1, NULL, &n->failed);
    free(scratch);
    return NULL;
}

static void star_both(net_node *nodes) {
    pthread_t t[2];
    for (int r = 0; r < 2; r++) pthread_create(&t[r], NULL, star_run, &nodes[r]);
    for (int r = 0; r < 2; r++) pthread_join(t[r], NULL);
}

static void test_star(void) {
    const char *why;
    blob b;
    for (int r = 0; r < 2; r++) {
        star_program(r, &b);
        uint64_t bases[2] = {(uint64_t)(uintptr_t)net_data[r], (uint64_t)(uintptr_t)net_data[r]};
        uint64_t sizes[2] = {(uint64_t)N * 4, (uint64_t)N * 4};
        CHECK(lpn_program_parse(b.bytes, b.len, bases, sizes, 2, &star_prog[r], &why) == 0, "star refused: %s", why);
    }
    net_node nodes[2];
    int sv[2];
    net_pair(nodes, sv); /* both in: the sum on both */
    star_both(nodes);
    CHECK(nodes[0].code == LPN_OK && nodes[1].code == LPN_OK, "star codes %u %u", nodes[0].code, nodes[1].code);
    for (int i = 0; i < N; i++) CHECK(net_data[0][i] == 3.0f * (float)i && net_data[1][i] == 3.0f * (float)i, "star sum at %d", i);
    close(sv[0]);
    close(sv[1]);

    net_pair(nodes, sv); /* the leaf went the general way: the root answers NOTICE, nothing written */
    CHECK(lpn_send_notice(sv[1], 3) == 0, "notice");
    star_both(nodes);
    CHECK(nodes[0].code == LPN_FALLBACK && nodes[1].code == LPN_FALLBACK, "star notice codes %u %u", nodes[0].code,
          nodes[1].code);
    CHECK(net_data[0][7] == 7.0f && net_data[1][7] == 14.0f, "a star that fell back wrote");
    nodes[0].seq = nodes[1].seq = 4; /* the next call: the leaf's unread GO and part are skipped */
    star_both(nodes);
    CHECK(nodes[0].code == LPN_OK && nodes[1].code == LPN_OK, "star after a notice %u %u", nodes[0].code,
          nodes[1].code);
    close(sv[0]);
    close(sv[1]);

    /* Writing a buffer before the verdict is refused at parse. */
    star_program(1, &b);
    lpn_op *ops = (lpn_op *)(b.bytes + sizeof(lpn_program_header) + 3 * 8);
    ops[0].dst = 2; /* the first copy into the output, before DOWN_RECV */
    lpn_program bad;
    uint64_t bases[2] = {(uint64_t)(uintptr_t)net_data[1], (uint64_t)(uintptr_t)net_data[1]};
    uint64_t sizes[2] = {(uint64_t)N * 4, (uint64_t)N * 4};
    CHECK(lpn_program_parse(b.bytes, b.len, bases, sizes, 2, &bad, &why) != 0, "a star writing early was accepted");
    for (int r = 0; r < 2; r++) lpn_program_free(&star_prog[r]);
    printf("star: allreduce, a leaf's notice (fallback, nothing written, leftovers skipped), early writes refused\n");
}

/* ---- the doorbell, clients as threads */
static uint8_t page[LPN_HEADER_BYTES + P * LPN_SLOT_BYTES] __attribute__((aligned(64)));

typedef struct {
    uint32_t slot, seq, plan, gen, code;
} ringer;

static void *ring(void *arg) {
    ringer *r = arg;
    uint8_t *s = page + LPN_HEADER_BYTES + r->slot * LPN_SLOT_BYTES;
    __atomic_store_n((uint64_t *)s, lpn_ring(r->seq, r->gen, r->plan), __ATOMIC_RELEASE);
    __atomic_add_fetch((uint32_t *)(page + LPN_BELL_OFFSET), 1u, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, page + LPN_BELL_OFFSET, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
    uint32_t *reply = (uint32_t *)(s + 8);
    for (;;) {
        uint32_t seen = __atomic_load_n(reply, __ATOMIC_ACQUIRE);
        if (seen == r->seq) break;
        struct timespec ts = {1, 0};
        syscall(SYS_futex, reply, FUTEX_WAIT, seen, &ts, NULL, 0);
    }
    r->code = __atomic_load_n((uint32_t *)(s + 12), __ATOMIC_RELAXED);
    return NULL;
}

static void ring_all(ringer *rs, uint32_t n) {
    pthread_t t[P];
    for (uint32_t i = 0; i < n; i++) pthread_create(&t[i], NULL, ring, &rs[i]);
    for (uint32_t i = 0; i < n; i++) pthread_join(t[i], NULL);
}

/* ``tuned``: every program by tiles of 64 bytes on 3 threads (the engine's and a pool's). */
static void test_doorbell(int tuned) {
    lpn_engine e;
    const char *why = NULL;
    double bounds[] = {1e-5, 1e-3, 1.0};
    CHECK(lpn_engine_init(&e, page, sizeof page, P, bounds, 3, &why) == 0, "init: %s", why);
    CHECK(lpn_engine_start(&e) == 0, "start");
    CHECK(lpn_engine_tune(&e, 100, 0, 3, 0, &why) != 0, "a tile of 100 bytes accepted");
    if (tuned) CHECK(lpn_engine_tune(&e, 1024, 0, 3, 0, &why) == 0, "tune: %s", why);
    blob b;
    allreduce_program(&b, LPN_SUM, LPN_F32, 4);
    set_bases();
    long gen = lpn_engine_arm(&e, 3, b.bytes, b.len, bases, real_sizes, 2 * P, 5.0, 0, &why);
    CHECK(gen > 0, "arm: %s", why);
    uint64_t tile, scratch;
    uint32_t threads;
    int stream;
    lpn_engine_shape(&e, 3, &tile, &threads, &scratch, &stream);
    if (tuned) { /* 4 tiles of 1 KiB (streamed copies) on 3 threads, each its own tile of the scratch */
        CHECK(tile == 1024 && threads == 3 && scratch == 3 * 1024 && stream,
              "tuned shape: tile %llu, %u threads, scratch %llu, stream %d", (unsigned long long)tile, threads,
              (unsigned long long)scratch, stream);
    } else { /* 4000 bytes: below LPN_PARALLEL, one tile; the whole scratch (it is smaller than a tile) */
        CHECK(tile == LPN_TILE && threads == 1 && scratch == 4032 && !stream,
              "default shape: tile %llu, %u threads, scratch %llu, stream %d", (unsigned long long)tile, threads,
              (unsigned long long)scratch, stream);
    }
    CHECK(lpn_engine_tune(&e, 128, 0, 2, 0, &why) != 0, "tuned again once a plan is armed");
    ringer rs[P];
    for (uint32_t seq = 1; seq <= 200; seq++) { /* armed runs */
        fill();
        for (uint32_t i = 0; i < P; i++) rs[i] = (ringer){i, seq, 3, (uint32_t)gen, 99};
        ring_all(rs, P);
        for (uint32_t i = 0; i < P; i++) CHECK(rs[i].code == LPN_OK, "seq %u slot %u: code %u", seq, i, rs[i].code);
        check_sum("armed");
    }
    CHECK(e.plans[3].calls == 200, "calls %llu", (unsigned long long)e.plans[3].calls);
    /* Another generation: every ring falls back. */
    for (uint32_t i = 0; i < P; i++) rs[i] = (ringer){i, 201, 3, (uint32_t)gen + 1, 99};
    ring_all(rs, P);
    for (uint32_t i = 0; i < P; i++) CHECK(rs[i].code == LPN_FALLBACK, "stale generation answered %u", rs[i].code);
    /* A yielded sequence number falls back at once. */
    lpn_engine_yield(&e, 202);
    for (uint32_t i = 0; i < P; i++) rs[i] = (ringer){i, 202, 3, (uint32_t)gen, 99};
    ring_all(rs, P);
    for (uint32_t i = 0; i < P; i++) CHECK(rs[i].code == LPN_FALLBACK, "yielded seq answered %u", rs[i].code);
    /* One slot rings and the others never do: it falls back at the plan's deadline. */
    gen = lpn_engine_arm(&e, 3, b.bytes, b.len, bases, real_sizes, 2 * P, 0.2, 0, &why);
    rs[0] = (ringer){0, 203, 3, (uint32_t)gen, 99};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    ring_all(rs, 1);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double took = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    CHECK(rs[0].code == LPN_FALLBACK && took >= 0.19 && took < 2.0, "deadline: code %u after %.3f s", rs[0].code, took);
    /* The others arrive late for that sequence number: they fall back at once. */
    for (uint32_t i = 1; i < P; i++) rs[i - 1] = (ringer){i, 203, 3, (uint32_t)gen, 99};
    ring_all(rs, P - 1);
    for (uint32_t i = 0; i < P - 1; i++) CHECK(rs[i].code == LPN_FALLBACK, "late ring answered %u", rs[i].code);
    /* A disarm while one waits: it falls back. */
    gen = lpn_engine_arm(&e, 3, b.bytes, b.len, bases, real_sizes, 2 * P, 30.0, 0, &why);
    rs[0] = (ringer){0, 204, 3, (uint32_t)gen, 99};
    pthread_t waiter;
    pthread_create(&waiter, NULL, ring, &rs[0]);
    usleep(50000);
    lpn_engine_disarm(&e, 3);
    pthread_join(waiter, NULL);
    CHECK(rs[0].code == LPN_FALLBACK, "disarmed ring answered %u", rs[0].code);
    /* A stop while one waits: it falls back, the thread ends. */
    gen = lpn_engine_arm(&e, 5, b.bytes, b.len, bases, real_sizes, 2 * P, 30.0, 0, &why);
    rs[0] = (ringer){0, 205, 5, (uint32_t)gen, 99};
    pthread_create(&waiter, NULL, ring, &rs[0]);
    usleep(50000);
    lpn_engine_destroy(&e);
    pthread_join(waiter, NULL);
    CHECK(rs[0].code == LPN_FALLBACK, "ring at stop answered %u", rs[0].code);
}

int main(int argc, char **argv) {
    unsigned rounds = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 10) : 200000;
    test_programs();
    test_min_max();
    test_tiles();
    test_parser(rounds, 0);
    test_parser(rounds / 2, 1);
    test_net();
    test_star();
    test_doorbell(0);
    test_doorbell(1);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("engine_test: all checks passed\n");
    return 0;
}
