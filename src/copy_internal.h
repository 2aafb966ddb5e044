/*
 * Internals shared by the copy engine's files (copy.c: API, path choice, fences, completion
 * service; copy_stage.c: staging through pinned bounce buffers). Nothing here is installed.
 */
#ifndef PINMEM_COPY_INTERNAL_H
#define PINMEM_COPY_INTERNAL_H

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

/* Poll an event until it completes (short sleeps, growing to max_sleep_us): waiting threads
 * neither spin a core nor need a blocking-sync event. */
pm_status_t pm__copy_wait_event(pm_event_t event, unsigned max_sleep_us);
/* Destroy an event that may still be pending: now if complete, else once it completed (on a
 * completion thread), so no backend ever sees a pending event destroyed. */
void pm__copy_reap_event(pm_event_t event);

/* The copy engine's backend calls: the contract itself, not the front door. The engine checked
 * its pointers once, at submission, so no call here looks anything up in the registry again
 * (every staged chunk is one backend copy, nothing more). */
#define PM__ENGINE_CALL(call)                    \
  do {                                           \
    const pm__backend_t *b_ = pm__backend();     \
    if (!b_) return pm__backend_failed();        \
    return b_->call;                             \
  } while (0)
static inline pm_status_t pm__cb_memcpy_async(void *dst, const void *src, size_t bytes,
                                              pm_copy_kind_t kind, pm_stream_t stream) {
  if (bytes == 0) return PM_OK;
  PM__ENGINE_CALL(memcpy_async(dst, src, bytes, kind, stream));
}
static inline pm_status_t pm__cb_event_create(unsigned flags, pm_event_t *out) {
  PM__ENGINE_CALL(event_create(flags, out));
}
static inline pm_status_t pm__cb_event_destroy(pm_event_t e) { PM__ENGINE_CALL(event_destroy(e)); }
static inline pm_status_t pm__cb_event_record(pm_event_t e, pm_stream_t s) {
  PM__ENGINE_CALL(event_record(e, s));
}
static inline pm_status_t pm__cb_event_query(pm_event_t e) { PM__ENGINE_CALL(event_query(e)); }
static inline pm_status_t pm__cb_event_synchronize(pm_event_t e) {
  PM__ENGINE_CALL(event_synchronize(e));
}
static inline pm_status_t pm__cb_stream_synchronize(pm_stream_t s) {
  PM__ENGINE_CALL(stream_synchronize(s));
}
static inline pm_status_t pm__cb_stream_query(pm_stream_t s) { PM__ENGINE_CALL(stream_query(s)); }
static inline pm_status_t pm__cb_stream_wait_event(pm_stream_t s, pm_event_t e) {
  PM__ENGINE_CALL(stream_wait_event(s, e));
}
static inline pm_status_t pm__cb_launch_host_func(pm_stream_t s, void (*fn)(void *), void *arg) {
  PM__ENGINE_CALL(launch_host_func(s, fn, arg));
}

#endif /* PINMEM_COPY_INTERNAL_H */
