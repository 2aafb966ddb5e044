/*
 * DESIGN: datasets read by worker processes (pinmem/_workers.py has the protocol and the
 * process side). The dataset is a pm_dataset_create_rows dataset: the C loader's worker thread w
 * calls read_rows once per claim of consecutive rows, and the read goes to process w over its
 * own SOCK_SEQPACKET socket: a request naming the dataset indices and, per field, the memfd and
 * offset of the claim's first row (the loader's slots are PM_HOST_SHARED blocks); the memfd
 * itself travels once per process by SCM_RIGHTS. The thread then waits in poll() for the one
 * reply, without the GIL: the main process does no per-sample work at all.
 *
 * Depth: the loader runs `depth` threads per process (thread t talks to process t % nch), so a
 * process has its next claim queued in its socket while it works on one: with strictly ordered
 * claims and one claim in flight per process, every worker would wait for the slowest (a
 * convoy); torch's workers likewise hold prefetch_factor batches each. Claims reach a process
 * from its threads in a fixed cycle (claim k goes to thread k % (nch * depth), hence to depth
 * index (k / nch) % depth), so each channel keeps two turns, send_turn and recv_turn: a thread
 * sends when send_turn is its depth index and reads the reply when recv_turn is, and the
 * process sees its claims in claim order (its random state then gives the same rows every
 * run). `pending` counts requests whose replies were not read: a wait cut short by cancel or a
 * timeout leaves them, and _procs_drain reads them (the process has then stopped writing into
 * the slots) before another loader uses the dataset; drain also resets the turns, since a
 * loader that stops may leave a claim it took unread. A cancel is checked under the channel's
 * lock after every wait for a turn, so nothing is sent once drain has counted the replies owed.
 * Each request carries a tag (one more than the channel's last) that its reply echoes: a reply
 * with another tag fails the claim (ERR_ORDER) instead of marking rows written that its process
 * has not written. Errors are kept
 * raw (kind, worker, status, the reply's pickled payload), first one wins, and become a Python
 * exception only when next() asks, with the GIL, through the Pool object of _workers.py
 * (Pool.error / Pool.died / Pool.timeout_error), which knows the processes' exit codes.
 * Cancel (an eventfd in every poll) wakes every waiting thread at close, so stopping the loader
 * never waits for a worker that hangs.
 */
#include "_pinmem.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAGIC_REQ 0x51524D50u
#define MAGIC_REP 0x50524D50u
#define KIND_ROWS 1u
#define KNOWN_MAX 256
#define ERR_INDICES 8

enum {
  ERR_NONE,
  ERR_REPLY,
  ERR_EOF,
  ERR_TIMEOUT,
  ERR_SEND,
  ERR_CANCEL,
  ERR_SHARED,
  ERR_RETRY,
  ERR_ORDER
};

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int fd;        /* the main process's end of the socket (owned by the Pool's socket object) */
  int pending;   /* requests out whose replies were not read */
  int send_turn; /* the depth index whose request goes next (see DESIGN) */
  int recv_turn; /* the depth index whose reply comes next */
  uint64_t tag;  /* the tag of the last request sent (see DESIGN: replies are checked by it) */
  int readers;   /* threads inside wait_reply (which runs without mu) */
  atomic_bool dead; /* end of file seen: the process is gone (set by readers without mu) */
  int nknown;
  uint64_t known[KNOWN_MAX]; /* memfd keys this process has mapped */
} chan_t;

struct pmpy_procs {
  int nch;
  int depth; /* loader threads per process: thread t talks to process t % nch */
  chan_t *ch;
  int nfields;
  size_t fbytes[PM_MAX_FIELDS]; /* bytes of a row of field k */
  int timeout_ms; /* -1: none */
  int cancel_fd;  /* eventfd: readable once cancelled */
  atomic_bool cancelled;
  pthread_mutex_t err_mu;
  int err_kind, err_worker, err_status, err_errno;
  char *err_payload;
  size_t err_len;
  int err_nidx;
  uint64_t err_idx[ERR_INDICES];
  uint64_t err_n;
  uint64_t err_batch, err_row; /* the failed claim's place in the loader's order */
};

