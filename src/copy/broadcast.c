/*
 * DESIGN: pm_copy_broadcast_async, one host buffer to the memory of several devices (the same
 * weights or batch on every GPU of a process).
 *
 * Pinned source: one DMA per destination (pm_copy_async's direct path), each queued with its
 * destination's device current, so the DMA runs on that device's copy engine and its fence's
 * event belongs to that device. Pageable source: the host memory is read once, not once per
 * device: each chunk is copied (by copy_threads threads) into a pinned slot, and the slot is
 * DMA'd to every destination on its own stream; a slot is refilled only after every DMA that
 * read it completed (one event per slot and destination, created and recorded on that
 * destination's device). Pool blocks are portable, so one slot feeds every device.
 *
 * Completion: one fence per destination (fences_out[i]); options->callback is refused (one
 * callback per destination, with a fence each, would be a callback per device where one was
 * asked for: wait on the fences instead). A pageable source returns once every DMA completed (the
 * slots go back to the pool then: no stream-ordered reuse is needed across devices), so it also
 * waits for the streams' earlier work. On a failure part way, every DMA already queued is waited
 * for (each stream that got one is synchronized on its device) before the slots go back, and no
 * fence is returned; a pinned source's earlier destinations are waited for alike (their fences).
 *
 * The caller's current device is restored before the call returns, and a thread that had none
 * (cuda: no current context) is left with none, not with device 0's context. No lock of its
 * own.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "copy_internal.h"

#define PM__BCAST_MAX 64 /* destinations of one call */
#define PM__BCAST_SLOTS 4

typedef struct bcast {
  int count;
  void *const *dsts;
  const pm_stream_t *streams;
  int dev[PM__BCAST_MAX];
  pm_fence_t fence[PM__BCAST_MAX];
  bool queued[PM__BCAST_MAX]; /* a DMA of this destination was queued */
  int caller;                 /* the caller's device: the destinations' where devices is NULL */
  int binding;                /* what the caller gets back at the end (pm__device_binding) */
} bcast_t;

static void enter(int device) {
  if (device >= 0) pm__thread_set_device(device);
}

