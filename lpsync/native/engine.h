/* The native steady-state engine of lpsync: armed plans run without Python.
 *
 * Policy stays in Python (the modules of lpsync/native): it compiles a plan that ran once on the
 * general path into a flat program (copy / combine / divide over byte ranges of the
 * plan's buffers) and arms it here. This file executes programs and serves the
 * clients' doorbells; it never plans. Every access a program makes is checked against
 * the buffers it was armed with, once, when it is parsed (lpn_program_parse).
 *
 * The doorbell page (shared memory, mapped by the daemon and by each client of the job):
 *   [0, 64)            header: magic, version, slots
 *   [64, 68)           bell: a futex word the engine sleeps on; a client bumps it and
 *                      wakes it after ringing
 *   [128 + 64*i, ...)  slot i (the job's local rank i):
 *                        +0  u64 ring   client -> engine: seq << 32 | gen << 8 | plan
 *                        +8  u32 reply  engine -> client: the seq answered (futex word)
 *                        +12 u32 code   engine -> client: LPN_OK or LPN_FALLBACK
 * The layout is the client's wire contract too (lpsync_client/doorbell.py); a test
 * checks the two agree.
 */
#ifndef LPSYNC_NATIVE_ENGINE_H
#define LPSYNC_NATIVE_ENGINE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define LPN_MAGIC 0x4c50444eu /* "NDPL" little-endian: the page */
#define LPN_PROGRAM_MAGIC 0x504e504cu
#define LPN_VERSION 1u
#define LPN_HEADER_BYTES 128u
#define LPN_BELL_OFFSET 64u
#define LPN_SLOT_BYTES 64u
#define LPN_MAX_SLOTS 256u
#define LPN_MAX_PLANS 256u /* a ring names its plan in 8 bits (doorbell.py) */
#define LPN_MAX_BUFFERS 1024u
#define LPN_MAX_OPS 65536u
#define LPN_BUCKETS 32u

#define LPN_MAX_CHANNELS 64u

/* A run's result: the doorbell's reply code, and lpn_engine_run's. */
#define LPN_OK 0u
#define LPN_FALLBACK 1u
#define LPN_TIMEOUT 2u  /* a message or a send did not complete by the plan's timeout */
#define LPN_LOST 3u     /* a channel closed, failed, or was never connected */
#define LPN_MISMATCH 4u /* a message's header is not the one the plan expects next */

/* Kinds 1-3 work on memory; 4-6 move messages over channels (net.c): a node's part of a
 * collective across nodes. SEND: a/a_off, n bytes, to channel b. RECV: n bytes from
 * channel b, landed in the scratch at b_off, then copied to dst/dst_off. RECV_COMBINE:
 * n elements landed at b_off, dst = a (op) landed. Each channel's messages are numbered
 * in the order they are sent (``arg``); every message carries a header (net.c) with the
 * plan's key, the run's sequence number and that number, checked on arrival.
 * GO (channel b) ops open a program: the GO round, a tree rooted at the job's node 0
 * (a = 1: this node is the root, a GO op per other node; a = 0: one GO op, to the root).
 * Every node says GO (key, seq) to the root before anything is written, and the root
 * answers each: GO when all did, for this plan and seq, NOTICE otherwise. A node whose
 * ranks took the general path for this seq sends NOTICE instead (lpn_engine_notice: to
 * the root; the root to every node); a NOTICE verdict makes the run LPN_FALLBACK with
 * nothing written, so the collective runs on the general path on every node, which says
 * what differs.
 * UP_* and DOWN_* (channel b) are a small collective's GO round with its data on it (a
 * star, as small ones ride the agreement on the general path): a node's UP_SEND is its GO
 * and its part (a/a_off, n bytes) to the root, which lands it at b_off (UP_RECV); the
 * root's DOWN_SEND is its verdict and the result, landed at b_off (DOWN_RECV). A NOTICE or
 * another plan at an UP_RECV makes the root answer NOTICE to every DOWN_SEND channel. Such
 * a program has no GO ops, and writes nothing but its scratch before its last receive. */
enum lpn_kind {
    LPN_COPY = 1, LPN_COMBINE = 2, LPN_DIVIDE = 3, LPN_SEND = 4, LPN_RECV = 5, LPN_RECV_COMBINE = 6,
    LPN_GO = 7, LPN_UP_SEND = 8, LPN_UP_RECV = 9, LPN_DOWN_SEND = 10, LPN_DOWN_RECV = 11
};
enum lpn_dtype {
    LPN_F16 = 1, LPN_BF16, LPN_F32, LPN_F64, LPN_I8, LPN_I32, LPN_I64, LPN_U8, LPN_DTYPE_END
};
enum lpn_redop { LPN_SUM = 1, LPN_PROD, LPN_MIN, LPN_MAX, LPN_REDOP_END };

