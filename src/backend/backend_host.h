/*
 * The host backend's two halves, and what they share (internal to the backend; the contract is
 * backend.h). backend_host_memory.c: pinned memory (mlock), device and managed memory and their
 * tables, the one "device". backend_host_stream.c: the engine, streams as threads running queues
 * of ops. backend_host_event.c: events. backend_host_ops.c: copies, the timed busy kernel, host
 * functions, and the backend table that joins them all. The stream side calls the memory half,
 * never the reverse.
 */
#ifndef PINMEM_BACKEND_HOST_H
#define PINMEM_BACKEND_HOST_H

#include <pthread.h>

#include "internal.h"

enum { R_PIN_ALLOC, R_PIN_REGISTER, R_DEVICE, R_MANAGED };

typedef struct hb_range {
  uintptr_t base;
  size_t size; /* R_PIN_ALLOC: page-rounded mapping; others: the bytes asked for */
  unsigned char kind;
  bool pending;       /* registration whose mlock has not finished: not pinned yet */
  signed char device; /* R_DEVICE: the device it belongs to; pinned ranges: the device current
                       * at pinning unless PORTABLE (-1: every device's); managed: -1 */
} hb_range_t;

typedef struct hb_side {
  pm__mem_t kind; /* PM__MEM_DEVICE or _MANAGED (device table), _PINNED (the whole span in one
                   * pinned range) or _PAGEABLE */
  bool fits;      /* device table: the whole span lies in that allocation */
  hb_range_t dev;
  int pin_device; /* _PINNED: the one device it is pinned for, or -1 (PORTABLE) */
} hb_side_t;

static inline bool hb_in_dev(const hb_side_t *sd) {
  return sd->kind == PM__MEM_DEVICE || sd->kind == PM__MEM_MANAGED;
}

/* ---- backend_host_memory.c ------------------------------------------------------------------ */

/* The backend contract's memory calls (backend.h has their meaning). */
pm_status_t pm__hb_host_alloc(size_t bytes, unsigned flags, void **ptr_out);
pm_status_t pm__hb_host_free(void *ptr, size_t bytes);
pm_status_t pm__hb_host_register(void *ptr, size_t bytes, unsigned flags);
pm_status_t pm__hb_host_unregister(void *ptr, size_t bytes);
pm_status_t pm__hb_host_device_pointer(void *host_ptr, void **dptr_out);
pm_status_t pm__hb_device_alloc(size_t bytes, void **dptr_out);
pm_status_t pm__hb_managed_alloc(size_t bytes, void **ptr_out);
int pm__hb_pointer_kind(const void *ptr);
int pm__hb_pointer_device(const void *ptr);
pm_status_t pm__hb_device_count(int *count_out);
pm_status_t pm__hb_device_info(int device, pm_device_info_t *info_out);
pm_status_t pm__hb_set_device(int device);
pm_status_t pm__hb_get_device(int *device_out);

/* The simulated devices (option host_devices) and their call records: see the memory file's
 * DESIGN comment; the query side is in internal.h. */
