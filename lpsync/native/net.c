/* A program's net ops (engine.h): a node's part of a collective across nodes, over the
 * connected stream sockets the daemon handed the engine (one per peer node: a channel).
 *
 * Each channel carries its messages in program order, both ways, so a message is known
 * by its number on the channel; each is a 32-byte header and its bytes. The header
 * carries the plan's key (a hash of the job and the collective's spec), the run's
 * sequence number and the message's number: anything else on arrival is a mismatch, and
 * the run fails with LPN_MISMATCH instead of reducing someone else's data.
 *
 * A run opens with a GO round (engine.h), a tree rooted at the job's node 0: each other
 * node says GO to it and reads its verdict, GO when every node said GO for this plan and
 * seq, NOTICE otherwise (older GOs and NOTICEs, left from runs that fell back, are
 * skipped). Only a GO verdict lets the run write anything. Control headers travel between
 * the root and the others only, so a data channel carries nothing but this run's data.
 *
 * Sends never block: a SEND queues its message and writes what the socket takes; the
 * rest is written whenever the run waits. Receives land in the plan's scratch (each
 * message its own range, laid out by the compiler) as soon as they arrive, whatever op
 * the run is at: so a peer's sends always progress, and two nodes sending to each other
 * at once never wait on each other. An op that writes memory a queued send still reads
 * waits for that send first. Every wait is one poll() over the channels with work left,
 * bounded by the run's deadline: nothing spins.
 */
#include "engine.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#define WIRE_MAGIC 0x4c504e57u /* "WNPL" */
#define WIRE_DATA 1u
#define WIRE_GO 2u     /* this node runs the plan ``key`` for ``seq`` (no bytes) */
#define WIRE_NOTICE 3u /* this node runs ``seq`` on the general path (no bytes) */

typedef struct {
    uint64_t key;
    uint32_t seq, msg;
    uint64_t nbytes;
    uint32_t kind, magic;
} wire_header;

_Static_assert(sizeof(wire_header) == 32, "the header is 32 bytes on the wire");

typedef struct {
    const lpn_program *p;
    uint8_t *const *bufs;
    const int *fds;
    uint64_t key;
    uint32_t seq;
    double deadline;
    int abort_fd; /* readable: stop now (lpn_engine_abort); -1: none */
    int *lowat;   /* per channel, the socket's SO_RCVLOWAT now (the engine's); NULL: left alone */
    int failed;
    /* Per channel: sends queued (tx_tail) and written (tx_head; tx_done bytes of the one
     * being written, header included); receives landed (rx_next; rx_done bytes of the
     * next one, header included, its header gathered in rx_hdr). */
    uint32_t tx_head[LPN_MAX_CHANNELS], tx_tail[LPN_MAX_CHANNELS], rx_next[LPN_MAX_CHANNELS];
    uint64_t tx_done[LPN_MAX_CHANNELS], rx_done[LPN_MAX_CHANNELS];
    wire_header rx_hdr[LPN_MAX_CHANNELS];
} run_state;

static uint64_t op_bytes(const lpn_op *o) {
    return o->kind == LPN_RECV_COMBINE ? o->n * lpn_itemsize(o->dtype) : o->n;
}

static uint32_t fail(run_state *r, int chan, uint32_t code) {
    r->failed = chan;
    return code;
}

