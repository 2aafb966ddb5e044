"""DESIGN: pinmem.Loader over a torch IterableDataset (a stream: __iter__, no index).

Loader(dataset) with an IterableDataset makes an IterableLoader (Loader.__new__ picks it), whose
batches come from iterating the dataset rather than from the C loader's claims of indices (a
stream has no index to claim, and its batches need not share one shape).

num_workers=0: the main process iterates the dataset at next(), batch_size samples at a time,
and stacks each array leaf of the samples straight into a pinned buffer of pinmem's pool.
num_workers=N: N processes each iterate their own copy of the dataset (get_worker_info() gives
id, num_workers, seed and the copy inside, so __iter__ shards itself as with torch), build whole
batches from their own samples and send each as one frame on their own socket: a small pickled
head (the batch's Schema, its row count, the non-array leaves) and then each array leaf's raw
bytes, which the main process receives (recv_into) straight into pinned buffers: no pickling of
array bytes and no copy in Python. The main process takes batches from the workers in turn,
skipping those whose iterator ended, as torch's DataLoader does, so the order of the batches is
the round-robin merge of the workers' streams whatever their speed. A worker builds a batch
only for a credit the main process gave it (prefetch_factor credits per worker, one more per
batch taken), so no worker runs further ahead than that.

Each batch is described afresh from its first sample (_workers.describe), so batches may differ
in shape; the samples within one must match (as default_collate needs). With a device, each
leaf is copied from its pinned buffer into device memory on the loader's pinmem stream; the
device buffer records the copy, so a DLPack consumer's stream waits for it without blocking.
A batch's pinned memory goes back to the pool when its copy is done and its buffers go. A
collate_fn's output for the device is staged as a map-style loader's is (_staging.py), as it is
taken.

Device memory is reused, not allocated per batch (cuMemFree synchronizes the device): a batch
takes one block of the loader's _DeviceCache (devcache.c) for all its leaves, and the block
goes back to the cache's free list when the batch's last leaf goes (the user may hold a batch as
long as they like). The rule that makes reuse safe: the dying batch records the block's release
event on the stream its DLPack consumer named (or the loader's stream), and the next batch's
copies into the block wait for that event on the loader's stream, so nothing overwrites a block
before the copy into it and the kernels queued to read it are done; the host never waits. The
cache holds no more blocks than batches were alive at once; close() and the loader's death free
its free blocks.

Epochs: each iter() is a new epoch. Without persistent_workers the workers are started for the
epoch and stopped at its end (or when the next epoch starts); with them, a RESET carrying a new
generation makes each worker call iter() on its copy again, and frames of an older generation
(batches built before the worker saw the RESET) are read past and dropped.

Messages on each worker's socket (SOCK_STREAM, little-endian):
  main -> worker: CMD = magic u32, kind u32 (CREDIT | RESET), gen u64, arg u64.
  worker -> main: HEAD = magic u32, kind u32 (BATCH | END | ERROR | COLLATED), gen u64,
                  status i64, meta_len u64, data_len u64; then meta (pickle) and data (bytes).
Errors travel as _workers' error payloads and are raised through Pool.error: the exception's own
type where it can be rebuilt, WorkerError otherwise; a worker that dies ends its socket (EOF).
"""

import pickle
import socket
import struct
import sys
import weakref as _weakref
from time import perf_counter as _perf_counter

from . import _pinmem
from . import _staging
from . import _workers
from . import loader as _loader
from ._args import int_arg as _int_arg
from ._pinmem import InvalidError
from ._workers import WorkerError

CMD = struct.Struct("<IIQQ")
HEAD = struct.Struct("<IIQqQQ")
MAGIC_CMD = 0x43494D50  # "PMIC"
MAGIC_HEAD = 0x48494D50  # "PMIH"
CREDIT, RESET = 1, 2
BATCH, END, ERROR, COLLATED = 1, 2, 3, 4
_DEFAULT_PREFETCH = 2  # batches per worker built ahead, as torch's default prefetch_factor


# ---- batches from samples (in a worker, or in the main process with num_workers=0) ----------