/* A reply: magic u32, status i32, index u64, tag u64 (REP in _workers.py). */
typedef struct {
  uint32_t magic;
  int32_t status;
  uint64_t index;
  uint64_t tag;
} reply_t;

/* The error kept is the first claim's in the loader's order, not the first to arrive: claims
 * fail at once in several processes, and the loader raises at the earliest failed batch, which
 * must get its own exception. */
static void record(struct pmpy_procs *P, int kind, int w, int status, int err, const void *payload,
                   size_t len, const pm_rows_request_t *rq) {
  pthread_mutex_lock(&P->err_mu);
  bool earlier = rq && kind != ERR_CANCEL && P->err_kind != ERR_CANCEL &&
                 (rq->batch < P->err_batch || (rq->batch == P->err_batch && rq->row < P->err_row));
  if (P->err_kind == ERR_NONE || (P->err_kind == ERR_CANCEL && kind != ERR_CANCEL) || earlier) {
    free(P->err_payload);
    P->err_payload = NULL;
    P->err_len = 0;
    if (payload && len) {
      P->err_payload = malloc(len);
      if (P->err_payload) {
        memcpy(P->err_payload, payload, len);
        P->err_len = len;
      }
    }
    P->err_kind = kind;
    P->err_worker = w;
    P->err_status = status;
    P->err_errno = err;
    P->err_n = rq ? rq->n : 0;
    P->err_batch = rq ? rq->batch : UINT64_MAX;
    P->err_row = rq ? rq->row : UINT64_MAX;
    P->err_nidx = rq ? (int)(rq->n < ERR_INDICES ? rq->n : ERR_INDICES) : 0;
    for (int i = 0; i < P->err_nidx; i++) P->err_idx[i] = rq->indices[i];
  }
  pthread_mutex_unlock(&P->err_mu);
}

static uint64_t memfd_key(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return 0;
  return (uint64_t)st.st_ino ^ ((uint64_t)st.st_dev << 48);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Read the one reply waiting on c's socket into *buf (malloc'd, *len bytes): ERR_NONE,
 * ERR_RETRY (nothing there after all), ERR_EOF (the process is gone) or ERR_SEND. */
static int recv_reply(chan_t *c, char **buf, size_t *len) {
  char probe;
  ssize_t want = recv(c->fd, &probe, 1, MSG_PEEK | MSG_TRUNC | MSG_DONTWAIT);
  if (want < 0 && (errno == EINTR || errno == EAGAIN)) return ERR_RETRY;
  if (want == 0 || (want < 0 && errno == ECONNRESET)) {
    c->dead = true;
    return ERR_EOF;
  }
  if (want < 0) return ERR_SEND;
  char *b = malloc((size_t)want);
  if (!b) return ERR_SEND;
  ssize_t got = recv(c->fd, b, (size_t)want, MSG_DONTWAIT);
  if (got != want) {
    free(b);
    if (got != 0) return ERR_SEND;
    c->dead = true;
    return ERR_EOF;
  }
  *buf = b;
  *len = (size_t)got;
  return ERR_NONE;
}

/* Wait for channel c's reply and read it into *buf (malloc'd, *len bytes). Returns ERR_NONE, or
 * the kind of failure. */
static int wait_reply(struct pmpy_procs *P, chan_t *c, char **buf, size_t *len) {
  double deadline = P->timeout_ms < 0 ? 0 : now_s() + P->timeout_ms / 1000.0;
  *buf = NULL;
  *len = 0;
  for (;;) {
    struct pollfd pf[2] = {{c->fd, POLLIN, 0}, {P->cancel_fd, POLLIN, 0}};
    int ms = -1;
    if (P->timeout_ms >= 0) {
      double left = deadline - now_s();
      if (left <= 0) return ERR_TIMEOUT;
      ms = (int)(left * 1000.0) + 1;
    }
    int r = poll(pf, 2, ms);
    if (r < 0) {
      if (errno == EINTR) continue;
      return ERR_SEND;
    }
    if (r == 0) continue; /* the deadline check above decides */
    if (pf[1].revents) return ERR_CANCEL;
    if (!pf[0].revents) continue;
    int kind = recv_reply(c, buf, len);
    if (kind != ERR_RETRY) return kind;
  }
}