/* Write what channel c's socket takes of its queued sends. */
static uint32_t write_some(run_state *r, uint32_t c) {
    const lpn_program *p = r->p;
    while (r->tx_head[c] < r->tx_tail[c]) {
        uint32_t index = p->tx[p->tx_start[c] + r->tx_head[c]];
        const lpn_op *o = &p->ops[index];
        wire_header h = {r->key, r->seq, p->msg[index], o->n, WIRE_DATA, WIRE_MAGIC};
        uint64_t done = r->tx_done[c], total = sizeof h + o->n;
        struct iovec iov[2];
        int n = 0;
        if (done < sizeof h) iov[n++] = (struct iovec){(uint8_t *)&h + done, sizeof h - done};
        uint64_t from = done < sizeof h ? 0 : done - sizeof h;
        if (o->n > from) iov[n++] = (struct iovec){r->bufs[o->a] + o->a_off + from, o->n - from};
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t wrote = sendmsg(r->fds[c], &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (wrote < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return LPN_OK;
            if (errno == EINTR) continue;
            return fail(r, (int)c, LPN_LOST);
        }
        r->tx_done[c] += (uint64_t)wrote;
        if (r->tx_done[c] == total) {
            r->tx_head[c]++;
            r->tx_done[c] = 0;
        }
    }
    return LPN_OK;
}

/* Land what channel c's socket holds of the run's next messages, checking each header. */
static uint32_t read_some(run_state *r, uint32_t c) {
    const lpn_program *p = r->p;
    uint32_t count = p->rx_start[c + 1] - p->rx_start[c];
    while (r->rx_next[c] < count) {
        const lpn_op *o = &p->ops[p->rx[p->rx_start[c] + r->rx_next[c]]];
        uint64_t nbytes = op_bytes(o), done = r->rx_done[c];
        wire_header *h = &r->rx_hdr[c];
        struct iovec iov[2];
        int n = 0;
        /* The header and the bytes the program expects in one call; a message that is not
         * the expected one fails the run once its header is in, whatever landed. */
        if (done < sizeof *h) iov[n++] = (struct iovec){(uint8_t *)h + done, sizeof *h - done};
        uint64_t from = done < sizeof *h ? 0 : done - sizeof *h;
        if (nbytes > from) iov[n++] = (struct iovec){r->bufs[0] + o->b_off + from, nbytes - from};
        ssize_t got = readv(r->fds[c], iov, n);
        if (got == 0) return fail(r, (int)c, LPN_LOST);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return LPN_OK;
            if (errno == EINTR) continue;
            return fail(r, (int)c, LPN_LOST);
        }
        r->rx_done[c] += (uint64_t)got;
        if (done < sizeof *h && r->rx_done[c] >= sizeof *h) {
            if (h->magic != WIRE_MAGIC || h->kind != WIRE_DATA || h->key != r->key || h->seq != r->seq ||
                h->msg != r->rx_next[c] || h->nbytes != nbytes)
                return fail(r, (int)c, LPN_MISMATCH);
        }
        if (r->rx_done[c] == sizeof *h + nbytes) {
            r->rx_next[c]++;
            r->rx_done[c] = 0;
        }
    }
    return LPN_OK;
}

/* Serial-number order of 32-bit sequence numbers (they wrap). */
static int seq_lt(uint32_t a, uint32_t b) { return (int32_t)(a - b) < 0; }

/* Write a whole header, waiting (bounded by ``deadline``) while the socket is full. */
static int write_header(int fd, const wire_header *h, double deadline) {
    size_t done = 0;
    while (done < sizeof *h) {
        ssize_t n = send(fd, (const uint8_t *)h + done, sizeof *h - done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            done += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
        double left = deadline - lpn_now();
        if (left <= 0) return -2;
        struct pollfd p = {fd, POLLOUT, 0};
        struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
        if (ppoll(&p, 1, &ts, NULL) < 0 && errno != EINTR) return -1;
    }
    return 0;
}

/* A control header and its payload (a star's part or result), whole, bounded by the
 * run's deadline. */
static uint32_t send_message(run_state *r, uint32_t c, uint32_t kind, const uint8_t *payload, uint64_t n) {
    int fd = r->fds[c];
    if (fd < 0) return fail(r, (int)c, LPN_LOST);
    wire_header h = {r->key, r->seq, 0, n, kind, WIRE_MAGIC};
    uint64_t done = 0, total = sizeof h + n;
    while (done < total) {
        struct iovec iov[2];
        int k = 0;
        if (done < sizeof h) iov[k++] = (struct iovec){(uint8_t *)&h + done, sizeof h - done};
        uint64_t from = done < sizeof h ? 0 : done - sizeof h;
        if (n > from) iov[k++] = (struct iovec){(uint8_t *)(uintptr_t)(payload + from), n - from};
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)k};
        ssize_t wrote = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (wrote > 0) {
            done += (uint64_t)wrote;
            continue;
        }
        if (wrote < 0 && errno == EINTR) continue;
        if (wrote < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return fail(r, (int)c, LPN_LOST);
        double left = r->deadline - lpn_now();
        if (left <= 0) return fail(r, (int)c, LPN_TIMEOUT);
        struct pollfd pf = {fd, POLLOUT, 0};
        struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
        if (ppoll(&pf, 1, &ts, NULL) < 0 && errno != EINTR) return fail(r, (int)c, LPN_LOST);
    }
    return LPN_OK;
}

