/*
 * DESIGN: the copy engine's front: pm_copy_async, pm_copy_batch_async, options and path choice.
 *
 * Path choice. The registry says what each host pointer is (pm__pointer_info); for an address
 * it does not track, the backend (pointer_kind: device memory of another allocator, or host
 * memory another library pinned). Pinned, registered or managed host memory, whoever pinned it,
 * and device memory take the direct path: one backend copy on the caller's stream and
 * nothing else, unless a fence or a callback was asked for (then one event, plus one host
 * function for a callback). Pageable host memory of at least copy_stage_min bytes
 * is staged (copy_stage.c); smaller pageable copies take the plain backend copy, whose fixed
 * costs are lower than staging's. options->path forces a path.
 *
 * What each path blocks on: direct: nothing. Staged H2D: until the source was read (it may be
 * changed after the return), never on the stream's earlier work (ring, chosen by copy_bounce or
 * forced by the budget: the call also waits for reused slots' DMAs, hence for the stream).
 * Staged D2H through the whole block (copy_bounce=whole, or auto behind queued work): nothing;
 * a completion thread copies the bytes out once their DMAs land, and the stream's later work
 * waits for that. Through the ring (ring, or auto on an idle stream, the default): the whole
 * copy happens inside the call, which returns with the bytes in dst. Plain pageable copies
 * block as the backend's own copy does.
 *
 * Layer: the top of the copy engine. It classifies each pointer once (classify.c), then calls
 * down: staging (copy_stage.c), fences and their set-up (fence.c), plain and batched backend
 * copies (copy_batch.c) and the backend contract, never the public front door (api.c).
 *
 * Lock order: this file holds no lock of its own; see fence.c and completion.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "copy_internal.h"


/* ---- options -------------------------------------------------------------------------------- */

/* The defaults and ranges are the option table's (config.c): 4 MiB chunks, 32 slots,
 * min(12, cores) threads, 8 MiB: staging loses to the plain pageable copy at 1 MiB and wins
 * from 8 MiB, and with slots filled in pieces 12 threads do as well as 16 while leaving cores
 * to the driver and the caller (the figures are in docs/performance.md). A lookup is an atomic
 * load of the cached value, cheap next to even a small copy's DMA. */
void pm__copy_cfg(pm__copy_cfg_t *cfg) {
  size_t chunk = pm__opt_size(PM__OPT_COPY_CHUNK);
  long slots = pm__opt_int(PM__OPT_COPY_SLOTS);
  if (chunk < 4096) chunk = 4096;
  cfg->chunk = chunk;
  cfg->slots = (int)slots;
  cfg->threads = (int)pm__opt_int(PM__OPT_COPY_THREADS);
  cfg->stage_min = pm__opt_size(PM__OPT_COPY_STAGE_MIN);
  cfg->bounce = (int)pm__opt_int(PM__OPT_COPY_BOUNCE);
  cfg->mover = (int)pm__opt_int(PM__OPT_COPY_MEMCPY);
  cfg->ramp = pm__opt_int(PM__OPT_COPY_RAMP) != 0;
  size_t piece = pm__opt_size(PM__OPT_COPY_PIECE);
  if (piece && piece < 4096) piece = 4096;
  /* A piece as large as a slot is the plain ring. The option table refuses such a pair where
   * a value comes in; the default piece with a small chunk still gets here. */
  cfg->piece = piece < chunk ? piece : 0;
  long piece_slots = pm__opt_int(PM__OPT_COPY_PIECE_SLOTS);
  cfg->piece_slots = piece_slots > 0 ? (int)piece_slots : (int)slots;
}

void pm_copy_options_init(pm_copy_options_t *options) {
  if (!options) return;
  memset(options, 0, sizeof *options);
  options->kind = PM_COPY_DEFAULT;
  options->path = PM_PATH_AUTO;
}

/* ---- validation and classification ---------------------------------------------------------- */

/* Where an error happened: "pm_copy_async" or "pm_copy_batch_async: item 7". */
typedef struct where {
  const char *fn;
  size_t item; /* SIZE_MAX: not a batch */
} where_t;

static const char *where_str(where_t w, char *buf, size_t len) {
  if (w.item == SIZE_MAX)
    snprintf(buf, len, "%s", w.fn);
  else
    snprintf(buf, len, "%s: item %zu", w.fn, w.item);
  return buf;
}