/* Send the request for rq on channel c (attaching the memfds process w has not mapped yet);
 * *tag_out: the tag its reply must carry. Called with c->mu held. */
static int send_request(struct pmpy_procs *P, chan_t *c, const pm_rows_request_t *rq, int *err,
                        uint64_t *tag_out) {
  uint64_t keys[PM_MAX_FIELDS], offs[PM_MAX_FIELDS], newkeys[PM_MAX_FIELDS];
  int newfds[PM_MAX_FIELDS], nnew = 0;
  for (int k = 0; k < P->nfields; k++) {
    int fd;
    uint64_t off;
    size_t bytes;
    if (pm_host_shared_fd(rq->dsts[k], &fd, &off, &bytes) != PM_OK) return ERR_SHARED;
    keys[k] = memfd_key(fd);
    offs[k] = off;
    bool have = false;
    for (int i = 0; i < c->nknown && !have; i++) have = c->known[i] == keys[k];
    for (int i = 0; i < nnew && !have; i++) have = newkeys[i] == keys[k];
    if (!have) {
      newkeys[nnew] = keys[k];
      newfds[nnew++] = fd;
    }
  }
  size_t n = (size_t)rq->n;
  /* After the indices: the claim's batch and first row, by which the worker files the rows'
   * non-array leaves. */
  size_t len = 40 + (size_t)P->nfields * 24 + (size_t)nnew * 8 + n * 8 + 16;
  unsigned char stackbuf[8192], *msg = len <= sizeof stackbuf ? stackbuf : malloc(len);
  if (!msg) return ERR_SEND;
  unsigned char *p = msg;
  uint32_t h32[2] = {MAGIC_REQ, KIND_ROWS};
  uint64_t h64[2] = {rq->epoch, rq->n};
  uint32_t t32[2] = {(uint32_t)P->nfields, (uint32_t)nnew};
  uint64_t tag = c->tag + 1;
  memcpy(p, h32, 8);
  memcpy(p + 8, h64, 16);
  memcpy(p + 24, t32, 8);
  memcpy(p + 32, &tag, 8);
  p += 40;
  for (int k = 0; k < P->nfields; k++) {
    uint64_t f[3] = {keys[k], offs[k], (uint64_t)P->fbytes[k]};
    memcpy(p, f, 24);
    p += 24;
  }
  memcpy(p, newkeys, (size_t)nnew * 8);
  p += (size_t)nnew * 8;
  memcpy(p, rq->indices, n * 8);
  p += n * 8;
  uint64_t at[2] = {rq->batch, rq->row};
  memcpy(p, at, 16);

  struct iovec iov = {msg, len};
  union {
    char buf[CMSG_SPACE(sizeof(int) * PM_MAX_FIELDS)];
    struct cmsghdr align;
  } ctl;
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  if (nnew) {
    memset(&ctl, 0, sizeof ctl);
    mh.msg_control = ctl.buf;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nnew);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nnew);
    memcpy(CMSG_DATA(cm), newfds, sizeof(int) * (size_t)nnew);
  }
  ssize_t sent;
  do sent = sendmsg(c->fd, &mh, MSG_NOSIGNAL);
  while (sent < 0 && errno == EINTR);
  int e = errno;
  if (msg != stackbuf) free(msg);
  if (sent != (ssize_t)len) {
    *err = sent < 0 ? e : EMSGSIZE;
    if (sent < 0 && (e == EPIPE || e == ECONNRESET)) {
      c->dead = true;
      return ERR_EOF;
    }
    return ERR_SEND;
  }
  if (nnew) {
    if (c->nknown + nnew > KNOWN_MAX) c->nknown = 0; /* the process replaces mappings by key */
    for (int i = 0; i < nnew; i++) c->known[c->nknown++] = newkeys[i];
  }
  c->tag = tag;
  *tag_out = tag;
  c->pending++;
  return ERR_NONE;
}

