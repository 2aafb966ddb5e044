/*
 * Internals shared by the copy engine's files, bottom to top: completion.c (completion service,
 * event waits), copy_stage.c (staging through pinned bounce buffers), fence.c (fences),
 * copy.c (API, path choice, submission), with classify.c and copy_batch.c beside them. Nothing here
 * is installed.
 */
#ifndef PINMEM_COPY_INTERNAL_H
#define PINMEM_COPY_INTERNAL_H

#include <pthread.h>

#include "internal.h"

/* The copy options in force (copy_chunk, copy_slots, copy_threads, copy_stage_min). */
typedef struct pm__copy_cfg {
  size_t chunk;     /* staging chunk, >= 4 KiB */
  int slots;        /* ring depth when the budget forbids a whole-copy bounce buffer */
  int threads;      /* memcpy threads, the calling thread included */
  size_t stage_min; /* pageable copies below this take the plain backend copy */
  int bounce;       /* pm__copy_bounce_t: whole-copy block, ring, or ring when idle */
  int mover;        /* pm__copy_memcpy_t: how bytes go to and from bounce memory */
  bool ramp;        /* H2D staging starts with growing units (copy_ramp) */
  size_t piece;     /* copy_piece: ring slots filled in pieces by all threads; 0 = off */
  int piece_slots;  /* copy_piece_slots: that ring's depth (copy_slots when the option is 0) */
} pm__copy_cfg_t;

void pm__copy_cfg(pm__copy_cfg_t *cfg);

/* One contiguous piece of a staged copy: `host` is the pageable side, `dev` the device side
 * (the destination for H2D, the source for D2H). */
typedef struct pm__stage_seg {
  char *host;
  char *dev;
  size_t bytes;
} pm__stage_seg_t;

typedef struct pm__stage_req {
  pm_copy_kind_t kind; /* PM_COPY_H2D or PM_COPY_D2H */
  const pm__stage_seg_t *segs;
  size_t nsegs;
  pm_stream_t stream;
  pm_pool_t *pool; /* resolved: never NULL */
  pm__copy_cfg_t cfg;
} pm__stage_req_t;

/* Staged D2H copy-out work still to do after pm__stage_d2h_submit (opaque). */
typedef struct pm__d2h_job pm__d2h_job_t;

/* Staged H2D: returns once every source byte was copied into pinned bounce memory and every DMA
 * is queued on req->stream. With a whole-copy bounce buffer it never waits for the stream; with
 * the ring fallback it waits for the DMAs of reused slots. *ring_out (may be NULL) tells which. */
pm_status_t pm__stage_h2d(const pm__stage_req_t *req, bool *ring_out);
/* H2D copies staged through slots filled in pieces (copy_piece) since the process started. */
unsigned long pm__stage_slab_count(void);
/* Tests only: when set, called by a slab worker after it copied piece `piece` of group `group`
 * (before the piece is counted), so a test can stall one piece and watch the others go on. */
extern void (*pm__stage_piece_hook)(size_t group, size_t piece);

/* Staged D2H: queue every DMA device -> bounce on req->stream. *job_out gets the copy-out still
 * to run (pm__stage_d2h_finish), or NULL when the ring fallback was used, which copies
 * everything before returning. On failure nothing is left to run and no memory is held (bounce
 * memory is freed stream-ordered). */
pm_status_t pm__stage_d2h_submit(const pm__stage_req_t *req, pm__d2h_job_t **job_out);
/* Wait for the DMAs, copy the bytes out into the destination with several threads, release the
 * bounce buffer, free the job. Runs on a completion thread and makes no backend call (a stream
 * gate may be waiting for it). Always PM_OK today; msg gets the detail of a failure. */
pm_status_t pm__stage_d2h_finish(pm__d2h_job_t *job, char *msg, size_t msg_len);
/* Called by the gate (a host function queued behind the copy's last DMA): every DMA is done. */
void pm__stage_d2h_dmas_done(pm__d2h_job_t *job);
/* Make pm__stage_d2h_finish skip the copy-out it has not done yet (the DMAs' completion cannot
 * be known: a failed stream wait). Called before pm__stage_d2h_dmas_done; the bounce block then
 * goes back to the pool stream-ordered. */
void pm__stage_d2h_discard(pm__d2h_job_t *job);
/* The submit failed before the gate was queued: wait for the stream, then free the job and its
 * bounce block without copying anything out. Keeps pm_last_error's detail. */
void pm__stage_d2h_abort(pm__d2h_job_t *job, pm_stream_t stream);

/* ---- completion.c ---------------------------------------------------------------------------- */

/* A job of the completion service: embedded in the object it serves; run gets the node back. */
typedef struct pm__cq_node {
  struct pm__cq_node *next;
  void (*run)(struct pm__cq_node *node);
  int device; /* entered by the completion thread before run (-1: none); set by the node's owner
               * on the thread that made the work, as posts come from host functions */
} pm__cq_node_t;
/* Queue a job. Returns true once a completion thread will run it. If no completion thread can
 * be started at all: with `inline_ok` the caller runs the queue itself (a degraded mode that only
 * a thread-creation failure reaches) and true is returned; without it the job is taken back out
 * and false is returned (a D2H copy-out must run beside the caller, never inside it). */