/* The last tracked range a lookup hit: consecutive batch items mostly fall in the same block. */
typedef struct qcache {
  bool valid;
  uintptr_t base;
  size_t size;
  pm__mem_t kind;
} qcache_t;

/* The base of the tracked range in `cache` (the last one classify found) when it holds
 * [p, p + bytes), else 0 (memory pinmem does not track). */
static uintptr_t in_range(const qcache_t *cache, const void *p, size_t bytes) {
  uintptr_t a = (uintptr_t)p;
  if (cache->valid && a >= cache->base && a - cache->base <= cache->size &&
      bytes <= cache->size - (a - cache->base))
    return cache->base;
  return 0;
}

static pm_status_t classify(const pm__backend_t *b, const void *p, size_t bytes, const char *name,
                            where_t w, qcache_t *cache, pm__mem_t *out) {
  char wb[96];
  if (cache && in_range(cache, p, bytes)) {
    *out = cache->kind;
    return PM_OK;
  }
  uintptr_t base;
  size_t size;
  pm_status_t st = pm__classify(b, p, bytes, name, out, &base, &size);
  if (st != PM_OK) return pm__wrap_error(st, "%s", where_str(w, wb, sizeof wb));
  if (size && cache) {
    cache->valid = true;
    cache->base = base;
    cache->size = size;
    cache->kind = *out;
  }
  return PM_OK;
}

/* Whether a batch item continues `op` on both sides, so the two move as one DMA. Not when the
 * joined copy would overlap itself: items that chain (the second reads what the first writes)
 * are two copies, and one memmove of both would give neither's result. The caller also keeps
 * pieces of different tracked ranges apart, so each DMA stays within one allocation and the
 * checks downstream see the items as given. */
static bool can_join(const pm_copy_item_t *op, const pm_copy_item_t *it) {
  if ((const char *)op->src + op->bytes != it->src || (char *)op->dst + op->bytes != it->dst)
    return false;
  return !pm__ranges_overlap(op->dst, op->src, op->bytes + it->bytes);
}

static bool can_host(pm__mem_t k) {
  return k != PM__MEM_DEVICE;
}
static bool can_dev(pm__mem_t k) {
  return k == PM__MEM_DEVICE || k == PM__MEM_MANAGED;
}
/* Memory a kernel can read (src) or write (dst) where it is (pinned host memory: where the
 * backend says so). Read-only registrations are never a kernel's destination: the device would
 * fault, where a DMA only fails. */
static bool can_kernel(pm__mem_t k, bool write) {
  return k != PM__MEM_PAGEABLE && k != PM__MEM_PINNED_OTHER && k != PM__MEM_PINNED_PART &&
         !(write && k == PM__MEM_PINNED_RO);
}

static pm_status_t resolve_kind(pm_copy_kind_t asked, pm__mem_t s, pm__mem_t d, where_t w,
                                pm_copy_kind_t *out) {
  if (asked == PM_COPY_DEFAULT) {
    bool sd = s == PM__MEM_DEVICE, dd = d == PM__MEM_DEVICE;
    *out = sd ? (dd ? PM_COPY_D2D : PM_COPY_D2H) : (dd ? PM_COPY_H2D : PM_COPY_H2H);
    return PM_OK;
  }
  bool ok = false;
  switch (asked) {
    case PM_COPY_H2D:
      ok = can_host(s) && can_dev(d);
      break;
    case PM_COPY_D2H:
      ok = can_dev(s) && can_host(d);
      break;
    case PM_COPY_D2D:
      ok = can_dev(s) && can_dev(d);
      break;
    case PM_COPY_H2H:
      ok = can_host(s) && can_host(d);
      break;
    default:
      break;
  }
  if (!ok) {
    char wb[96];
    return pm__set_error(PM_ERR_INVALID,
                         "%s: kind %s contradicts the pointers: src is %s memory, "
                         "dst is %s memory",
                         where_str(w, wb, sizeof wb), pm__copy_kind_symbol(asked), pm__mem_name(s),
                         pm__mem_name(d));
  }
  *out = asked;
  return PM_OK;
}