/* Wait (mu held) until *turn is d: true, or false once cancelled. A cancel wins over a turn
 * that came at the same time: a thread that waited for its send turn must not send after
 * _procs_drain has read the channel's replies (its reply would be read by the next loader's
 * first claim of this process, as that claim's). */
static bool wait_turn(struct pmpy_procs *P, chan_t *c, const int *turn, int d) {
  while (*turn != d && !atomic_load(&P->cancelled)) pthread_cond_wait(&c->cv, &c->mu);
  return *turn == d && !atomic_load(&P->cancelled);
}

static int procs_read_rows(const pm_rows_request_t *rq, void *user) {
  struct pmpy_procs *P = user;
  int t = rq->worker >= 0 ? rq->worker : 0;
  int w = t % P->nch, d = rq->worker >= 0 ? (t / P->nch) % P->depth : 0;
  chan_t *c = &P->ch[w];
  int kind = ERR_NONE, err = 0, status = 0;
  char *buf = NULL;
  size_t len = 0;
  uint64_t tag = 0, got_tag = 0;
  pthread_mutex_lock(&c->mu);
  if (atomic_load(&P->cancelled) || !wait_turn(P, c, &c->send_turn, d)) kind = ERR_CANCEL;
  else if (c->dead) kind = ERR_EOF;
  /* The socket is written and read under mu (a send never blocks long: the process reads
   * requests as soon as it is done with one), and the turns order the threads. */
  if (kind == ERR_NONE) kind = send_request(P, c, rq, &err, &tag);
  if (kind == ERR_NONE) {
    c->send_turn = (d + 1) % P->depth;
    pthread_cond_broadcast(&c->cv);
    if (!wait_turn(P, c, &c->recv_turn, d)) kind = ERR_CANCEL;
  }
  if (kind == ERR_NONE) {
    /* Read without mu: the other thread of this process may send meanwhile. */
    c->readers++;
    pthread_mutex_unlock(&c->mu);
    kind = wait_reply(P, c, &buf, &len);
    pthread_mutex_lock(&c->mu);
    if (--c->readers == 0) pthread_cond_broadcast(&c->cv);
    if (kind == ERR_NONE) {
      c->pending--;
      c->recv_turn = (d + 1) % P->depth;
      pthread_cond_broadcast(&c->cv);
      reply_t r;
      if (len < sizeof r) {
        kind = ERR_SEND;
        err = EPROTO;
      } else {
        memcpy(&r, buf, sizeof r);
        if (r.magic != MAGIC_REP) {
          kind = ERR_SEND;
          err = EPROTO;
        } else if (r.tag != tag) {
          /* The reply answers another request: this process's rows can no longer be matched
           * to claims (never expected; a loud error instead of a batch whose rows are not
           * written yet). */
          kind = ERR_ORDER;
          got_tag = r.tag;
        } else if (r.status != 0) {
          kind = ERR_REPLY;
          status = r.status;
        }
      }
    }
  }
  pthread_mutex_unlock(&c->mu);
  if (kind != ERR_NONE) {
    const void *pl = kind == ERR_REPLY ? buf + sizeof(reply_t) : NULL;
    size_t pll = kind == ERR_REPLY ? len - sizeof(reply_t) : 0;
    char order[96];
    if (kind == ERR_ORDER) {
      snprintf(order, sizeof order, "request %llu was answered by the reply to request %llu",
               (unsigned long long)tag, (unsigned long long)got_tag);
      pl = order;
      pll = strlen(order) + 1;
    }
    record(P, kind, w, status, err, pl, pll, rq);
  }
  free(buf);
  switch (kind) {
    case ERR_NONE: return 0;
    case ERR_TIMEOUT: return PM_ERR_TIMEOUT;
    case ERR_REPLY: return status == 2 ? PM_ERR_INVALID : PM_ERR_IO;
    case ERR_SHARED: return PM_ERR_INVALID;
    case ERR_CANCEL: return PM_ERR_STATE;
    default: return PM_ERR_IO;
  }
}