int lpn_send_notice(int fd, uint32_t seq) {
    wire_header h = {0, seq, 0, 0, WIRE_NOTICE, WIRE_MAGIC};
    return write_header(fd, &h, lpn_now() + 0.5) == 0 ? 0 : -1;
}

/* Channel c's SO_RCVLOWAT (the bytes a poll waits for), set where it differs. */
static void set_lowat(run_state *r, uint32_t c, int want) {
    if (r->lowat && want != r->lowat[c] && setsockopt(r->fds[c], SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want) == 0)
        r->lowat[c] = want;
}

/* Read exactly n bytes from channel c into dst (NULL: discard them), bounded by the
 * run's deadline and its abort. */
static uint32_t read_bytes(run_state *r, uint32_t c, uint8_t *dst, uint64_t n) {
    int fd = r->fds[c];
    set_lowat(r, c, 1); /* a control message's reader waits for any byte */
    uint8_t sink[4096];
    uint64_t done = 0;
    while (done < n) {
        uint64_t want = n - done;
        if (!dst && want > sizeof sink) want = sizeof sink;
        ssize_t got = recv(fd, dst ? dst + done : sink, (size_t)want, MSG_DONTWAIT);
        if (got == 0) return fail(r, (int)c, LPN_LOST);
        if (got > 0) {
            done += (uint64_t)got;
            continue;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return fail(r, (int)c, LPN_LOST);
        double left = r->deadline - lpn_now();
        if (left <= 0) return fail(r, (int)c, LPN_TIMEOUT);
        struct pollfd pf[2] = {{fd, POLLIN, 0}, {r->abort_fd, POLLIN, 0}};
        struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
        if (ppoll(pf, r->abort_fd >= 0 ? 2 : 1, &ts, NULL) < 0 && errno != EINTR) return fail(r, (int)c, LPN_LOST);
        if (r->abort_fd >= 0 && (pf[1].revents & POLLIN)) return fail(r, -1, LPN_LOST);
    }
    return LPN_OK;
}

static uint32_t skip_bytes(run_state *r, uint32_t c, uint64_t n) {
    if (n > LPN_MAX_SCRATCH) return fail(r, (int)c, LPN_MISMATCH);
    return read_bytes(r, c, NULL, n);
}

/* Read the next control header (GO or NOTICE) of this run from channel c, skipping
 * older ones (left by runs that fell back). LPN_OK with *h filled, or a failure code. */
static uint32_t read_control(run_state *r, uint32_t c, wire_header *h, uint64_t payload) {
    int fd = r->fds[c];
    if (fd < 0) return fail(r, (int)c, LPN_LOST);
    set_lowat(r, c, 1);
    for (;;) {
        size_t done = 0;
        while (done < sizeof *h) {
            ssize_t n = recv(fd, (uint8_t *)h + done, sizeof *h - done, MSG_DONTWAIT);
            if (n == 0) return fail(r, (int)c, LPN_LOST);
            if (n > 0) {
                done += (size_t)n;
                continue;
            }
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) return fail(r, (int)c, LPN_LOST);
            double left = r->deadline - lpn_now();
            if (left <= 0) return fail(r, (int)c, LPN_TIMEOUT);
            struct pollfd pf[2] = {{fd, POLLIN, 0}, {r->abort_fd, POLLIN, 0}};
            struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
            if (ppoll(pf, r->abort_fd >= 0 ? 2 : 1, &ts, NULL) < 0 && errno != EINTR)
                return fail(r, (int)c, LPN_LOST);
            if (r->abort_fd >= 0 && (pf[1].revents & POLLIN)) return fail(r, -1, LPN_LOST);
        }
        if (h->magic != WIRE_MAGIC || (h->kind != WIRE_GO && h->kind != WIRE_NOTICE))
            return fail(r, (int)c, LPN_MISMATCH);
        if (seq_lt(h->seq, r->seq)) { /* left from a run that fell back: its bytes too */
            uint32_t code = skip_bytes(r, c, h->nbytes);
            if (code != LPN_OK) return code;
            continue;
        }
        if (h->kind == WIRE_GO && h->key != r->key) { /* another plan: its bytes are not ours */
            uint32_t code = skip_bytes(r, c, h->nbytes);
            if (code != LPN_OK) return code;
            h->nbytes = 0;
            return LPN_OK;
        }
        if (h->nbytes != (h->kind == WIRE_GO ? payload : 0)) return fail(r, (int)c, LPN_MISMATCH);
        if (h->seq != r->seq) return fail(r, (int)c, LPN_MISMATCH);
        return LPN_OK;
    }
}