void pm__hb_devices_start(void); /* at backend start: read host_devices */
int pm__hb_current(void);        /* this thread's current device */
void pm__hb_count_call(void);    /* a call that needs a context, on the current device */
/* A call CUDA refuses, or runs on another device than meant; the text says which. */
void pm__hb_mismatch(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* PM_ERR_INVALID unless 0 <= device < host_devices. */
pm_status_t pm__hb_check_device(const char *fn, int device);

/* Free the device or managed allocation that starts at ptr (the caller synchronized first). */
pm_status_t pm__hb_device_release(const char *fn, void *ptr);
/* [ptr, ptr+bytes) must lie in one device-table range (of `kind`, or any kind if kind < 0). */
pm_status_t pm__hb_check_device_span(const char *fn, const char *what, const void *ptr,
                                     size_t bytes, int kind);
/* Both sides of a copy, classified under one hold of the memory lock. */
void pm__hb_classify(const void *dst, const void *src, size_t bytes, hb_side_t *d, hb_side_t *s);
/* "pinned allocation", "registration", ...: a range's kind in messages. */
const char *pm__hb_range_desc(unsigned kind);
void pm__hb_memory_shutdown(void);
void pm__hb_memory_atfork(pm__fork_phase_t phase);

/* ---- backend_host_stream.c: the engine that backend_host_event.c and _ops.c queue onto ----- */

/* One record of an event. Every field is guarded by pm__hb_rec_lock. */
typedef struct hb_rec {
  int refs;
  bool done;
  double t_done; /* CLOCK_MONOTONIC seconds */
} hb_rec_t;

typedef enum {
  OP_COPY,
  OP_MEMSET,
  OP_BUSY,
  OP_RECORD,
  OP_WAIT,
  OP_HOST_FUNC,
  OP_PREFETCH,
  OP_GATE,
  OP_BATCH
} hb_op_kind_t;

typedef struct hb_op {
  struct hb_op *next;
  hb_op_kind_t kind;
  union {
    struct {
      void *dst;
      const void *src;
      size_t bytes;
    } copy;
    struct {
      void *dst;
      int value;
      size_t bytes;
    } set;
    double seconds;
    hb_rec_t *rec; /* OP_RECORD, OP_WAIT: one reference held by the op */
    struct {
      void (*fn)(void *);
      void *arg;
    } func;
    struct {
      bool reached, released; /* guarded by the stream's mu */
    } gate;
    struct {
      const pm__copy_desc_t *desc; /* stored after the op, in the same allocation */
      size_t count;
    } batch;
  } u;
} hb_op_t;

struct pm_stream_s {
  pthread_mutex_t mu;
  pthread_cond_t cv_work;  /* to the worker: an op was queued, closing, a gate was released */
  pthread_cond_t cv_state; /* from the worker: an op finished, a gate was reached, users fell */
  hb_op_t *head, *tail;
  uint64_t submitted, done;
  int users;    /* callers waiting on this stream without pm__hb_obj_lock */
  bool closing; /* the worker exits once the queue is empty */
  int device;   /* current at its creation; never changes */
  pthread_t thread;
};

struct pm_event_s {
  unsigned flags;
  int device;       /* current at its creation; never changes */
  hb_rec_t *latest; /* guarded by pm__hb_rec_lock; NULL until the first record */
};

/* A sorted set of live handles. */
typedef struct hb_set {
  uintptr_t *v;
  size_t n, cap;
} hb_set_t;

/* Locks and handle sets; the lock order is in backend_host_stream.c's DESIGN comment. */
extern pthread_mutex_t pm__hb_obj_lock; /* the handle sets and the default stream */
extern pthread_mutex_t pm__hb_rec_lock; /* every record's fields and each event's latest */
extern pthread_cond_t pm__hb_rec_cv;    /* some record completed */
extern hb_set_t pm__hb_stream_set, pm__hb_event_set;

/* With pm__hb_rec_lock held: drop a reference to a record (NULL allowed). */
void pm__hb_rec_unref_locked(hb_rec_t *r);
bool pm__hb_set_has(const hb_set_t *s, const void *p);
/* Add a new stream or event to its handle set, under pm__hb_obj_lock. */
pm_status_t pm__hb_set_publish(hb_set_t *set, const void *p);
/* With pm__hb_obj_lock held: ev is a live event. */
pm_status_t pm__hb_event_lookup_locked(const char *fn, pm_event_t ev);
void pm__hb_set_del(hb_set_t *s, const void *p);
/* True on the stream's own worker thread (a host function running on it). */
bool pm__hb_on_own_worker(const struct pm_stream_s *s);
/* With pm__hb_obj_lock held: the stream behind a handle. NULL is the default stream, created
 * here on first use when `create` (otherwise *out is NULL while it does not exist yet). */
pm_status_t pm__hb_stream_lookup_locked(const char *fn, pm_stream_t h, bool create,
                                        struct pm_stream_s **out);
/* With pm__hb_obj_lock held: take the stream's lock, then drop obj_lock. */
void pm__hb_stream_enter(struct pm_stream_s *s);
/* With the stream's mu held: queue op and wake the worker. */
void pm__hb_enqueue_locked(struct pm_stream_s *s, hb_op_t *op);
/* With the stream's mu held: the caller stops counting as a user of the stream. */
void pm__hb_user_leave_locked(struct pm_stream_s *s);
/* The device of stream h (NULL: the current device's default stream), or -1 if h is no live
 * stream. For the mismatch records only. */
int pm__hb_stream_device(pm_stream_t h);
/* Wait for the queued work of every stream of `device` (-1: of every device). */
pm_status_t pm__hb_sync_streams(const char *fn, int device);
/* Take pm__hb_obj_lock and find the stream behind h (the default stream is created on first
 * use), after checking ev when it is not NULL. On success pm__hb_obj_lock is held (hand it to
 * pm__hb_queue or pm__hb_stream_enter); on failure it is not, and op (may be NULL) is freed. */
pm_status_t pm__hb_stream_find(const char *fn, pm_stream_t h, pm_event_t ev, hb_op_t *op,
                               struct pm_stream_s **out);
/* With pm__hb_obj_lock held (pm__hb_stream_find): queue op on s and drop every lock. */
void pm__hb_queue(struct pm_stream_s *s, hb_op_t *op);
/* Queue op on the stream; on failure the op is freed. */
pm_status_t pm__hb_submit(const char *fn, pm_stream_t h, hb_op_t *op);
/* A zeroed op of `kind`, or NULL with PM_ERR_NOMEM's detail set. */
hb_op_t *pm__hb_op_new(const char *fn, hb_op_kind_t kind);

/* The contract's stream, device and lifecycle calls (backend.h has their meaning). */
pm_status_t pm__hb_init(void);
void pm__hb_shutdown(void);
pm_status_t pm__hb_device_synchronize(void);
pm_status_t pm__hb_stream_create(pm_stream_t *stream_out);
pm_status_t pm__hb_stream_destroy(pm_stream_t h);
pm_status_t pm__hb_stream_synchronize(pm_stream_t h);
pm_status_t pm__hb_stream_query(pm_stream_t h);

/* ---- backend_host_event.c: the contract's event calls ---------------------------------------- */

pm_status_t pm__hb_stream_wait_event(pm_stream_t h, pm_event_t ev);
pm_status_t pm__hb_event_create(unsigned flags, pm_event_t *event_out);
pm_status_t pm__hb_event_destroy(pm_event_t ev);
pm_status_t pm__hb_event_record(pm_event_t ev, pm_stream_t h);
pm_status_t pm__hb_event_query(pm_event_t ev);
pm_status_t pm__hb_event_synchronize(pm_event_t ev);
pm_status_t pm__hb_event_elapsed(pm_event_t start, pm_event_t end, double *seconds_out);

#endif /* PINMEM_BACKEND_HOST_H */
