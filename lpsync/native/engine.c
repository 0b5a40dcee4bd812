/* The native engine's doorbell: the thread that waits for a plan's rings, runs it
 * (program.c, or net.c across nodes) and answers every rank (engine.h). */
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- the doorbell */

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