/* Whether a control header says: run this plan for this seq. */
static int says_go(const run_state *r, const wire_header *h) { return h->kind == WIRE_GO && h->key == r->key; }

/* The GO round, a tree rooted at the job's node 0 (GO ops with a = 1: this node is the
 * root; a leaf has one GO op, to the root). A leaf says GO to the root and reads its
 * verdict; the root reads every leaf's GO, then answers each GO when all said GO for this
 * plan, NOTICE otherwise. LPN_OK when the verdict is GO, LPN_FALLBACK otherwise. */
static uint32_t go_round(run_state *r, uint32_t ngo) {
    const lpn_program *p = r->p;
    wire_header mine = {r->key, r->seq, 0, 0, WIRE_GO, WIRE_MAGIC}, h;
    uint32_t i, code;
    if (ngo == 0) return LPN_OK;
    if (!p->ops[0].a) { /* a leaf */
        uint32_t root = p->ops[0].b;
        if (r->fds[root] < 0) return fail(r, (int)root, LPN_LOST);
        int w = write_header(r->fds[root], &mine, r->deadline);
        if (w != 0) return fail(r, (int)root, w == -2 ? LPN_TIMEOUT : LPN_LOST);
        if ((code = read_control(r, root, &h, 0)) != LPN_OK) return code;
        if (says_go(r, &h)) return LPN_OK;
        r->failed = (int)root;
        return LPN_FALLBACK;
    }
    int go = 1;
    for (i = 0; i < ngo && go; i++) { /* the first NOTICE or other plan decides */
        if ((code = read_control(r, p->ops[i].b, &h, 0)) != LPN_OK) return code;
        if (!says_go(r, &h)) {
            go = 0;
            r->failed = (int)p->ops[i].b;
        }
    }
    wire_header verdict = {r->key, r->seq, 0, 0, go ? WIRE_GO : WIRE_NOTICE, WIRE_MAGIC};
    for (i = 0; i < ngo; i++) {
        uint32_t c = p->ops[i].b;
        if (r->fds[c] < 0) return fail(r, (int)c, LPN_LOST);
        int w = write_header(r->fds[c], &verdict, r->deadline);
        if (w != 0) return fail(r, (int)c, w == -2 ? LPN_TIMEOUT : LPN_LOST);
    }
    return go ? LPN_OK : LPN_FALLBACK;
}

/* A star's receive (op i): the GO and its bytes, landed in the scratch; at the root, a
 * NOTICE or another plan makes it answer NOTICE to every node (LPN_FALLBACK). */
static uint32_t star_receive(run_state *r, uint32_t i) {
    const lpn_program *p = r->p;
    const lpn_op *o = &p->ops[i];
    wire_header h;
    uint32_t code = read_control(r, o->b, &h, o->n);
    if (code != LPN_OK) return code;
    if (says_go(r, &h)) return read_bytes(r, o->b, r->bufs[0] + o->b_off, o->n);
    if (o->kind == LPN_DOWN_RECV && h.kind == WIRE_GO) /* the root's GO is for another plan */
        return fail(r, (int)o->b, LPN_MISMATCH);
    r->failed = (int)o->b;
    if (o->kind == LPN_UP_RECV) /* the root: every node falls back with it */
        for (uint32_t k = 0; k < p->nops; k++)
            if (p->ops[k].kind == LPN_DOWN_SEND && send_message(r, p->ops[k].b, WIRE_NOTICE, NULL, 0) != LPN_OK)
                return LPN_LOST;
    r->failed = (int)o->b;
    return LPN_FALLBACK;
}