static pm_status_t check_args(const char *fn, const pm__backend_t *b, const void *src, size_t bytes,
                              void *const *dsts, const pm_stream_t *streams, const int *devices,
                              int count, bcast_t *c) {
  if (!src) return pm__set_error(PM_ERR_INVALID, "%s: src is NULL", fn);
  if (!dsts || !streams)
    return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn, !dsts ? "dsts" : "streams");
  if (count < 1 || count > PM__BCAST_MAX)
    return pm__set_error(PM_ERR_INVALID, "%s: count %d is not in 1..%d", fn, count, PM__BCAST_MAX);
  if ((uintptr_t)src + bytes < (uintptr_t)src)
    return pm__set_error(PM_ERR_INVALID, "%s: the %zu-byte source wraps the address space", fn,
                         bytes);
  int ndev = 0;
  pm_status_t st = b->device_count(&ndev);
  if (st != PM_OK) return st;
  for (int i = 0; i < count; i++) {
    c->dev[i] = devices ? devices[i] : c->caller;
    if (c->dev[i] < 0 || c->dev[i] >= ndev)
      return pm__set_error(PM_ERR_INVALID, "%s: devices[%d] is %d, not a device (0..%d)", fn, i,
                           c->dev[i], ndev - 1);
    if (!dsts[i]) return pm__set_error(PM_ERR_INVALID, "%s: dsts[%d] is NULL", fn, i);
    /* A stream of another device would get this destination's DMA and events with its device
     * current: the driver refuses the event record part way, after other DMAs were queued.
     * NULL is devices[i]'s default stream (queued with it current). Asked with devices[i]
     * current, as it will be at the queueing: a handle that names the current device's default
     * stream (cuda's legacy and per-thread handles) is devices[i]'s then. The caller's device
     * is restored at the end of the call, as after the queueing. */
    if (streams[i]) enter(c->dev[i]);
    int sdev = pm__backend_stream_other_device(b, streams[i], c->dev[i]);
    if (sdev >= 0)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: streams[%d] is a stream of device %d, but its copy goes to device "
                           "%d (devices[%d]%s)",
                           fn, i, sdev, c->dev[i], i,
                           devices ? "" : ": devices is NULL, so the caller's device");
    if (bytes == 0) continue;
    pm__mem_t kind;
    uintptr_t base;
    size_t size;
    st = pm__classify(b, dsts[i], bytes, "destination", &kind, &base, &size);
    if (st != PM_OK) return pm__wrap_error(st, "%s: dsts[%d]", fn, i);
    if (kind != PM__MEM_DEVICE && kind != PM__MEM_MANAGED)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: dsts[%d] %p is %s, not device memory (a broadcast goes from the "
                           "host to devices)",
                           fn, i, dsts[i], pm__mem_name(kind));
    /* Memory of another device would be written through devices[i]'s copy engine, with its
     * fence on that device: not the destination's own DMA that the call promises (and a rule
     * break under CUDA's model). Both ends are checked; managed memory answers -1. */
    int other = pm__backend_other_device(b, dsts[i], (const char *)dsts[i] + bytes - 1, c->dev[i]);
    if (other >= 0)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: dsts[%d] %p is memory of device %d, but its copy goes to device "
                           "%d (devices[%d]%s)",
                           fn, i, dsts[i], other, c->dev[i], i,
                           devices ? "" : ": devices is NULL, so the caller's device");
    if (pm__ranges_overlap(dsts[i], src, bytes))
      return pm__set_error(PM_ERR_INVALID, "%s: dsts[%d] overlaps the source", fn, i);
    /* Two destinations that share bytes get two concurrent writes there: which one lands
     * would be undefined. (count <= PM__BCAST_MAX: pairs are few.) */
    for (int j = 0; j < i; j++)
      if (pm__ranges_overlap(dsts[i], dsts[j], bytes))
        return pm__set_error(PM_ERR_INVALID, "%s: dsts[%d] and dsts[%d] overlap", fn, j, i);
  }
  return PM_OK;
}

/* With destination i's device current: the fence is complete once the DMAs queued so far on
 * its stream are (its event is recorded there); a callback is queued behind it. */
static pm_status_t fence_finish(pm_fence_t f, pm_stream_t stream) {
  f->host = false;
  atomic_init(&f->refs, 1); /* the caller's handle (released at once without fences_out) */
  return pm__cb_event_record(f->event, stream);
}

/* ---- the staged path: slots read by every destination ---- */

typedef struct fill {
  char *dst;
  const char *src;
  size_t n, piece;
} fill_t;

static void fill_piece(void *ctx, size_t i) {
  fill_t *f = ctx;
  size_t off = i * f->piece;
  memcpy(f->dst + off, f->src + off, PM__MIN(f->piece, f->n - off));
}

