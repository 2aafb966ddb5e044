/*
 * The loader's private header: the slot and loader types, their constants, and the calls between
 * loader.c, loader_fill.c and loader_deliver.c; nothing outside src/loader/loader*.c includes it.
 * The design, the invariants and the lock order are in loader.c's DESIGN comment. Calls go one
 * way: loader_deliver.c -> loader.c -> loader_fill.c, and loader_deliver.c -> loader_fill.c.
 * Every *_locked call is made with mu held.
 */
#ifndef PINMEM_LOADER_INTERNAL_H
#define PINMEM_LOADER_INTERNAL_H

#include <pthread.h>

#include "internal.h"

#define LOADER_MAGIC 0x4c4f4144u /* "LOAD" */
#define MAX_WORKERS PM__LOADER_MAX_WORKERS
#define MAX_SLOTS PM__MAX_SLOTS
#define MAX_PARTS 1024 /* parts of a slot's copy (each has two timing events) */
#define TARGET_ALIGN ((size_t)256)

enum { SLOT_FREE, SLOT_OPENING, SLOT_FILLING, SLOT_READY, SLOT_HELD, SLOT_RELEASING, SLOT_GONE };

typedef struct worker_arg { /* what a worker thread starts with: its loader and its index */
  pm_loader_t *L;
  int index;
} worker_arg_t;

typedef struct slot {
  int state;
  uint64_t seq;                  /* global batch number (not FREE) */
  uint64_t rows, claimed, done;  /* rows of the batch, claimed and completed by workers */
  uint64_t rows_ready;           /* rows 0..rows_ready-1 are all written */
  unsigned char *chunk_done;     /* per claim (rows_per_claim rows): written */
  uint32_t nparts, parts_queued; /* parts of this batch's copy; queued on the copy stream */
  uint32_t nruns; /* runs of parts queued (ev_copy[2i], ev_copy[2i + 1] around run i) */
  bool failed;
  bool copy_pending;    /* ev_done recorded and its time not yet counted */
  bool release_pending; /* ev_release recorded since the last copy into dev */
  unsigned char *host;
  unsigned char *dev;
  uint64_t *indices;
  pm_batch_field_t *bf; /* nfields entries: the batch's arrays in this slot */
  pm_event_t *ev_copy;  /* 2 * max_parts timing events: start and end of each run of parts */
  pm_event_t ev_done;   /* the end event of the last run: the batch's copy is done */
  pm_event_t ev_release;
} slot_t;

/* A slot a held batch keeps after the ring took a new one in its place (lease_slots). */
typedef struct orphan {
  slot_t s;
  struct orphan *next;
} orphan_t;

struct pm_loader_s {
  unsigned magic;
  pm_dataset_t *ds;
  pm__sampler_t sampler;
  pm_loader_config_t cfg;
  int nfields;
  pm_field_t finfo[PM_MAX_FIELDS];                   /* the dataset's fields (a copy) */
  size_t fbytes[PM_MAX_FIELDS], foff[PM_MAX_FIELDS]; /* a row of field k; its offset in a slot */
  size_t slot_bytes;
  size_t piece;       /* bytes of a part of a slot's copy; 0: one copy of the whole slot */
  uint32_t max_parts; /* parts of a full batch's copy */
  uint64_t rows_per_claim;
  int nslots, nworkers, started;
  bool rows_reads; /* the dataset reads runs of rows: one read_rows call per claim */
  bool ordered;    /* cfg.ordered_workers: claim k goes to worker k % nworkers */
  slot_t *slots;
  uint64_t rows_max; /* rows of a slot */
  orphan_t *orphans; /* guarded by mu: held batches whose slot the ring replaced */
  pthread_t *threads;
  worker_arg_t *wargs;
  pm_stream_t copy_stream;
  bool device, pinned;
  int device_index;
  uint64_t end_g; /* UINT64_MAX: no end */
  atomic_bool stop_flag;

  pthread_mutex_t mu;
  pthread_cond_t work_cv, ready_cv;
  pthread_mutex_t submit_mu;
  /* guarded by mu */
  uint64_t fill_g, deliver_g;
  uint64_t sub_g;  /* the batch whose parts are queued next (pinned device delivery) */
  bool submitting; /* a worker is queueing parts outside mu */
  uint64_t claims; /* claims of rows taken since the loader started */
  pthread_cond_t *turn_cv; /* ordered: one per worker, signalled when its turn comes */
  int held;
  bool stop, in_next;
  bool destroyed; /* pm_loader_destroy ran; held slots are freed by their release */
  bool torn_down; /* ... and has finished: the last release frees the loader */
  uint64_t err_g;
  pm_status_t err;
  uint64_t err_sample; /* the dataset index whose read made err, PM__NO_SAMPLE if none */
  char err_msg[512];
  pm_loader_stats_t st;
};

/* ---- loader_fill.c -------------------------------------------------------------------------- */

/* Bytes of a slot's copy for a batch of `rows` rows: every field up to the last one's rows. */
size_t pm__loader_copy_bytes(const pm_loader_t *L, uint64_t rows);
/* Parts of the copy of a batch of `rows` rows. */
uint32_t pm__loader_part_count(const pm_loader_t *L, uint64_t rows);
/* Wake every worker (a stop or an error concerns them all). */
void pm__loader_wake_workers_locked(pm_loader_t *L);
/* Record the first error by batch order: batch g failed with st and msg (sample: the dataset
 * index whose read failed, PM__NO_SAMPLE when not one sample's read). */
#define PM__NO_SAMPLE UINT64_MAX
void pm__loader_set_error_locked(pm_loader_t *L, uint64_t g, pm_status_t st, const char *msg,
                                 uint64_t sample);
/* Add the device time of a slot's copy (its runs of parts) to *acc. */
void pm__loader_add_copy_time(pm_loader_t *L, slot_t *s, double *acc);
/* Queue parts p0..p1-1 of a slot's copy on the copy stream, by the party that owns the slot's
 * submission. */
pm_status_t pm__loader_queue_parts(pm_loader_t *L, slot_t *s, uint32_t p0, uint32_t p1,
                                   const char *what);
/* A worker thread; arg is its worker_arg_t. */
void *pm__loader_worker_main(void *arg);

/* ---- loader.c ------------------------------------------------------------------------------- */

/* Free a slot's buffers and events (after the consumer's stream is past its release). */
void pm__loader_free_slot(pm_loader_t *L, slot_t *s);
/* A new FREE slot's buffers, events and field table (backend calls: not under mu). */
pm_status_t pm__loader_alloc_slot(pm_loader_t *L, slot_t *s);
/* The last of a loader: stop the workers, free the slots, the stream, the locks, the handle. */
void pm__loader_free(pm_loader_t *L);
/* PM_OK for a live loader not yet destroyed; else an error naming fn. */
pm_status_t pm__loader_check(const char *fn, pm_loader_t *L);

#endif