def _renamed(e):
    """_workers' messages name samples by dataset index; a stream's samples have positions."""
    text = str(e).replace("dataset index", "sample").replace("PM_ERR_INVALID: ", "", 1)
    # Samples of one batch that do not stack: a RuntimeError too, as default_collate's.
    cls = _staging.StackError if isinstance(e, _workers.ShapeDiffers) else InvalidError
    return cls("PM_ERR_INVALID: " + text + " (samples counted from the start of the dataset's "
               "iterator)")


def _leaves(samples, first, np):
    """(Schema of the batch, per sample its leaves) for samples numbered from `first`."""
    schema = _workers.describe(samples[0], first)
    rows = []
    for j, s in enumerate(samples):
        leaves = schema.fast_leaves(s, np) if schema.flat else None
        if leaves is None:
            leaves = _workers.checked_leaves(schema, s, first + j, np)
        rows.append(leaves)
    return schema, rows


def _slot_shape(schema, k, rows, unbatched):
    shape = schema.leaves[schema.slot[k]][1]
    return shape if unbatched else (rows,) + shape


def _take(samples, state, want, drop_last):
    """Up to `want` samples of state.it; state.ended once it is exhausted. None for no batch
    (nothing left, or a short last batch with drop_last)."""
    while len(samples) < want:
        try:
            samples.append(next(state.it))
        except StopIteration:
            state.ended = True
            break
    if not samples or drop_last and len(samples) < want:
        return None
    return samples


class _Stream:
    """One iteration of a dataset: its iterator and how many samples it gave."""

    def __init__(self, dataset):
        self.dataset, self.it, self.ended, self.count = dataset, None, False, 0

    def batch(self, want, drop_last):
        """The next batch's samples (None: the iteration ended). Exceptions of the dataset's
        __iter__ and __next__ pass through; the samples taken before one are dropped, as torch
        drops them."""
        if self.ended:
            return None
        if self.it is None:
            try:
                self.it = iter(self.dataset)
            except BaseException:
                self.ended = True  # raised once, as from iter(DataLoader); the stream has ended
                raise
        return _take([], self, want, drop_last)


# ---- the worker process ----------------------------------------------------------------------

def _send_frame(sock, kind, gen, status=0, meta=b"", data=()):
    sock.sendall(HEAD.pack(MAGIC_HEAD, kind, gen, status, len(meta),
                           sum(a.nbytes for a in data)) + meta)
    for a in data:  # (contiguous: made by np.stack or np.array)
        sock.sendall(a.reshape(-1).view("u1"))


def _send_error(sock, gen, status, wid, exc, where):
    payload = _workers._pack_error(status, 0, wid, exc, where)[_workers.REP.size:]
    _send_frame(sock, ERROR, gen, status, payload)