static pm_status_t staged(const char *fn, bcast_t *c, const char *src, size_t bytes,
                          const pm_copy_options_t *opt) {
  pm__copy_cfg_t cfg;
  pm__copy_cfg(&cfg);
  size_t chunk = PM__MIN(cfg.chunk, bytes);
  size_t nchunks = pm__div_up(bytes, chunk);
  int nslots = (int)PM__MIN((size_t)PM__BCAST_SLOTS, nchunks);
  void *slot[PM__BCAST_SLOTS] = {NULL};
  pm_event_t *ev = calloc((size_t)nslots * (size_t)c->count, sizeof *ev); /* [slot][dest] */
  bool used[PM__BCAST_SLOTS] = {false};
  pm_status_t st = ev ? PM_OK : pm__set_error(PM_ERR_NOMEM, "%s: events", fn);
  for (int k = 0; k < nslots && st == PM_OK; k++)
    st = pm_host_alloc(opt->pool, chunk, PM_HOST_PORTABLE, &slot[k]);
  for (int i = 0; i < c->count && st == PM_OK; i++) {
    enter(c->dev[i]); /* each event belongs to its destination's device */
    for (int k = 0; k < nslots && st == PM_OK; k++)
      st = pm__cb_event_create(PM_EVENT_DEFAULT, &ev[k * c->count + i]);
  }

  size_t off = 0;
  for (size_t ch = 0; ch < nchunks && st == PM_OK; ch++, off += chunk) {
    int k = (int)(ch % (size_t)nslots);
    size_t n = PM__MIN(chunk, bytes - off);
    for (int i = 0; i < c->count && used[k] && st == PM_OK; i++) {
      enter(c->dev[i]);
      st = pm__cb_event_synchronize(ev[k * c->count + i]);
    }
    if (st != PM_OK) break;
    size_t piece = PM__MAX(n / (size_t)PM__MAX(cfg.threads, 1), (size_t)65536);
    fill_t f = {slot[k], src + off, n, piece};
    pm__parallel_for(cfg.threads, (n + piece - 1) / piece, fill_piece, &f);
    for (int i = 0; i < c->count && st == PM_OK; i++) {
      enter(c->dev[i]);
      st = pm__cb_memcpy_async((char *)c->dsts[i] + off, slot[k], n, PM_COPY_H2D, c->streams[i]);
      if (st == PM_OK) c->queued[i] = true;
      if (st == PM_OK) st = pm__cb_event_record(ev[k * c->count + i], c->streams[i]);
    }
    used[k] = true;
  }
  /* Every DMA that was queued completes before its slot goes back (success or not). */
  char msg[512] = "";
  if (st != PM_OK) snprintf(msg, sizeof msg, "%s", pm_last_error());
  for (int i = 0; i < c->count; i++) {
    if (!c->queued[i]) continue;
    enter(c->dev[i]);
    pm_status_t w = pm__cb_stream_synchronize(c->streams[i]);
    if (w != PM_OK && st == PM_OK) {
      st = w;
      snprintf(msg, sizeof msg, "%s", pm_last_error());
    }
  }
  if (st == PM_OK)
    for (int i = 0; i < c->count && st == PM_OK; i++) {
      enter(c->dev[i]);
      st = fence_finish(c->fence[i], c->streams[i]);
      if (st != PM_OK) snprintf(msg, sizeof msg, "%s", pm_last_error());
    }
  for (int i = 0; i < c->count && ev; i++) {
    enter(c->dev[i]);
    for (int k = 0; k < nslots; k++)
      if (ev[k * c->count + i]) (void)pm__cb_event_destroy(ev[k * c->count + i]);
  }
  free(ev);
  for (int k = 0; k < nslots; k++)
    if (slot[k]) (void)pm_host_free(slot[k]);
  if (st != PM_OK) return pm__set_error(st, "%s: %s", fn, msg);
  return PM_OK;
}