/* NULL pointers, address wrap-around and overlapping ranges. */
static pm_status_t check_ranges(void *dst, const void *src, size_t bytes, where_t w) {
  char wb[96];
  if (!dst || !src)
    return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", where_str(w, wb, sizeof wb),
                         !dst ? "dst" : "src");
  uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
  if (bytes > UINTPTR_MAX - d || bytes > UINTPTR_MAX - s)
    return pm__set_error(PM_ERR_INVALID, "%s: %zu bytes from %p wraps the address space",
                         where_str(w, wb, sizeof wb), bytes, bytes > UINTPTR_MAX - d ? dst : src);
  if (pm__ranges_overlap(dst, src, bytes))
    return pm__set_error(PM_ERR_INVALID, "%s: src [%p, +%zu) and dst [%p, +%zu) overlap",
                         where_str(w, wb, sizeof wb), src, bytes, dst, bytes);
  return PM_OK;
}

static pm_status_t read_options(const pm_copy_options_t *options, const char *fn,
                                pm_copy_options_t *out) {
  if (!options) {
    pm_copy_options_init(out);
    return PM_OK;
  }
  if ((unsigned)options->kind > PM_COPY_H2H)
    return pm__set_error(PM_ERR_INVALID, "%s: options->kind %d is not a pm_copy_kind_t", fn,
                         (int)options->kind);
  if ((unsigned)options->path > PM_PATH_REGISTER)
    return pm__set_error(PM_ERR_INVALID, "%s: options->path %d is not a pm_copy_path_t", fn,
                         (int)options->path);
  if (options->path == PM_PATH_REGISTER)
    return pm__set_error(PM_ERR_UNSUPPORTED,
                         "%s: PM_PATH_REGISTER (register in place) is not supported: a cached "
                         "registration outlives a free of the buffer; use PM_PATH_AUTO or "
                         "PM_PATH_STAGED, or pm_register the buffer once",
                         fn);
  *out = *options;
  return PM_OK;
}

/* ---- submission ----------------------------------------------------------------------------- */

typedef pm_copy_item_t op_t; /* one plain backend copy */

static pm_status_t resolve_pool(pm_pool_t *pool, pm_pool_t **out) {
  if (pool) {
    *out = pool;
    return PM_OK;
  }
  pm_status_t st = pm_pool_default(out);
  return st == PM_OK ? PM_OK : pm__wrap_error(st, "default pool for bounce buffers");
}

/* Queue `direct` (plain backend copies) and stage `segs`, then set up the completion. */
static pm_status_t submit(pm_copy_kind_t kind, const op_t *direct, size_t ndirect, bool kernel_ok,
                          const pm__stage_seg_t *segs, size_t nsegs, pm_stream_t stream,
                          const pm_copy_options_t *opt, pm_fence_t *fence_out) {
  bool d2h_staged = nsegs && kind == PM_COPY_D2H;
  pm_fence_t f = NULL;
  pm__d2h_job_t *job = NULL;
  pm_status_t st = PM_OK;

  /* Everything that can fail without side effects comes before the first queued byte. */
  if (fence_out || opt->callback || d2h_staged) {
    st = pm__fence_new(nsegs ? PM_PATH_STAGED : PM_PATH_DIRECT, true, opt, &f);
    if (st != PM_OK) return st;
    if (fence_out) {
      st = pm__fence_live_add(f);
      if (st != PM_OK) {
        pm__fence_free(f);
        return st;
      }
    }
  }
  pm__stage_req_t req;
  if (nsegs) {
    memset(&req, 0, sizeof req);
    req.kind = kind;
    req.segs = segs;
    req.nsegs = nsegs;
    req.stream = stream;
    pm__copy_cfg(&req.cfg);
    st = resolve_pool(opt->pool, &req.pool);
    if (st != PM_OK) goto fail;
  }

  if (ndirect) {
    st = pm__memcpy_batch_async(direct, ndirect, kind, stream, kernel_ok);
    if (st != PM_OK) goto fail;
  }
  if (nsegs) {
    if (kind == PM_COPY_H2D)
      st = pm__stage_h2d(&req, NULL);
    else
      st = pm__stage_d2h_submit(&req, &job);
    if (st != PM_OK) goto fail;
  }
  if (!f) return PM_OK;

  /* The bytes are on their way: from here on, work handed to the stream must be seen through. */
  f->job = job;
  f->gate_job = job;
  f->host = job != NULL || f->cb != NULL;
  atomic_init(&f->refs, (fence_out ? 1 : 0) + (f->host ? 1 : 0) + (job ? 1 : 0));
  if (job) return pm__fence_submit_d2h_gate(f, job, stream, fence_out);
  st = pm__cb_event_record(f->event, stream);
  if (st != PM_OK) goto fail;
  if (f->cb) {
    st = pm__cb_launch_host_func(stream, pm__fence_notify, f);
    if (st != PM_OK) goto fail;
  } else if (!fence_out) {
    pm__fence_free(f); /* a D2H ring copy, done in the call, and nobody to tell */
    return PM_OK;
  }
  if (fence_out) *fence_out = f;
  return PM_OK;

fail : {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", pm_last_error());
  if (f) {
    if (fence_out) pm__fence_live_remove(f);
    pm__fence_free(f);
  }
  return pm__set_error(st, "%s", msg);
}
}

