/* Programs (engine.h): the parser that checks every op against its buffers, the tile
 * runner and its worker threads, and the op-by-op run. A program with net ops runs in
 * net.c; the doorbell that starts runs is engine.c's. */
#include "engine.h"

#include <errno.h>
#include <sched.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
    uint64_t item = lpn_itemsize(o->dtype);
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
static uint64_t op_bytes(const lpn_op *o) { return o->kind == LPN_COPY ? o->n : o->n * lpn_itemsize(o->dtype); }

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
        uint64_t len = bytes - lo < tile ? bytes - lo : tile, item = o->kind == LPN_COPY ? 1 : lpn_itemsize(o->dtype);
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
        item = lpn_itemsize(o->dtype);
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