class _Commands:
    """The main process's commands, read whole (`buf` keeps a command's first bytes until
    the rest arrives)."""

    def __init__(self, sock):
        self.sock, self.buf = sock, bytearray()

    def read(self, block):
        """Every complete command now available (waiting for one if block); None at EOF."""
        while True:
            try:
                data = self.sock.recv(1 << 16, 0 if block else socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                return None
            if data == b"":
                return None
            if data:
                self.buf += data
            n = len(self.buf) // CMD.size
            if n or not block:
                out = [CMD.unpack_from(self.buf, k * CMD.size) for k in range(n)]
                del self.buf[:n * CMD.size]
                return out


def worker_main(sock, dataset, wid, nworkers, base_seed, init_fn, close_fds, cpus, plan):
    """The body of iterable worker `wid`: build a batch per credit until the socket ends.
    plan: (batch size or None for unbatched, drop_last, collate_fn or None)."""
    _workers.worker_start(dataset, wid, nworkers, base_seed, close_fds, cpus)
    import numpy as np
    init_error = None
    if init_fn is not None:
        try:
            init_fn(wid)
        except BaseException as e:  # reported at the worker's first batch of every epoch,
            init_error = e          # which then has no batches
    size, drop_last, collate = plan
    unbatched = size is None
    commands = _Commands(sock)
    gen, credits, stream = 0, 0, _Stream(dataset)
    try:
        while True:
            got = commands.read(block=credits == 0)
            if got is None:
                break  # the loader closed, or the main process is gone
            for magic, kind, g, _ in got:
                if kind == RESET:  # a new epoch: credits given before it are void
                    gen, credits, stream = g, 0, _Stream(dataset)
                elif kind == CREDIT and g == gen:
                    credits += 1
            if credits == 0:
                continue
            credits -= 1
            if init_error is not None and not stream.ended:
                _send_error(sock, gen, _workers.ST_INIT, wid, init_error, "in worker_init_fn")
                stream.ended = True
                continue
            _serve_one(sock, gen, stream, wid, size or 1, unbatched, drop_last, collate, np)
    except OSError:
        pass  # the loader closed while a batch was sent
    sock.close()


def _serve_one(sock, gen, stream, wid, want, unbatched, drop_last, collate, np):
    """Build and send one batch of `stream` (or END, or the error that stopped it)."""
    try:
        samples = stream.batch(want, drop_last and not unbatched)
    except BaseException as e:  # KeyboardInterrupt, SystemExit too: reported, not lost
        _send_error(sock, gen, _workers.ST_EXC, wid, e, "in the dataset's iterator")
        return
    if samples is None:
        stream.ended = True
        _send_frame(sock, END, gen)
        return
    first = stream.count
    stream.count += len(samples)
    if collate is not None:
        try:
            meta = _workers.dumps(collate(samples[0] if unbatched else samples))
        except BaseException as e:
            _send_error(sock, gen, _workers.ST_EXC, wid, e, "in collate_fn")
            return
        _send_frame(sock, COLLATED, gen, 0, meta)
        return
    try:
        schema, rows = _leaves(samples, first, np)
        arrays = []
        for k in range(len(schema.slot)):
            col = [r[schema.slot[k]] for r in rows]
            arrays.append(np.array(col[0]) if unbatched else np.stack(col))
        objs = [schema.obj_values(r) for r in rows] if schema.objs else None
        meta = _workers.dumps((schema, len(rows), objs))
    except BaseException as e:
        invalid = isinstance(e, InvalidError)
        _send_error(sock, gen, _workers.ST_INVALID if invalid else _workers.ST_EXC, wid,
                    _renamed(e) if invalid else e, "with a batch's samples")
        return
    _send_frame(sock, BATCH, gen, 0, meta, arrays)


class _IterPool(_workers.Pool):
    """The worker processes of an IterableLoader: one stream socket each. Stopping, closing,
    exit codes and error payloads are the map-style Pool's."""

    def __init__(self, dataset, nworkers, ctx, base_seed, init_fn, cpus, plan):
        self.ctx = _workers._context(ctx)
        self.method = self.ctx.get_start_method()
        self.nworkers, self.cpus, self.numa_problems = nworkers, cpus, {}
        self.socks, self.procs, self.sides, self.store, self.drainer = [], [], [], None, None
        self.closed = self.stopped = False
        self.epoch = 0
        try:
            for w in range(nworkers):
                a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                _workers._PARENT_ENDS.add(a.fileno())
                self.socks.append(a)
                close_fds = sorted(_workers._PARENT_ENDS) if self.method == "fork" else []
                p = self.ctx.Process(target=worker_main, name=f"pinmem-worker-{w}",
                                     args=(b, dataset, w, nworkers, base_seed, init_fn,
                                           close_fds, cpus, plan), daemon=True)
                try:
                    p.start()
                finally:
                    b.close()
                self.procs.append(p)
        except BaseException:
            self.close()
            raise

    def command(self, w, kind, gen):
        try:
            self.socks[w].sendall(CMD.pack(MAGIC_CMD, kind, gen, 0))
        except OSError:
            pass  # the worker is gone: its socket's end of file says so when read


# ---- the main process ------------------------------------------------------------------------

def _bytes_of(buf, nbytes):
    """A writable uint8 NumPy view of a pinned buffer's bytes, for every dtype (bfloat16 and
    the other dtypes NumPy lacks have no buffer protocol). The caller keeps buf alive."""
    import ctypes
    import numpy as np
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(buf.ptr))