/* One instruction; COPY, SEND and RECV count bytes, the others elements. ``arg``: DIVIDE's
 * divisor; a net op's message number on its channel (sends: 0, 1, ... in program order;
 * receives: the order the peer sends them in, which may differ from theirs). */
typedef struct {
    uint32_t kind, dtype, redop, dst, a, b;
    uint64_t dst_off, a_off, b_off, n, arg;
} lpn_op;

/* The encoded form Python writes (lpsync/native/program.py): a header, then nbuf u64
 * buffer sizes (buffer 0 is the plan's scratch, owned by the engine), then the ops. */
typedef struct {
    uint32_t magic, version, nbuf, nops;
} lpn_program_header;

typedef struct {
    lpn_op *ops;
    uint32_t nops, nbuf;
    uint64_t *sizes; /* of every buffer */
    /* Net ops, indexed at parse time: per op its message number on its channel; per
     * channel the op indices of its sends (tx) and receives (rx) by message number:
     * tx[tx_start[c] .. tx_start[c+1]). */
    int net, star; /* has messages; they are a star's UP and DOWN (no schedule's) */
    uint32_t *msg, *tx, *rx;
    uint32_t tx_start[LPN_MAX_CHANNELS + 1], rx_start[LPN_MAX_CHANNELS + 1];
    /* A program without messages whose ops may run tile by tile (lpn_program_run_tiles):
     * wherever an op writes bytes that another op (or itself) reads or writes, both
     * access them at the same position relative to their own range's start, so tile t
     * (bytes [t*tile, (t+1)*tile) of every op's range) never needs another tile's
     * result. Decided at parse, from the real addresses (in place, inputs are outputs). */
    int tiled;
    uint64_t span; /* the longest op's bytes: the tiles cover [0, span) */
    /* A tiled program whose every range of the scratch is written and read at one start
     * (each such range a slot) needs only ``slots`` tiles of scratch per thread: slot[3i +
     * k] is the slot of op i's dst, a, b (k = 0, 1, 2) where that is the scratch. 0: the
     * whole scratch (slot NULL). */
    uint32_t slots;
    uint32_t *slot;
} lpn_program;

/* Parse and check ``len`` bytes; 0 on success, else -1 with ``why`` set. The buffers are
 * the real ones, ``bases`` and ``sizes`` (nbuf-1 of them: buffer 0 is the scratch, which
 * the engine allocates, aligned, at the program's size, at most LPN_MAX_SCRATCH): the
 * program must declare exactly their sizes, and every op's ranges must lie inside them
 * and be aligned to its element size. */
#define LPN_MAX_SCRATCH ((uint64_t)1 << 32)
int lpn_program_parse(const uint8_t *data, size_t len, const uint64_t *bases, const uint64_t *sizes,
                      uint32_t nbases, lpn_program *out, const char **why);
void lpn_program_free(lpn_program *program);
/* Worker threads that share a tiled program's tiles with the thread that runs it; idle,
 * they sleep on a condition variable (a bounded wait, re-armed each second). */
typedef struct lpn_pool lpn_pool;
/* ``workers`` threads besides the caller of each run; NULL where none could start. */
lpn_pool *lpn_pool_create(uint32_t workers);
void lpn_pool_destroy(lpn_pool *pool); /* joins its threads; NULL: nothing */
uint32_t lpn_pool_workers(const lpn_pool *pool);
/* Run a parsed program without net ops over ``bufs`` (nbuf pointers, bufs[0] the scratch):
 * op by op. */
void lpn_program_run(const lpn_program *program, uint8_t *const *bufs);
/* The same, tile by tile where the program is ``tiled`` (else op by op): every op of tile
 * t before tile t+1, so what one op leaves in a tile of the scratch is still in the cache
 * when the next reads it. ``tile``: bytes, a multiple of 64 (0: op by op); ``pool``
 * (NULL: none) takes tiles too, each tile whole on one thread. ``local`` (NULL: bufs[0],
 * the whole scratch): lpn_program_tile_scratch bytes per thread (the caller's and each
 * worker's), where each keeps its tile's slots of the scratch. ``stream``: copies into
 * the participants' buffers bypass the cache (fenced before it returns). The bytes
 * written to every buffer but the scratch are lpn_program_run's. */