typedef int (*condition)(const run_state *r, const void *arg);

/* Wake for channel c's reading only once the rest of its current message is in, up to
 * LOWAT_MAX bytes (SO_RCVLOWAT, which poll honours on TCP): one wake-up per message
 * chunk, where a 1 Gbit/s link's packets would each wake the run. Small messages keep 1. */
#define LOWAT_MIN 16384
#define LOWAT_MAX 262144
static void want_bytes(run_state *r, uint32_t c) {
    const lpn_program *p = r->p;
    const lpn_op *o = &p->ops[p->rx[p->rx_start[c] + r->rx_next[c]]];
    uint64_t left = sizeof(wire_header) + op_bytes(o) - r->rx_done[c];
    set_lowat(r, c, left < LOWAT_MIN ? 1 : (int)(left < LOWAT_MAX ? left : LOWAT_MAX));
}

/* Move messages until ``done(r, arg)``, the deadline, or a failure. */
static uint32_t wait_for(run_state *r, condition done, const void *arg) {
    const lpn_program *p = r->p;
    for (;;) {
        struct pollfd fds[LPN_MAX_CHANNELS + 1];
        uint32_t chans[LPN_MAX_CHANNELS], n = 0, code;
        for (uint32_t c = 0; c < LPN_MAX_CHANNELS; c++) {
            short events = 0;
            if (r->tx_head[c] < r->tx_tail[c]) events |= POLLOUT;
            if (r->rx_next[c] < p->rx_start[c + 1] - p->rx_start[c]) events |= POLLIN;
            if (!events) continue;
            if (r->fds[c] < 0) return fail(r, (int)c, LPN_LOST);
            if ((events & POLLOUT) && (code = write_some(r, c)) != LPN_OK) return code;
            if ((events & POLLIN) && (code = read_some(r, c)) != LPN_OK) return code;
            events = 0; /* what is left after trying */
            if (r->tx_head[c] < r->tx_tail[c]) events |= POLLOUT;
            if (r->rx_next[c] < p->rx_start[c + 1] - p->rx_start[c]) events |= POLLIN;
            if (events) {
                if (events & POLLIN) want_bytes(r, c);
                fds[n] = (struct pollfd){r->fds[c], events, 0};
                chans[n++] = c;
            }
        }
        if (done(r, arg)) return LPN_OK;
        if (n == 0) return fail(r, -1, LPN_LOST); /* waiting on nothing: cannot happen */
        double left = r->deadline - lpn_now();
        if (left <= 0) return fail(r, (int)chans[0], LPN_TIMEOUT);
        struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
        uint32_t watched = n;
        if (r->abort_fd >= 0) fds[watched++] = (struct pollfd){r->abort_fd, POLLIN, 0};
        int ready = ppoll(fds, watched, &ts, NULL);
        if (ready < 0 && errno != EINTR) return fail(r, -1, LPN_LOST);
        if (r->abort_fd >= 0 && ready > 0 && (fds[n].revents & POLLIN)) return fail(r, -1, LPN_LOST);
        for (uint32_t k = 0; ready > 0 && k < n; k++)
            if (fds[k].revents & POLLNVAL) return fail(r, (int)chans[k], LPN_LOST);
    }
}

typedef struct {
    uint32_t chan, msg;
} landed_arg;

static int landed(const run_state *r, const void *arg) {
    const landed_arg *a = arg;
    return r->rx_next[a->chan] > a->msg;
}

typedef struct {
    uintptr_t lo, hi;
} range_arg;