void pmpy_procs_free(struct pmpy_procs *P) {
  if (!P) return;
  for (int i = 0; i < P->nch; i++) {
    pthread_mutex_destroy(&P->ch[i].mu);
    pthread_cond_destroy(&P->ch[i].cv);
  }
  free(P->ch);
  if (P->cancel_fd >= 0) close(P->cancel_fd);
  pthread_mutex_destroy(&P->err_mu);
  free(P->err_payload);
  free(P);
}

static void procs_destroy(void *user) { (void)user; /* freed with the DatasetObject */ }

PyObject *pmpy_procs_take_error(DatasetObject *d) {
  struct pmpy_procs *P = d->procs;
  pthread_mutex_lock(&P->err_mu);
  int kind = P->err_kind;
  if (kind == ERR_NONE || kind == ERR_CANCEL) {
    pthread_mutex_unlock(&P->err_mu);
    return NULL;
  }
  int w = P->err_worker, status = P->err_status, err = P->err_errno, nidx = P->err_nidx;
  uint64_t idx[ERR_INDICES], n = P->err_n;
  memcpy(idx, P->err_idx, sizeof idx);
  PyObject *payload = PyBytes_FromStringAndSize(P->err_payload ? P->err_payload : "",
                                                (Py_ssize_t)P->err_len);
  /* Kept: the loader fails every later next() with the same batch, and so does this error. */
  pthread_mutex_unlock(&P->err_mu);
  if (!payload) return NULL;
  PyObject *indices = PyList_New(nidx);
  for (int i = 0; indices && i < nidx; i++)
    PyList_SET_ITEM(indices, i, PyLong_FromUnsignedLongLong(idx[i]));
  PyObject *exc = NULL;
  if (indices) {
    PyObject *pool = d->fetch;
    switch (kind) {
      case ERR_REPLY:
        exc = PyObject_CallMethod(pool, "error", "iiO", status, w, payload);
        break;
      case ERR_EOF: exc = PyObject_CallMethod(pool, "died", "iO", w, indices); break;
      case ERR_TIMEOUT:
        exc = PyObject_CallMethod(pool, "timeout_error", "idO", w,
                                  P->timeout_ms / 1000.0, indices);
        break;
      case ERR_ORDER: {
        char text[256];
        snprintf(text, sizeof text, "its answers are out of order (%s): its rows cannot be "
                 "trusted; close the loader and make a new one",
                 PyBytes_GET_SIZE(payload) ? PyBytes_AS_STRING(payload) : "?");
        exc = PyObject_CallMethod(pool, "plain_error", "is", w, text);
        break;
      }
      case ERR_SHARED:
        exc = PyObject_CallMethod(pool, "plain_error", "is", w,
                                  "the loader's slots are not shared memory (a worker process "
                                  "cannot write them); process workers need pin_memory=True");
        break;
      default: {
        char text[256];
        snprintf(text, sizeof text, "talking to the worker failed: %s (claim of %llu rows)",
                 strerror(err ? err : EIO), (unsigned long long)n);
        exc = PyObject_CallMethod(pool, "plain_error", "is", w, text);
      }
    }
  }
  Py_XDECREF(indices);
  Py_DECREF(payload);
  if (!exc) return NULL;
  PyObject *t = Py_BuildValue("(OOO)", (PyObject *)Py_TYPE(exc), exc, Py_None);
  Py_DECREF(exc);
  return t;
}

/* _dataset_procs(pool, fds, samples, specs, timeout, depth): a dataset whose rows are written by
 * the worker processes behind fds (one socket each; `depth` loader threads each), specs as
 * _dataset_python's. */