pm_status_t pm_copy_async(void *dst, const void *src, size_t bytes, pm_stream_t stream,
                          const pm_copy_options_t *options, pm_fence_t *fence_out) {
  where_t w = {"pm_copy_async", SIZE_MAX};
  pm_copy_options_t opt;
  pm_status_t st = read_options(options, w.fn, &opt);
  if (st != PM_OK) return st;
  st = check_ranges(dst, src, bytes, w);
  if (st != PM_OK) return st;
  PM__BACKEND_OR_RETURN(b);
  if (bytes == 0) return pm__fence_submit_empty(&opt, fence_out);

  pm__mem_t s, d;
  st = classify(b, src, bytes, "src", w, NULL, &s);
  if (st != PM_OK) return st;
  st = classify(b, dst, bytes, "dst", w, NULL, &d);
  if (st != PM_OK) return st;
  pm_copy_kind_t kind;
  st = resolve_kind(opt.kind, s, d, w, &kind);
  if (st != PM_OK) return st;

  bool stage = false;
  if (kind == PM_COPY_H2D || kind == PM_COPY_D2H) {
    pm__mem_t host = kind == PM_COPY_H2D ? s : d;
    if (opt.path == PM_PATH_STAGED) {
      stage = true;
    } else if (opt.path == PM_PATH_AUTO) {
      stage = host == PM__MEM_PINNED_PART ||
              (host == PM__MEM_PAGEABLE && bytes >= pm__opt_size(PM__OPT_COPY_STAGE_MIN));
    }
  } else if (opt.path == PM_PATH_STAGED) {
    return pm__set_error(PM_ERR_INVALID,
                         "pm_copy_async: PM_PATH_STAGED needs one host and one device side, not %s",
                         pm__copy_kind_symbol(kind));
  }

  if (stage) {
    pm__stage_seg_t seg;
    seg.host = kind == PM_COPY_H2D ? (char *)(uintptr_t)src : (char *)dst;
    seg.dev = kind == PM_COPY_H2D ? (char *)dst : (char *)(uintptr_t)src;
    seg.bytes = bytes;
    st = submit(kind, NULL, 0, false, &seg, 1, stream, &opt, fence_out);
  } else {
    op_t op = {dst, src, bytes};
    st = submit(kind, &op, 1, false, NULL, 0, stream, &opt, fence_out);
  }
  return st == PM_OK ? PM_OK : pm__wrap_error(st, "pm_copy_async");
}