/* No queued send reads [lo, hi). */
static int sends_clear(const run_state *r, const void *arg) {
    const range_arg *a = arg;
    const lpn_program *p = r->p;
    for (uint32_t c = 0; c < LPN_MAX_CHANNELS; c++)
        for (uint32_t k = r->tx_head[c]; k < r->tx_tail[c]; k++) {
            const lpn_op *o = &p->ops[p->tx[p->tx_start[c] + k]];
            uintptr_t lo = (uintptr_t)(r->bufs[o->a] + o->a_off), hi = lo + o->n;
            if (lo < a->hi && a->lo < hi) return 0;
        }
    return 1;
}

static int all_sent(const run_state *r, const void *arg) {
    (void)arg;
    for (uint32_t c = 0; c < LPN_MAX_CHANNELS; c++)
        if (r->tx_head[c] < r->tx_tail[c]) return 0;
    return 1;
}

/* Before an op writes [d, d + n): the sends that still read there are written first. */
static uint32_t clear_for_write(run_state *r, uint8_t *d, uint64_t n) {
    range_arg a = {(uintptr_t)d, (uintptr_t)d + n};
    return sends_clear(r, &a) ? LPN_OK : wait_for(r, sends_clear, &a);
}

uint32_t lpn_program_run_net(const lpn_program *p, uint8_t *const *bufs, const int *fds, uint64_t key,
                             uint32_t seq, double timeout, int abort_fd, int *lowat, int *failed) {
    run_state r;
    memset(&r, 0, sizeof r);
    r.p = p;
    r.bufs = bufs;
    r.fds = fds;
    r.key = key;
    r.seq = seq;
    r.deadline = lpn_now() + timeout;
    r.abort_fd = abort_fd;
    r.lowat = lowat;
    r.failed = -1;
    uint32_t ngo = 0;
    while (ngo < p->nops && p->ops[ngo].kind == LPN_GO) ngo++;
    uint32_t code = go_round(&r, ngo);
    for (uint32_t i = ngo; i < p->nops && code == LPN_OK; i++) {
        const lpn_op *o = &p->ops[i];
        uint8_t *d = bufs[o->dst] + o->dst_off;
        uint64_t item = o->kind == LPN_COPY || o->kind == LPN_SEND || o->kind == LPN_RECV ? 1 : lpn_itemsize(o->dtype);
        switch (o->kind) {
        case LPN_SEND:
            if (fds[o->b] < 0) {
                code = fail(&r, (int)o->b, LPN_LOST);
                break;
            }
            r.tx_tail[o->b]++;
            code = write_some(&r, o->b);
            break;
        case LPN_RECV:
        case LPN_RECV_COMBINE: {
            landed_arg a = {o->b, p->msg[i]};
            if (!landed(&r, &a) && (code = wait_for(&r, landed, &a)) != LPN_OK) break;
            if ((code = clear_for_write(&r, d, o->n * item)) != LPN_OK) break;
            if (o->kind == LPN_RECV) {
                if (o->n) memmove(d, bufs[0] + o->b_off, o->n);
            } else {
                lpn_combine(d, bufs[o->a] + o->a_off, bufs[0] + o->b_off, o->dtype, o->n, o->redop);
            }
            break;
        }
        case LPN_UP_SEND:
        case LPN_DOWN_SEND:
            code = send_message(&r, o->b, WIRE_GO, bufs[o->a] + o->a_off, o->n);
            break;
        case LPN_UP_RECV:
        case LPN_DOWN_RECV:
            code = star_receive(&r, i);
            break;
        case LPN_COPY:
            if ((code = clear_for_write(&r, d, o->n)) == LPN_OK && o->n) memmove(d, bufs[o->a] + o->a_off, o->n);
            break;
        case LPN_COMBINE:
            if ((code = clear_for_write(&r, d, o->n * item)) == LPN_OK)
                lpn_combine(d, bufs[o->a] + o->a_off, bufs[o->b] + o->b_off, o->dtype, o->n, o->redop);
            break;
        default: /* LPN_DIVIDE */
            if ((code = clear_for_write(&r, d, o->n * item)) == LPN_OK) lpn_divide(d, o->dtype, o->n, o->arg);
            break;
        }
    }
    if (code == LPN_OK && !all_sent(&r, NULL)) code = wait_for(&r, all_sent, NULL);
    *failed = r.failed;
    return code;
}