class _Epoch:
    """One iteration over the dataset: where the next batch comes from."""

    def __init__(self, loader, number):
        self.loader, self.number = loader, number
        self.done = False
        self.delivered = 0
        if loader.num_workers == 0:
            self.stream = _Stream(loader.dataset)
            return
        pool = loader._pool
        if pool is None or pool.stopped:
            pool = loader._pool = loader._start_workers(number)
            loader._gen = 0
        else:  # persistent workers: iterate their copies again
            loader._gen += 1
            for w in range(pool.nworkers):
                pool.command(w, RESET, loader._gen)
        self.gen = loader._gen
        self.active = [True] * pool.nworkers
        self.turn = 0
        for w in range(pool.nworkers):
            for _ in range(loader._credits):
                pool.command(w, CREDIT, self.gen)

    def next(self):
        """The next batch as delivered (raises StopIteration at the end of the epoch)."""
        if self.done:
            raise StopIteration
        if self.loader.num_workers == 0:
            return self._next_here()
        pool = self.loader._pool
        while True:
            if not any(self.active):
                self.finish()
                raise StopIteration
            w = self.turn
            if not self.active[w]:
                self.turn = (w + 1) % pool.nworkers
                continue
            try:
                kind, status, meta, data = self._receive(pool, w)
            except BaseException:
                # Cut mid-frame (Ctrl-C, the budget, a worker gone): the stream cannot be read
                # on, so the epoch ends here and the next one starts anew.
                if self.loader._pool is pool:
                    self.loader._lost_workers()
                raise
            if kind == END:
                self.active[w] = False
                self.turn = (w + 1) % pool.nworkers
                continue
            # This worker's turn is taken: its next batch is built meanwhile.
            self.turn = (w + 1) % pool.nworkers
            pool.command(w, CREDIT, self.gen)
            if kind == ERROR:
                raise pool.error(status, w, meta)
            self.delivered += 1
            if kind == COLLATED:
                return self.loader._collated_out(pickle.loads(meta))
            return self.loader._deliver(*data)

    def _next_here(self):
        loader = self.loader
        stream = self.stream
        first = stream.count
        samples = stream.batch(loader._want, loader.drop_last and not loader._unbatched)
        if samples is None:
            self.finish()
            raise StopIteration
        stream.count += len(samples)
        self.delivered += 1
        if loader._collate is not None:
            return loader._collated_out(loader._collate(samples[0] if loader._unbatched
                                                        else samples))
        import numpy as np
        try:
            schema, rows = _leaves(samples, first, np)
        except InvalidError as e:
            raise _renamed(e) from None
        bufs = []
        for k, j in enumerate(schema.slot):
            shape = _slot_shape(schema, k, len(rows), loader._unbatched)
            buf = loader._pinned(schema, k, shape)
            out = np.ndarray(shape, schema.leaves[j][0], _bytes_of(buf, buf.nbytes))
            if loader._unbatched:
                out[...] = rows[0][j]
            else:
                np.stack([r[j] for r in rows], out=out)
            bufs.append(buf)
        objs = [schema.obj_values(r) for r in rows] if schema.objs else None
        return loader._deliver(schema, len(rows), objs, bufs)

    def _receive(self, pool, w):
        """The next frame of worker w for this epoch: (kind, status, meta, data); data for a
        BATCH: (schema, rows, objs, pinned buffers). Frames of earlier epochs are dropped."""
        loader = self.loader
        sock = pool.socks[w]
        sock.settimeout(loader.timeout or None)
        while True:
            head = self._read(pool, w, sock, HEAD.size)
            magic, kind, gen, status, meta_len, data_len = HEAD.unpack(head)
            if magic != MAGIC_HEAD:
                raise pool.plain_error(w, f"sent a frame that is not pinmem's ({magic:#x})")
            meta = self._read(pool, w, sock, meta_len)
            if gen != self.gen:
                self._skip(pool, w, sock, data_len)
                continue
            if kind != BATCH:
                return kind, status, meta, None
            schema, rows, objs = pickle.loads(meta)
            bufs = []
            for k in range(len(schema.slot)):
                buf = loader._pinned(schema, k, _slot_shape(schema, k, rows, loader._unbatched))
                self._read_into(pool, w, sock, _bytes_of(buf, buf.nbytes))
                bufs.append(buf)
            return kind, status, meta, (schema, rows, objs, bufs)

    def _read(self, pool, w, sock, n):
        out = bytearray(n)
        self._read_into(pool, w, sock, memoryview(out))
        return bytes(out)

    def _skip(self, pool, w, sock, n):
        scratch = bytearray(min(n, 1 << 20))
        while n > 0:
            k = min(n, len(scratch))
            self._read_into(pool, w, sock, memoryview(scratch)[:k])
            n -= k

    def _read_into(self, pool, w, sock, view):
        view = memoryview(view).cast("B")
        got = 0
        while got < len(view):
            try:
                k = sock.recv_into(view[got:])
            except socket.timeout:
                err = WorkerError(f"pinmem.Loader: worker process {w} (pid {pool.procs[w].pid})"
                                  f" gave no batch within timeout={self.loader.timeout:g} s: "
                                  "raise timeout, or find what makes the dataset's iterator "
                                  "that slow")
                # The frame may be cut anywhere: the epoch ends here (a new one starts anew).
                self.loader._lost_workers()
                raise err from None
            except OSError:
                k = 0
            if k == 0:
                if self.loader._closed:
                    _loader._closed()
                err = pool.died(w, [])
                self.loader._lost_workers()  # its stream is cut: the epoch cannot go on
                raise err
            got += k

    def finish(self):
        """The epoch is over (delivered, left for a new one, or cut by a dead worker)."""
        self.done = True
        loader = self.loader
        if loader.num_workers and not loader.persistent_workers:
            loader._stop_workers()