void lpn_program_run_tiles(const lpn_program *program, uint8_t *const *bufs, uint64_t tile, lpn_pool *pool,
                           uint8_t *local, int stream);
/* A thread's tiles of the scratch for ``tile`` (0: it needs the whole scratch). With a
 * pool, ``local`` holds one such area per thread that may take tiles: its workers + 1. */
uint64_t lpn_program_tile_scratch(const lpn_program *program, uint64_t tile);
/* Run any parsed program: net ops over ``fds`` (LPN_MAX_CHANNELS, -1 where none), their
 * headers carrying ``key`` and ``seq``; every wait bounded by ``timeout`` seconds from
 * now, and by ``abort_fd`` (-1: none) becoming readable (LPN_LOST). ``lowat``: each
 * channel's SO_RCVLOWAT as last set (the engine keeps it; NULL: not tuned). LPN_OK, or
 * LPN_TIMEOUT / LPN_LOST / LPN_MISMATCH (net.c); ``failed`` is then the channel that
 * failed (-1: none in particular). */
uint32_t lpn_program_run_net(const lpn_program *program, uint8_t *const *bufs, const int *fds,
                             uint64_t key, uint32_t seq, double timeout, int abort_fd, int *lowat,
                             int *failed);
/* The element operations the two runners share (kernels.c). */
void lpn_combine(uint8_t *d, const uint8_t *a, const uint8_t *b, uint32_t dtype, uint64_t n, uint32_t op);
void lpn_divide(uint8_t *p, uint32_t dtype, uint64_t n, uint64_t by);
uint32_t lpn_itemsize(uint32_t dtype);
double lpn_now(void);

typedef struct {
    int armed;
    uint32_t gen;       /* 24 bits: bumped by every disarm */
    double timeout;     /* seconds: the clients' timeout for this plan */
    uint64_t key;       /* net plans: the plan's identity in every message header */
    uint32_t last_code; /* the last run's result (LPN_OK ...) */
    lpn_program program;
    uint8_t **bufs;     /* nbuf: bufs[0] the scratch (``local``: threads x its tiles of it) */
    uint64_t tile, scratch; /* how it runs (0: op by op); the scratch's bytes */
    uint32_t threads;
    int local, stream;
    /* Metrics, read by Python at a scrape: calls, seconds, a histogram over ``bounds``. */
    uint64_t calls;
    double seconds;
    uint64_t buckets[LPN_BUCKETS + 1];
} lpn_plan;

/* The last collectives the engine answered, for the flight recorder. */
#define LPN_RECORDS 64u
typedef struct {
    uint32_t seq, plan, code, pad;
    double first_arrival, last_arrival, done; /* CLOCK_MONOTONIC seconds */
} lpn_record;

typedef struct {
    uint8_t *page;
    uint32_t slots;
    pthread_mutex_t mu; /* guards everything below; held while a program runs */
    pthread_t thread;
    int started, stopping;
    uint32_t abandoned;  /* every seq <= this (serial order) runs on the general path; atomic */
    uint32_t served[LPN_MAX_SLOTS]; /* the last seq answered per slot */
    double first_seen[LPN_MAX_SLOTS];
    lpn_plan plans[LPN_MAX_PLANS];
    double bounds[LPN_BUCKETS];
    uint32_t nbounds;
    lpn_record records[LPN_RECORDS];
    uint64_t nrecords; /* ever written; records[i % LPN_RECORDS] */
    uint64_t fallbacks;
    int fds[LPN_MAX_CHANNELS]; /* the engine's own (dup'ed) sockets; -1: none */
    uint8_t active[LPN_MAX_SLOTS]; /* slots of this node's ranks (others ring elsewhere) */
    uint32_t nactive;
    int failed_channel;        /* of the last failed net run, -1: none */
    int abort_fd;              /* an eventfd: lpn_engine_abort wakes a net run's waits */
    int lowat[LPN_MAX_CHANNELS]; /* each channel's SO_RCVLOWAT as net.c last set it */
    /* How local programs run (lpn_engine_tune): tile by tile where ``tiled``, and over
     * ``threads`` threads (the engine's and a pool's) from ``parallel`` bytes on. */
    uint64_t tile, parallel, stream;
    uint32_t threads;
    int armed_once;
    lpn_pool *pool; /* made at the first plan armed that uses it; NULL: none (yet) */
} lpn_engine;

int lpn_engine_init(lpn_engine *e, uint8_t *page, size_t page_len, uint32_t slots,
                    const double *bounds, uint32_t nbounds, const char **why);
