/*
 * DESIGN: which device a thread works for. CUDA's current device is a per-thread setting, and a
 * thread that never set one works on device 0: a pinmem thread (a parallel_for helper, a loader
 * worker, a completion thread) that makes a backend call for work of device k without making k
 * current first creates a context on device 0 and queues or polls on the wrong device. So every
 * pinmem thread calls pm__thread_enter(device of its work) before its backend calls; the device
 * comes from the thread that asked for the work (pm__thread_device, captured when the work is
 * handed over), never from a default.
 *
 * A call that makes another device current for its work and gives the caller its own back
 * (pm__device_binding, pm__device_put_back) gives a thread that had none (cuda: no current
 * context) none back, never device 0, whose context it would make.
 *
 * The backend is reached unwrapped (pm__backend_raw): a device switch is bookkeeping, not a call
 * of the copy or the allocation the user asked for, so fault injection neither fails it nor
 * counts it (armed "nth call" faults keep pointing at the same calls).
 *
 * The devices this process used are a bit set (devices entered or set through pinmem, and the
 * current device of every thread that handed work over): pm__pool_devices_idle synchronizes
 * those alone, so a process that only uses device k never makes a call on device 0.
 *
 * Threads: the current device is the backend's per-thread state; the bit set is one atomic (a
 * forked child keeps the parent's bits: at worst it synchronizes a device it did not use).
 */
#include <stdatomic.h>

#include "internal.h"

static atomic_uint_fast64_t devices_used;

void pm__devices_used_mark(int device) {
  if (device >= 0 && device < 64)
    atomic_fetch_or_explicit(&devices_used, (uint_fast64_t)1 << device, memory_order_relaxed);
}

uint64_t pm__devices_used(void) {
  uint64_t bits = (uint64_t)atomic_load_explicit(&devices_used, memory_order_relaxed);
  if (pm__device_option_given()) { /* pm_init made it current */
    long dev = pm__opt_int(PM__OPT_DEVICE);
    if (dev >= 0 && dev < 64) bits |= (uint64_t)1 << dev;
  }
  return bits;
}

int pm__thread_device(void) {
  const pm__backend_t *b = pm__backend_raw();
  int cur = -1;
  if (!b || b->get_device(&cur) != PM_OK) return -1;
  pm__devices_used_mark(cur);
  return cur;
}

void pm__thread_set_device(int device) {
  const pm__backend_t *b = pm__backend_raw();
  int cur = -1;
  if (device < 0 || !b) return;
  /* A failure leaves the thread where it was; the work's own call reports the trouble. The
   * caller's pm_last_error() is left alone either way (this may run after a failure). */
  if (b->get_device(&cur) != PM_OK || cur != device) (void)b->set_device(device);
  pm__devices_used_mark(device);
}

void pm__thread_enter(int device) {
  /* The device came from a get_device of a running backend, so it is valid and the backend is
   * up: the switch (if any) and the mark are pm__thread_set_device's. */
  pm__thread_set_device(device);
  pm__numa_thread_follow(device);
}

pm_status_t pm__device_binding(const pm__backend_t *b, int *binding_out) {
  int cur = -1;
  pm_status_t st = b->bound_device ? b->bound_device(&cur) : b->get_device(&cur);
  if (st != PM_OK) return st;
  *binding_out = cur < 0 ? PM__DEVICE_NONE : cur;
  return PM_OK;
}

void pm__device_put_back(const pm__backend_t *b, int binding) {
  /* A failure leaves the thread on the call's device; the call's own status stands. */
  if (binding >= 0)
    (void)b->set_device(binding);
  else if (binding == PM__DEVICE_NONE && b->unbind_device)
    (void)b->unbind_device();
}
