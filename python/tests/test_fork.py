"""fork() after pinmem was used (docs/RELIABILITY.md, pinmem.h: the rule for forked children).

Each case runs in its own interpreter (subprocess with a timeout), so a child that hangs fails
the test instead of stalling the run. On the host backend the child's copies work; on the cuda
backend the child's first call raises pinmem.Error (PM_ERR_STATE) naming spawn, at once.
"""
import os
import subprocess
import sys
import textwrap

import pytest

TIMEOUT = 60

PRELUDE = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import pinmem

    def round_trip(n, seed):
        src = np.random.default_rng(seed).integers(1, 256, size=n, dtype=np.uint8)
        dev = pinmem.device_empty(n, "uint8")
        back = np.zeros(n, dtype=np.uint8)
        pinmem.copy(dev, src).wait()
        pinmem.copy(back, dev).wait()
        return bool((back == src).all())

    def reap(pid, seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return "hung"

    # The parent uses pinmem first: pool, staged and direct copies, a loader with workers.
    assert round_trip((1 << 20) + 3, 1)
    pinned = pinmem.empty(4096, "uint8")
    np.asarray(pinned)[:] = 7
    dev = pinmem.device_empty(4096, "uint8")
    pinmem.copy(dev, pinned).wait()
    X = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    loader = pinmem.Loader(X, batch_size=100, num_workers=2)
    it = iter(loader)
    first = next(it)
    CUDA = pinmem.backend() == "cuda"

    def finish():
        global first
        first = None  # the batch held since the fork
        loader.close()
""")


def run(body):
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def test_child_copy_after_fork():
    out = run("""
        pid = os.fork()
        if pid == 0:
            try:
                ok = round_trip(100, 2) and round_trip((1 << 20) + 7, 3)
                os._exit(0 if ok else 1)
            except pinmem.Error as e:
                os._exit(0 if CUDA and "spawn" in str(e) else 2)
            except BaseException:
                os._exit(3)
        code = reap(pid, 30)
        assert code == 0, code
        # The parent is untouched: its loader and copies go on.
        assert round_trip(100, 4)
        assert next(it) is not None
        finish()
        print("ok")
    """)
    assert "ok" in out


def test_child_pointer_info_does_not_claim_parent_pinning():
    run("""
        assert pinmem.pointer_info(pinned)["kind"] != "pageable"
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(0 if pinmem.pointer_info(pinned)["kind"] == "pageable" else 1)
            except pinmem.Error as e:
                os._exit(0 if CUDA and "spawn" in str(e) else 2)
        assert reap(pid, 30) == 0
    """)


def test_child_release_of_a_parent_block_names_the_fork():
    run("""
        pid = os.fork()
        if pid == 0:
            try:
                pinned.release()
                os._exit(1)  # the parent's block is not the child's to release
            except pinmem.NotFoundError as e:
                os._exit(0 if "forked from one that used pinmem" in str(e) else 2)
            except pinmem.Error as e:  # the cuda backend may refuse any call here first
                os._exit(0 if CUDA and "spawn" in str(e) else 3)
        assert reap(pid, 30) == 0
        pinned.release()  # the parent's block is still its own
        finish()
    """)


def test_child_that_only_exits_with_a_live_loader():
    # The child runs the atexit handlers (Loader.close of the parent's loader, the copy sweep):
    # none may wait for the parent's threads.
    run("""
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        code = reap(pid, 30)
        assert code == 0, code
        finish()
    """)


def test_multiprocessing_fork_pool_copies():
    out = run("""
        import multiprocessing as mp

        def work(i):
            try:
                return "ok" if round_trip(1000 + i, i) else "bad"
            except pinmem.Error as e:
                return "state-spawn" if "spawn" in str(e) else "error: " + str(e)

        with mp.get_context("fork").Pool(2) as pool:
            res = pool.map_async(work, range(8)).get(timeout=40)
        want = "state-spawn" if CUDA else "ok"
        assert res == [want] * 8, res
        finish()
        print("pool done")
    """)
    assert "pool done" in out


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="needs os.register_at_fork")
def test_fork_before_any_use_works():
    code = textwrap.dedent("""
        import os, numpy as np, pinmem
        pid = os.fork()
        if pid == 0:
            src = np.arange(100, dtype=np.uint8) + 1
            dev = pinmem.device_empty(100, "uint8")
            back = np.zeros(100, np.uint8)
            pinmem.copy(dev, src).wait()
            pinmem.copy(back, dev).wait()
            os._exit(0 if (back == src).all() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