static PyObject *py_dataset_procs(PyObject *mod, PyObject *args) {
  PyObject *pool, *fds, *specs;
  unsigned long long samples;
  double timeout;
  int depth = 1;
  if (!PyArg_ParseTuple(args, "OOKOd|i:_dataset_procs", &pool, &fds, &samples, &specs, &timeout,
                        &depth))
    return NULL;
  PyObject *fseq = pmpy_fast_tuple(fds, "fds must be a sequence");
  if (!fseq) return NULL;
  PyObject *seq = pmpy_fast_tuple(specs, "specs must be a sequence");
  if (!seq) {
    Py_DECREF(fseq);
    return NULL;
  }
  Py_ssize_t nch = PySequence_Fast_GET_SIZE(fseq), n = PySequence_Fast_GET_SIZE(seq);
  DatasetObject *d = NULL;
  struct pmpy_procs *P = NULL;
  if (nch < 1 || n < 1 || n > PM_MAX_FIELDS || depth < 1 || depth > 8) {
    pmpy_raise_fmt(PM_ERR_INVALID, "_dataset_procs: 1+ workers, 1..%d fields, depth 1..8",
                   PM_MAX_FIELDS);
    goto fail;
  }
  P = calloc(1, sizeof *P);
  if (!P || !(P->ch = calloc((size_t)nch, sizeof *P->ch))) {
    PyErr_NoMemory();
    goto fail;
  }
  P->cancel_fd = -1;
  P->depth = depth;
  pthread_mutex_init(&P->err_mu, NULL);
  for (Py_ssize_t i = 0; i < nch; i++) {
    pthread_mutex_init(&P->ch[i].mu, NULL);
    pthread_cond_init(&P->ch[i].cv, NULL);
    P->nch++;
    long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(fseq, i));
    if (fd < 0) {
      if (!PyErr_Occurred()) pmpy_raise_fmt(PM_ERR_INVALID, "_dataset_procs: fd %ld", fd);
      goto fail;
    }
    P->ch[i].fd = (int)fd;
  }
  P->cancel_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (P->cancel_fd < 0) {
    PyErr_SetFromErrno(PyExc_OSError);
    goto fail;
  }
  P->timeout_ms = timeout > 0 ? (int)(timeout * 1000.0 + 0.5) : -1;
  pm_field_t f[PM_MAX_FIELDS];
  for (Py_ssize_t k = 0; k < n; k++)
    if (pmpy_parse_spec(PySequence_Fast_GET_ITEM(seq, k), (int)k, &f[k], &P->fbytes[k]) < 0)
      goto fail;
  P->nfields = (int)n;
  d = pmpy_dataset_new();
  if (!d) goto fail;
  d->nfields = (int)n;
  d->fetch = Py_NewRef(pool);
  d->procs = P;
  P = NULL;
  pm_dataset_rows_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = samples;
  cb.nfields = (int)n;
  cb.fields = f;
  cb.read_rows = procs_read_rows;
  cb.user = d->procs;
  cb.destroy = procs_destroy;
  pm_status_t st = pm_dataset_create_rows(&cb, &d->ds);
  if (st != PM_OK) {
    pmpy_raise_status(st);
    goto fail;
  }
  for (int k = 0; k < d->nfields; k++) d->fbytes[k] = d->procs->fbytes[k];
  Py_DECREF(fseq);
  Py_DECREF(seq);
  return (PyObject *)d;
fail:
  Py_DECREF(fseq);
  Py_DECREF(seq);
  pmpy_procs_free(P);
  Py_XDECREF(d);
  return NULL;
}

/* _procs_cancel(dataset): every wait for a worker ends now (close). */
static PyObject *py_procs_cancel(PyObject *mod, PyObject *arg) {
  if (!PyObject_TypeCheck(arg, &pmpy_DatasetType) || !((DatasetObject *)arg)->procs)
    return pmpy_raise_fmt(PM_ERR_INVALID, "_procs_cancel takes a worker-process dataset");
  struct pmpy_procs *P = ((DatasetObject *)arg)->procs;
  atomic_store(&P->cancelled, true);
  uint64_t one = 1;
  if (write(P->cancel_fd, &one, sizeof one) < 0 && errno != EAGAIN)
    return PyErr_SetFromErrno(PyExc_OSError);
  for (int i = 0; i < P->nch; i++) {
    pthread_mutex_lock(&P->ch[i].mu);
    pthread_cond_broadcast(&P->ch[i].cv);
    pthread_mutex_unlock(&P->ch[i].mu);
  }
  Py_RETURN_NONE;
}