def _datapipe(dataset):
    """A torch.utils.data IterDataPipe (by its class, without importing torch)."""
    return any(c.__name__ == "IterDataPipe" and c.__module__.startswith("torch.utils.data")
               for c in type(dataset).__mro__)


def _distributed_world():
    """torch.distributed's world size where a process group is up, else 1."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    except Exception:
        pass
    return 1


def _no_epoch():
    return None


class _IterableEpochIterator:
    """The batches of one epoch (an object, not a generator: it holds no batch between
    calls, so a dropped batch gives its memory back at once)."""

    __slots__ = ("_loader", "_convert", "_epoch", "_done")

    def __init__(self, loader, convert=None):
        if loader._closed:
            _loader._closed()
        self._loader, self._convert, self._epoch, self._done = loader, convert, None, False

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        loader = self._loader
        t0 = _perf_counter()
        try:
            if loader._closed:
                _loader._closed()
            if self._epoch is None:  # the epoch begins at the first next(), as torch's
                self._epoch = loader._begin()
                if self._epoch is None:
                    self._done = True
                    raise StopIteration
            elif self._epoch is not loader._current():
                self._done = True  # a newer iterator started the next epoch
                _loader._overtaken()
            try:
                b = self._epoch.next()
            except StopIteration:
                self._done = True
                raise
            if self._convert is not None and isinstance(b, (_Delivered, _Staged)):
                b = b.convert(self._convert)
            return b.shaped() if isinstance(b, (_Delivered, _Staged)) else b
        finally:
            loader._iteration_s += _perf_counter() - t0

    def close(self):
        """Stop early; the next iterator starts the next epoch."""
        self._done = True


class _Delivered:
    """A batch's leaves in pinned or device buffers, before they take the sample's structure."""

    __slots__ = ("schema", "values", "objs", "unbatched", "rows")

    def __init__(self, schema, values, objs, unbatched, rows):
        self.schema, self.values, self.objs, self.unbatched = schema, values, objs, unbatched
        self.rows = rows

    def convert(self, fn):
        self.values = [fn(v) for v in self.values]
        return self

    def shaped(self):
        return self.schema.rebuild(self.values, self.unbatched, self.objs, self.rows)


class _Staged:
    """A collate_fn's output with its arrays staged onto the device (_staging.py)."""

    __slots__ = ("out",)

    def __init__(self, out):
        self.out = out

    def convert(self, fn):
        self.out = _staging.convert(self.out, fn)
        return self

    def shaped(self):
        return self.out