pm_status_t pm_copy_broadcast_async(const void *src, size_t bytes, void *const *dsts,
                                    const pm_stream_t *streams, const int *devices, int count,
                                    const pm_copy_options_t *options, pm_fence_t *fences_out) {
  static const char fn[] = "pm_copy_broadcast_async";
  pm_copy_options_t opt;
  if (options) {
    opt = *options;
    if (opt.kind != PM_COPY_DEFAULT && opt.kind != PM_COPY_H2D)
      return pm__set_error(PM_ERR_INVALID, "%s: options->kind must be PM_COPY_DEFAULT or H2D", fn);
    if (opt.path == PM_PATH_REGISTER || (unsigned)opt.path > PM_PATH_REGISTER)
      return pm__set_error(PM_ERR_INVALID, "%s: options->path %d is not auto, direct or staged", fn,
                           (int)opt.path);
    if (opt.callback)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: options->callback is not taken (it would run once per "
                           "destination): wait on fences_out instead",
                           fn);
  } else {
    pm_copy_options_init(&opt);
  }
  PM__BACKEND_OR_RETURN(b);
  bcast_t *c = calloc(1, sizeof *c);
  if (!c) return pm__set_error(PM_ERR_NOMEM, "%s: out of memory", fn);
  /* Read without fault injection, as pm__thread_device reads it: bookkeeping, not a call the
   * user asked for. A thread with no device works on device 0, as under CUDA's runtime, and
   * gets none back. */
  const pm__backend_t *raw = pm__backend_raw();
  if (!raw || pm__device_binding(raw, &c->binding) != PM_OK) c->binding = PM__DEVICE_KEEP;
  c->caller = c->binding == PM__DEVICE_NONE ? 0 : c->binding; /* -1 (KEEP): unknown */
  if (c->binding >= 0) pm__devices_used_mark(c->binding);
  c->count = count;
  c->dsts = dsts;
  c->streams = streams;
  pm_status_t st = check_args(fn, b, src, bytes, dsts, streams, devices, count, c);
  pm__mem_t skind = PM__MEM_PAGEABLE;
  if (st == PM_OK && bytes) {
    uintptr_t base;
    size_t size;
    st = pm__classify(b, src, bytes, "source", &skind, &base, &size);
    if (st != PM_OK) pm__wrap_error(st, "%s", fn);
  }
  bool direct = skind != PM__MEM_PAGEABLE && skind != PM__MEM_PINNED_PART;
  if (opt.path == PM_PATH_STAGED) direct = false;
  if (opt.path == PM_PATH_DIRECT) direct = true;
  if (st == PM_OK && (direct || bytes == 0)) {
    /* One pm_copy_async per destination, on its device. */
    opt.kind = PM_COPY_H2D;
    opt.path = bytes ? PM_PATH_DIRECT : PM_PATH_AUTO;
    int i = 0;
    for (; i < count && st == PM_OK; i++) {
      enter(c->dev[i]);
      st = pm_copy_async(dsts[i], src, bytes, streams[i], &opt, &c->fence[i]);
      if (st != PM_OK) st = pm__wrap_error(st, "%s: destination %d", fn, i);
    }
    /* Destinations 0..i-2 got their DMA: each completes before the error returns (the caller
     * may then free or refill src, as the contract says; a released fence's copy would still
     * read it). */
    if (st != PM_OK) {
      char msg[512];
      snprintf(msg, sizeof msg, "%s", pm_last_error());
      for (int j = 0; j < i - 1; j++) {
        enter(c->dev[j]);
        (void)pm_fence_wait(c->fence[j]);
        (void)pm_fence_release(c->fence[j]);
      }
      pm__set_error(st, "%s", msg);
    }
  } else if (st == PM_OK) {
    for (int i = 0; i < count && st == PM_OK; i++) {
      enter(c->dev[i]); /* the fence's event and completion belong to its destination's device */
      st = pm__fence_new(PM_PATH_STAGED, true, &opt, &c->fence[i]);
    }
    if (st == PM_OK) st = staged(fn, c, src, bytes, &opt);
    if (st == PM_OK)
      for (int i = 0; i < count && st == PM_OK; i++) st = pm__fence_live_add(c->fence[i]);
    if (st != PM_OK) {
      char msg[512];
      snprintf(msg, sizeof msg, "%s", pm_last_error());
      for (int i = 0; i < count; i++)
        if (c->fence[i]) {
          pm__fence_live_remove(c->fence[i]);
          pm__fence_free(c->fence[i]);
        }
      pm__set_error(st, "%s", msg);
    }
  }
  if (c->binding >= 0) enter(c->binding);
  if (st == PM_OK) {
    for (int i = 0; i < count; i++) {
      if (fences_out)
        fences_out[i] = c->fence[i];
      else
        (void)pm_fence_release(c->fence[i]);
    }
  }
  /* A thread that had no device is left with none after the releases too: a release that
   * needs a context finds the last destination's current, not device 0's made for it. */
  if (c->binding == PM__DEVICE_NONE) pm__device_put_back(raw, PM__DEVICE_NONE);
  free(c);
  return st;
}