/* After _procs_cancel, with the loader threads possibly still alive: read every reply still
 * owed, so the processes are done with the slots they were given before the loader frees them.
 * Cancel stays set (checked under each channel's mu before any send), so nothing new goes out;
 * a thread inside wait_reply leaves at once (the eventfd) and is waited for first, so the
 * socket has one reader. Returns False if a process did not answer within timeout s (that
 * channel is then dead). */
static PyObject *py_procs_drain(PyObject *mod, PyObject *args) {
  PyObject *ds;
  double timeout;
  if (!PyArg_ParseTuple(args, "Od:_procs_drain", &ds, &timeout)) return NULL;
  if (!PyObject_TypeCheck(ds, &pmpy_DatasetType) || !((DatasetObject *)ds)->procs)
    return pmpy_raise_fmt(PM_ERR_INVALID, "_procs_drain takes a worker-process dataset");
  struct pmpy_procs *P = ((DatasetObject *)ds)->procs;
  bool ok = true;
  Py_BEGIN_ALLOW_THREADS;
  for (int i = 0; i < P->nch; i++) {
    chan_t *c = &P->ch[i];
    pthread_mutex_lock(&c->mu);
    while (c->readers > 0) pthread_cond_wait(&c->cv, &c->mu);
    double deadline = now_s() + (timeout > 0 ? timeout : 60.0);
    while (c->pending > 0 && !c->dead) {
      struct pollfd pf = {c->fd, POLLIN, 0};
      int ms = (int)((deadline - now_s()) * 1000.0);
      int r = ms > 0 ? poll(&pf, 1, ms) : 0;
      if (r < 0 && errno == EINTR) continue;
      if (r > 0) {
        char *b = NULL;
        size_t n;
        int kind = recv_reply(c, &b, &n);
        free(b);
        if (kind == ERR_RETRY) continue;
        if (kind == ERR_NONE) {
          c->pending--;
          continue;
        }
      }
      c->dead = true; /* gone, or no answer in time: never trust this channel's order again */
      ok = false;
    }
    pthread_mutex_unlock(&c->mu);
  }
  Py_END_ALLOW_THREADS;
  return PyBool_FromLong(ok);
}

/* Once no loader thread uses the dataset: clear a cancel, a dataset's error and the turns, for
 * the next loader. */
static PyObject *py_procs_reset(PyObject *mod, PyObject *ds) {
  if (!PyObject_TypeCheck(ds, &pmpy_DatasetType) || !((DatasetObject *)ds)->procs)
    return pmpy_raise_fmt(PM_ERR_INVALID, "_procs_reset takes a worker-process dataset");
  struct pmpy_procs *P = ((DatasetObject *)ds)->procs;
  uint64_t v;
  while (read(P->cancel_fd, &v, sizeof v) > 0) {
  }
  for (int i = 0; i < P->nch; i++) {
    chan_t *c = &P->ch[i];
    pthread_mutex_lock(&c->mu);
    c->pending = 0;
    c->send_turn = c->recv_turn = 0;
    pthread_mutex_unlock(&c->mu);
  }
  /* An error a worker replied (an exception in the dataset) failed its batch of the loader now
   * gone; the next loader (the batch after it, as torch) must report its own errors. */
  pthread_mutex_lock(&P->err_mu);
  if (P->err_kind == ERR_CANCEL || P->err_kind == ERR_REPLY) {
    P->err_kind = ERR_NONE;
    free(P->err_payload);
    P->err_payload = NULL;
    P->err_len = 0;
  }
  pthread_mutex_unlock(&P->err_mu);
  atomic_store(&P->cancelled, false);
  Py_RETURN_NONE;
}

PyMethodDef pmpy_procs_functions[] = {
    {"_dataset_procs", py_dataset_procs, METH_VARARGS,
     "_dataset_procs(pool, fds, samples, specs, timeout): rows written by worker processes"},
    {"_procs_cancel", py_procs_cancel, METH_O, "_procs_cancel(dataset): stop every wait"},
    {"_procs_drain", py_procs_drain, METH_VARARGS,
     "_procs_drain(dataset, timeout): after _procs_cancel, read the replies still owed"},
    {"_procs_reset", py_procs_reset, METH_O,
     "_procs_reset(dataset): once no loader uses it, clear a cancel for the next loader"},
    {0}};