int lpn_engine_start(lpn_engine *e); /* the doorbell thread */
/* Defaults (docs/architecture.md, "The native steady-state path"): tiles of LPN_TILE
 * bytes (64-256 KiB measured alike); programs whose longest op has LPN_PARALLEL bytes or
 * more run on min(CPUs, this node's participants) threads. That threshold is not a
 * measured crossover: on the 2 shared cores measured, a second thread was neutral at
 * 1-16 MiB (memory-bound) and faster at 64 MiB; from 1 MiB a run (>= 0.3 ms) pays for
 * waking the workers, and where one core cannot draw the memory's bandwidth alone
 * (servers) the threads pay from there. */
#define LPN_TILE ((uint64_t)128 * 1024)
#define LPN_PARALLEL ((uint64_t)1 << 20)
/* ... and from LPN_STREAM bytes on copy into the participants' buffers with streaming
 * stores (measured 1.3-2x on one core at 4-64 MiB: no read of each line before it is
 * written; such outputs would not stay in the cache anyway). */
#define LPN_STREAM ((uint64_t)4 << 20)
/* Before the first arm: ``tile`` bytes (a multiple of 64; 0: op by op), programs of
 * ``parallel`` bytes or more on ``threads`` threads in all (0: min(CPUs, participants);
 * 1: the engine's thread alone), streaming stores from ``stream`` bytes. 0, or -1 with
 * ``why``. Tests set small ones so that small programs take those paths. */
int lpn_engine_tune(lpn_engine *e, uint64_t tile, uint64_t parallel, uint32_t threads, uint64_t stream,
                    const char **why);
/* How plan ``index`` runs: its tile (0: op by op), its threads (0: not armed), the
 * bytes of its scratch and whether it streams. */
void lpn_engine_shape(lpn_engine *e, uint32_t index, uint64_t *tile, uint32_t *threads, uint64_t *scratch,
                      int *stream);
void lpn_engine_stop(lpn_engine *e); /* every pending ring falls back; joins the thread */
void lpn_engine_destroy(lpn_engine *e);
/* Arm plan ``index`` (disarming what it held); returns the generation clients ring with,
 * or -1 with ``why``. ``data`` is the encoded program, ``bases`` and ``sizes`` its buffers
 * but the scratch. */
long lpn_engine_arm(lpn_engine *e, uint32_t index, const uint8_t *data, size_t len,
                    const uint64_t *bases, const uint64_t *sizes, uint32_t nbases, double timeout,
                    uint64_t key, const char **why);
/* Channel ``chan`` becomes a duplicate of the connected stream socket ``fd`` (made
 * non-blocking), replacing what it was; fd -1 closes it. 0, or -1 with ``why``. A net
 * run that fails closes every channel its plan uses: their streams are mid-message. */
int lpn_engine_connect(lpn_engine *e, uint32_t chan, int fd, const char **why);
/* This node runs ``seq`` on the general path: a NOTICE on channel ``chan`` (the root's;
 * -1: every channel, from the root), so that armed peers fall back at once (their GO
 * round) instead of waiting. */
void lpn_engine_notice(lpn_engine *e, uint32_t seq, int chan);
/* Close every channel and disarm every plan with messages (a failed collective). */
void lpn_engine_drop_net(lpn_engine *e);
/* The peers are lost (the mesh broke): a net run waiting now ends LPN_LOST at once, as
 * does any until lpn_engine_drop_net. Never blocks (no lock). */
void lpn_engine_abort(lpn_engine *e);
/* Which slots are this node's ranks (``n`` = slots flags); all, until called. */
int lpn_engine_activate(lpn_engine *e, const uint8_t *active, uint32_t n, const char **why);
/* Write a NOTICE header for ``seq`` to a connected socket without blocking (net.c). */
int lpn_send_notice(int fd, uint32_t seq);
void lpn_engine_disarm(lpn_engine *e, uint32_t index);
/* A rank arrived for ``seq`` on the general path: rings of it fall back. Never blocks. */
void lpn_engine_yield(lpn_engine *e, uint32_t seq);
/* Run plan ``index`` once for a general-path collective (under the engine's lock), its
 * messages numbered ``seq``: LPN_OK or a failure code; LPN_FALLBACK where the plan is not
 * armed at ``gen``. */
uint32_t lpn_engine_run(lpn_engine *e, uint32_t index, uint32_t gen, uint32_t seq);

/* The ring word a client writes. */
static inline uint64_t lpn_ring(uint32_t seq, uint32_t gen, uint32_t plan) {
    return ((uint64_t)seq << 32) | ((uint64_t)(gen & 0xffffffu) << 8) | (plan & 0xffu);
}

#endif