class IterableLoader(_loader.Loader):
    """pinmem.Loader over a torch IterableDataset (see Loader's docstring and
    docs/pytorch.md): batches of the dataset's stream, built in the main process
    (num_workers=0) or by worker processes each iterating their own copy, delivered in pinned
    memory or moved to the device."""

    def __init__(self, dataset, batch_size=1, shuffle=False, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=True, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="",
                 in_order=True, seed=None, device=None, epochs=None, rank=None,
                 world_size=None, io=None, worker_mode=None, tensors=None):
        self._closed = False
        self._pool = None
        # The epoch in progress, weakly: its iterator holds it (and the loader), so a loader
        # dropped without close() is freed at once and its workers go with it.
        self._epoch = _no_epoch
        # Refused as torch refuses them: the dataset decides its order and its samples.
        for name, value in (("shuffle", shuffle), ("sampler", sampler),
                            ("batch_sampler", batch_sampler)):
            if value is not None and value is not False:
                raise InvalidError(f"PM_ERR_INVALID: {name}={value!r} with an IterableDataset: "
                                   "the dataset's iterator decides which samples come and in "
                                   f"what order, so {name} has no meaning (torch's DataLoader "
                                   "refuses it too); shuffle or shard inside __iter__")
        for name, value in (("rank", rank), ("world_size", world_size)):
            if value is not None:
                raise InvalidError(f"PM_ERR_INVALID: {name}={value!r} with an IterableDataset: "
                                   "pinmem shards by index, and a stream has none; shard inside "
                                   "__iter__ (torch.distributed.get_rank(), get_worker_info())")
        if worker_mode not in (None, "process"):
            raise InvalidError(f"PM_ERR_INVALID: worker_mode={worker_mode!r} with an "
                               "IterableDataset: each worker iterates its own copy of the "
                               "dataset in its own process (worker_mode None or 'process')")
        if io is not None:
            raise InvalidError(f"PM_ERR_INVALID: io={io!r} is for .npy paths; an IterableDataset "
                               "reads its own data")
        to_device, self._device_index = _loader._device_arg(device)
        unbatched = batch_size is None
        if unbatched and drop_last:
            raise InvalidError("PM_ERR_INVALID: batch_size=None option is mutually exclusive "
                               "with drop_last (as in torch's DataLoader)")
        self._want = 1 if unbatched else _int_arg("batch_size", batch_size, 1)
        nw = _int_arg("num_workers", num_workers, 0)
        if prefetch_factor is not None:
            prefetch_factor = _int_arg("prefetch_factor", prefetch_factor, 1)
            if nw == 0:
                raise InvalidError("PM_ERR_INVALID: prefetch_factor option could only be "
                                   "specified in multiprocessing (num_workers > 0), as in "
                                   "torch's DataLoader")
        if persistent_workers and nw == 0:
            raise InvalidError("PM_ERR_INVALID: persistent_workers option needs num_workers > 0"
                               " (as in torch's DataLoader)")
        if _datapipe(dataset) and (nw > 0 or _distributed_world() > 1):
            # DataLoader shards a datapipe's sharding_filter by worker and rank, and seeds its
            # shufflers alike in every worker; pinmem does neither, so each worker (each rank)
            # would give every sample: refused rather than repeated.
            raise InvalidError("PM_ERR_INVALID: a torch IterDataPipe with worker processes or "
                               "several ranks: pinmem does not apply a datapipe's sharding and "
                               "shuffle seeds as DataLoader does, and every sample would come "
                               "once per worker; use num_workers=0 on one rank, or an "
                               "IterableDataset that shards by get_worker_info()")
        timeout = _loader._timeout_arg(timeout)
        seed = _int_arg("seed", seed, -(1 << 63), (1 << 64) - 1, none_ok=True)
        epochs = _int_arg("epochs", epochs, 1, none_ok=True)
        if pin_memory_device not in ("", None) and not str(pin_memory_device).startswith("cuda"):
            raise InvalidError(f"PM_ERR_INVALID: pin_memory_device={pin_memory_device!r}: pinmem "
                               "pins for CUDA devices; leave it '' (or 'cuda')")
        self._collate = None
        if collate_fn is not None and not _loader._is_default_collate(collate_fn):
            if not callable(collate_fn):
                raise InvalidError(f"PM_ERR_INVALID: collate_fn must be callable, not "
                                   f"{type(collate_fn).__name__}")
            self._collate = collate_fn  # (device batches: its output staged, _staging.py)
        if tensors not in (None, True, False):
            raise InvalidError(f"PM_ERR_INVALID: tensors must be None, True or False, not "
                               f"{tensors!r}")
        # Plain iteration gives torch tensors, as for every torch dataset (Loader's rule).
        self._tensors = True if tensors is None else tensors
        if seed is None:
            seed = _loader._seed_from(generator)
        self._base_seed = seed % (1 << 64)
        self._to_device = to_device
        self._unbatched = unbatched
        self._credits = prefetch_factor or _DEFAULT_PREFETCH
        self._epochs_total = epochs
        self._epochs_begun = 0
        self._gen = 0
        self._stream = None
        self._stager = None
        self._blocks = None  # the device blocks of device batches (_pinmem._DeviceCache)
        self._batches = 0
        self._iteration_s = self._conversion_s = 0.0
        # The attributes torch's DataLoader users read, as given.
        self.dataset = dataset
        self.batch_size = None if unbatched else self._want
        self.sampler = self.batch_sampler = None
        self.shuffle = False
        self.num_workers = nw
        self.drop_last = bool(drop_last)
        self.collate_fn = collate_fn
        self.pin_memory = bool(pin_memory)
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.generator = generator
        self.persistent_workers = bool(persistent_workers)
        self.prefetch_factor = prefetch_factor
        self.seed = self._base_seed
        self.device = "cpu" if not to_device else \
            "cuda" if self._device_index is None else f"cuda:{self._device_index}"
        if nw:  # checked now, as torch checks it when the DataLoader is made
            _workers._context(multiprocessing_context)
        _loader._live_loaders.add(self)

    # ---- epochs and workers ----

    def _current(self):
        return self._epoch()

    def _begin(self):
        """A new epoch (None once `epochs` were begun); the one before it ends here."""
        old, self._epoch = self._epoch(), _no_epoch
        if old is not None:
            old.done = True
        if not self.persistent_workers:
            self._stop_workers()  # (already stopped where the last epoch ran to its end)
        if self._epochs_total is not None and self._epochs_begun >= self._epochs_total:
            return None
        epoch = _Epoch(self, self._epochs_begun)  # (workers that fail to start: no epoch)
        self._epochs_begun += 1
        self._epoch = _weakref.ref(epoch)
        return epoch

    def _start_workers(self, epoch):
        seed = self._base_seed if epoch == 0 else _loader._mix_seed(self._base_seed, epoch)
        if not self._to_device:
            dev = -1
        elif self._device_index is not None:
            dev = self._device_index
        else:
            dev = _pinmem.current_device()
        cpus = _pinmem._numa_worker_cpus(dev)
        plan = (None if self._unbatched else self._want, self.drop_last, self._collate)
        return _IterPool(self.dataset, self.num_workers, self.multiprocessing_context, seed,
                         self.worker_init_fn, cpus, plan)

    def _stop_workers(self, wait=5.0):
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop(wait)
            pool.close()

    def _lost_workers(self):
        """A worker died or hangs: stop them all (a hung one is not waited for long); the epoch
        ends (the next one starts new workers)."""
        epoch = self._epoch()
        if epoch is not None:
            epoch.done = True
        self._stop_workers(1.0)

    # ---- delivery ----

    def _pinned(self, schema, k, shape):
        """A pinned buffer from the pool for slot leaf k of a batch of `schema`."""
        _, dtype, _ = schema.specs()[k]
        return _pinmem.empty(shape, dtype)

    def _collated_out(self, out):
        """A collate_fn's output as delivered: as it returned it (device='cpu'), or its arrays
        staged through a pinned block onto the device (as for map-style datasets)."""
        if not self._to_device:
            return out
        if self._stager is None:
            self._stager = _staging.Stager(True, self._device_index)
        return _Staged(self._stager.stage(out))

    def _deliver(self, schema, rows, objs, bufs):
        """A batch's pinned leaves, moved to the device on the loader's stream if it has one."""
        self._batches += 1
        if self._to_device and bufs:  # (a batch of strings alone has no buffer)
            bufs = self._on_device(lambda: self._to_device_copy(bufs))
        return _Delivered(schema, bufs, objs, self._unbatched, rows)

    def _to_device_copy(self, bufs):
        if self._stream is None:
            self._stream = _pinmem.Stream()
        if self._blocks is None:  # (devcache.c: the reuse, its ordering and its bounds)
            self._blocks = _pinmem._DeviceCache(self._stream)
        # One block of the cache for the whole batch, its leaves at aligned offsets, copied into
        # on the loader's stream after the block's last release. The leaves record the copies:
        # DLPack consumers wait for them on their stream. The pinned sources stay alive until
        # the copies are done, then go back to the pool.
        return self._blocks.batch(bufs)

    # ---- the Loader interface ----

    def __iter__(self):
        if self._tensors:
            return self.as_torch()
        return _IterableEpochIterator(self)

    def as_torch(self):
        """Like iterating, but each array becomes a torch tensor (torch.from_dlpack)."""
        import torch
        return _IterableEpochIterator(self, torch.from_dlpack)

    def batches(self):
        raise InvalidError("PM_ERR_INVALID: batches() gives Batch objects with the dataset "
                           "index of each row; an IterableDataset's samples have no index: "
                           "iterate the loader")

    def __len__(self):
        """As torch's len(DataLoader) for an IterableDataset: len(dataset) in batches (TypeError
        when the dataset has no __len__). The workers may deliver more short batches than that
        (each one's last), as torch's."""
        n = len(self.dataset)
        if self._unbatched:
            return n
        return n // self._want if self.drop_last else -(-n // self._want)

    @property
    def epoch(self):
        """The epoch of the next batch: the one in progress, else the next to begin."""
        e = self._epoch()
        return e.number if e is not None and not e.done else self._epochs_begun

    def worker_pids(self):
        return [] if self._pool is None else self._pool.pids()

    def state_dict(self):
        raise InvalidError("PM_ERR_INVALID: state_dict() with an IterableDataset: a stream has "
                           "no position pinmem can name; save and restore the dataset's own "
                           "position (e.g. samples consumed) and skip ahead in its __iter__")

    def load_state_dict(self, state):
        raise InvalidError("PM_ERR_INVALID: load_state_dict() with an IterableDataset: a stream "
                           "has no position pinmem can resume; restore the dataset's own "
                           "position before iterating")

    def stats(self):
        """batches (delivered since the loader was made), epochs (begun), iteration_seconds
        (time inside the iterators' __next__), workers ('process', or 'main' when the main
        process iterates the dataset) and worker_pids. Device batches: device_allocations
        (device blocks allocated: at most the batches alive at once, never one per batch),
        device_reuses (batches that took a block back), device_blocks and device_bytes (device
        memory the loader holds now, its batches' and its free blocks')."""
        if self._closed:
            _loader._closed()
        d = self._blocks.stats() if self._blocks is not None else \
            {"allocations": 0, "reuses": 0, "blocks": 0, "bytes": 0}
        return {"batches": self._batches, "epochs": self._epochs_begun,
                "iteration_seconds": self._iteration_s,
                "workers": "process" if self.num_workers else "main",
                "worker_pids": self.worker_pids(),
                "device_allocations": d["allocations"], "device_reuses": d["reuses"],
                "device_blocks": d["blocks"], "device_bytes": d["bytes"]}

    def close(self):
        """Stop the worker processes (terminated if they do not go within 5 s) and free the
        device blocks no batch holds. Batches still alive keep their memory until they go.
        Closing twice is harmless."""
        self._closed = True
        self._epoch = _no_epoch
        try:
            self._stop_workers()
        finally:
            blocks, self._blocks = self._blocks, None
            self._stream = None
            if blocks is not None:
                blocks.close()
            if getattr(self, "_stager", None) is not None:
                self._stager.close()  # copies in flight done: their pinned blocks go back

    def __del__(self):
        try:
            if getattr(self, "_pool", None) is not None or \
                    getattr(self, "_blocks", None) is not None:
                self.close()
        except Exception:
            pass