bool pm__cq_post_ex(pm__cq_node_t *node, void (*run)(pm__cq_node_t *node), bool inline_ok);
void pm__cq_post(pm__cq_node_t *node, void (*run)(pm__cq_node_t *node));
/* Poll an event until it completes (short sleeps, growing to max_sleep_us): waiting threads
 * neither spin a core nor need a blocking-sync event. */
pm_status_t pm__copy_wait_event(pm_event_t event, unsigned max_sleep_us);
/* Destroy an event that may still be pending: now if complete, else once it completed (on a
 * completion thread), so no backend ever sees a pending event destroyed. */
void pm__copy_reap_event(pm_event_t event);

/* ---- fence.c --------------------------------------------------------------------------------- */

struct pm_fence_s {
  atomic_int refs;
  pm_copy_path_t path;
  pm_event_t event;        /* recorded after the last DMA; NULL if nothing was queued */
  bool host;               /* completion also needs the completion service (callback, copy-out) */
  pm__d2h_job_t *job;      /* staged D2H copy-out, until the completion thread takes it */
  pm__d2h_job_t *gate_job; /* the same, for the gate (never cleared) */
  void (*cb)(void *arg, pm_status_t status);
  void *cb_arg;
  pm__cq_node_t node;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool armed;     /* under mu: the submitting call is over (set at once unless staged D2H) */
  bool cancelled; /* under mu: that call failed, so no callback runs */
  bool data_done; /* under mu */
  bool finished;  /* under mu */
  pm_status_t status;
  char msg[256];
};

pm_status_t pm__fence_new(pm_copy_path_t path, bool with_event, const pm_copy_options_t *opt,
                          pm_fence_t *out);
void pm__fence_free(pm_fence_t f);
/* Drop a reference; the last one frees the fence (from a completion thread when in_host_func). */
void pm__fence_unref(pm_fence_t f, bool in_host_func);
/* Hand the fence's completion (copy-out, then the callback) to a completion thread. */
void pm__fence_post(pm_fence_t f);
/* Host function behind a direct / staged-H2D copy with a callback: pm__fence_post. */
void pm__fence_notify(void *arg);
pm_status_t pm__fence_live_add(pm_fence_t f);
bool pm__fence_live_remove(pm_fence_t f);
/* A copy with nothing to move: the fence is complete at once; the callback still runs once. */
pm_status_t pm__fence_submit_empty(const pm_copy_options_t *opt, pm_fence_t *fence_out);
/* The completion of a staged D2H copy: the copy-out posted, then the gate and the event queued. */
pm_status_t pm__fence_submit_d2h_gate(pm_fence_t f, pm__d2h_job_t *job, pm_stream_t stream,
                                      pm_fence_t *fence_out);

/* The copy engine's backend calls: the contract itself, not the front door. The engine checked
 * its pointers once, at submission, so no call here looks anything up in the registry again
 * (every staged chunk is one backend copy, nothing more). */
#define PM__ENGINE_CALL(call)                \
  do {                                       \
    const pm__backend_t *b_ = pm__backend(); \
    if (!b_) return pm__backend_failed();    \
    return b_->call;                         \
  } while (0)
static inline pm_status_t pm__cb_memcpy_async(void *dst, const void *src, size_t bytes,
                                              pm_copy_kind_t kind, pm_stream_t stream) {
  if (bytes == 0) return PM_OK;
  PM__ENGINE_CALL(memcpy_async(dst, src, bytes, kind, stream));
}
static inline pm_status_t pm__cb_event_create(unsigned flags, pm_event_t *out) {
  PM__ENGINE_CALL(event_create(flags, out));
}
static inline pm_status_t pm__cb_event_destroy(pm_event_t e) {
  PM__ENGINE_CALL(event_destroy(e));
}
static inline pm_status_t pm__cb_event_record(pm_event_t e, pm_stream_t s) {
  PM__ENGINE_CALL(event_record(e, s));
}
static inline pm_status_t pm__cb_event_query(pm_event_t e) {
  PM__ENGINE_CALL(event_query(e));
}
static inline pm_status_t pm__cb_event_synchronize(pm_event_t e) {
  PM__ENGINE_CALL(event_synchronize(e));
}
static inline pm_status_t pm__cb_stream_synchronize(pm_stream_t s) {
  PM__ENGINE_CALL(stream_synchronize(s));
}
static inline pm_status_t pm__cb_stream_query(pm_stream_t s) {
  PM__ENGINE_CALL(stream_query(s));
}
static inline pm_status_t pm__cb_stream_wait_event(pm_stream_t s, pm_event_t e) {
  PM__ENGINE_CALL(stream_wait_event(s, e));
}
static inline pm_status_t pm__cb_launch_host_func(pm_stream_t s, void (*fn)(void *), void *arg) {
  PM__ENGINE_CALL(launch_host_func(s, fn, arg));
}

#endif /* PINMEM_COPY_INTERNAL_H */