pm_status_t pm_copy_batch_async(const pm_copy_item_t *items, size_t count, pm_stream_t stream,
                                const pm_copy_options_t *options, pm_fence_t *fence_out) {
  const char *fn = "pm_copy_batch_async";
  pm_copy_options_t opt;
  pm_status_t st = read_options(options, fn, &opt);
  if (st != PM_OK) return st;
  if (!items && count) return pm__set_error(PM_ERR_INVALID, "%s: items is NULL", fn);
  PM__BACKEND_OR_RETURN(b);

  op_t *ops = NULL;
  pm__stage_seg_t *segs = NULL;
  size_t nops = 0, nsegs = 0;
  pm_copy_kind_t kind = PM_COPY_DEFAULT;
  size_t first = SIZE_MAX;
  bool kernel_ok = true; /* every direct item between kernel-addressable memory */
  qcache_t sc = {0}, dc = {0};
  uintptr_t last_sr = 0, last_dr = 0; /* the tracked ranges of ops[nops - 1] (0: untracked) */
  if (count > SIZE_MAX / sizeof *ops || count > SIZE_MAX / sizeof *segs)
    return pm__set_error(PM_ERR_INVALID, "%s: %zu items is more than memory can hold", fn, count);
  if (count) {
    ops = malloc(count * sizeof *ops);
    segs = malloc(count * sizeof *segs);
    if (!ops || !segs) {
      st = pm__set_error(PM_ERR_NOMEM, "%s: malloc for %zu items failed", fn, count);
      goto out;
    }
  }
  for (size_t i = 0; i < count; i++) {
    const pm_copy_item_t *it = &items[i];
    where_t w = {fn, i};
    st = check_ranges(it->dst, it->src, it->bytes, w);
    if (st != PM_OK) goto out;
    if (it->bytes == 0) continue;
    pm__mem_t s, d;
    st = classify(b, it->src, it->bytes, "src", w, &sc, &s);
    if (st != PM_OK) goto out;
    st = classify(b, it->dst, it->bytes, "dst", w, &dc, &d);
    if (st != PM_OK) goto out;
    pm_copy_kind_t k;
    st = resolve_kind(opt.kind, s, d, w, &k);
    if (st == PM_OK && first != SIZE_MAX && k != kind) {
      /* Inferred differently, but managed memory may still serve the first item's direction. */
      pm_copy_kind_t k2;
      if (resolve_kind(kind, s, d, w, &k2) == PM_OK) {
        k = k2;
      } else {
        char wb[96];
        st = pm__set_error(PM_ERR_INVALID,
                           "%s: is %s (src %s, dst %s) but item %zu is %s; a batch has one "
                           "direction",
                           where_str(w, wb, sizeof wb), pm__copy_kind_symbol(k), pm__mem_name(s),
                           pm__mem_name(d), first, pm__copy_kind_symbol(kind));
      }
    }
    if (st != PM_OK) goto out;
    if (first == SIZE_MAX) {
      first = i;
      kind = k;
    }
    bool hd = kind == PM_COPY_H2D || kind == PM_COPY_D2H;
    pm__mem_t host = kind == PM_COPY_H2D ? s : d;
    bool stage =
        hd &&
        (opt.path == PM_PATH_STAGED ||
         (opt.path == PM_PATH_AUTO && (host == PM__MEM_PAGEABLE || host == PM__MEM_PINNED_PART)));
    if (!hd && opt.path == PM_PATH_STAGED) {
      char wb[96];
      st = pm__set_error(PM_ERR_INVALID,
                         "%s: PM_PATH_STAGED needs one host and one device side, "
                         "not %s",
                         where_str(w, wb, sizeof wb), pm__copy_kind_symbol(kind));
      goto out;
    }
    if (stage) {
      segs[nsegs].host = kind == PM_COPY_H2D ? (char *)(uintptr_t)it->src : (char *)it->dst;
      segs[nsegs].dev = kind == PM_COPY_H2D ? (char *)it->dst : (char *)(uintptr_t)it->src;
      segs[nsegs].bytes = it->bytes;
      nsegs++;
    } else {
      kernel_ok = kernel_ok && can_kernel(s, false) && can_kernel(d, true);
      uintptr_t sr = in_range(&sc, it->src, it->bytes), dr = in_range(&dc, it->dst, it->bytes);
      if (nops && can_join(&ops[nops - 1], it) && sr == last_sr && dr == last_dr) {
        ops[nops - 1].bytes += it->bytes; /* adjacent pieces: one DMA */
      } else {
        ops[nops].dst = it->dst;
        ops[nops].src = it->src;
        ops[nops].bytes = it->bytes;
        nops++;
        last_sr = sr;
        last_dr = dr;
      }
    }
  }
  if (nops == 0 && nsegs == 0)
    st = pm__fence_submit_empty(&opt, fence_out);
  else
    st = submit(kind, ops, nops, kernel_ok, segs, nsegs, stream, &opt, fence_out);
  if (st != PM_OK) st = pm__wrap_error(st, "%s", fn);
out:
  free(ops);
  free(segs);
  return st;
}
