"""Shared pinned memory from Python: the loader's worker processes hold the memfds of its slots.

A worker (any code running there: the dataset) can reach those memfds. It must not be able to
resize them: a shrunk file takes the pages from under the main process's mapping, which then
dies of SIGBUS at its next access to the slot. The scenario runs in a child interpreter, so a
crash there is reported here instead of ending the test run.
"""
import os
import subprocess
import sys
import textwrap

import pytest

import pinmem

SCRIPT = textwrap.dedent("""
    import errno, os, sys
    import numpy as np
    import pinmem

    ROW = 4099  # odd: rows straddle pages

    class Resizer:
        '''Each sample first tries to shrink and to grow every pinmem memfd this worker holds,
        then returns its row; the tries that were refused (EPERM) travel with it.'''
        def __len__(self):
            return 96

        def __getitem__(self, i):
            found = refused = 0
            for name in os.listdir("/proc/self/fd"):
                try:
                    target = os.readlink(f"/proc/self/fd/{name}")
                except OSError:
                    continue
                if "memfd:pinmem-shared" not in target:
                    continue
                fd = int(name)
                size = os.fstat(fd).st_size
                for new in (0, size // 2, size + 4096):
                    found += 1
                    try:
                        os.ftruncate(fd, new)
                    except OSError as e:
                        refused += e.errno == errno.EPERM
            row = np.full(ROW, i % 251 + 1, np.uint8)
            return row, np.int64(found), np.int64(refused)

    if __name__ == "__main__":
        context = sys.argv[1]
        found = refused = rows = 0
        with pinmem.Loader(Resizer(), batch_size=8, num_workers=2, device="cpu",
                           multiprocessing_context=context) as loader:
            for epoch in range(2):
                for x, f, r in loader:
                    x = np.asarray(x)  # the main process reads every byte of its slot
                    for k in range(x.shape[0]):
                        assert (x[k] == x[k, 0]).all() and 1 <= x[k, 0] <= 251, k
                    rows += x.shape[0]
                    found += int(np.asarray(f).sum())
                    refused += int(np.asarray(r).sum())
        print("rows", rows, "found", found, "refused", refused)
""")


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_cannot_resize_a_slot_memfd(tmp_path, context):
    if not sys.platform.startswith("linux"):
        pytest.skip("memfds and /proc/self/fd are Linux's")
    script = tmp_path / "resize.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(pinmem.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    r = subprocess.run([sys.executable, str(script), context], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    report = f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    assert r.returncode == 0, report  # -7 (SIGBUS): a worker shrank a slot under the main process
    words = r.stdout.split()
    assert words[0::2] == ["rows", "found", "refused"], report
    rows, found, refused = (int(w) for w in words[1::2])
    assert rows == 2 * 96, report
    assert found > 0, "the workers saw no pinmem memfd: the test proves nothing\n" + report
    assert refused == found, report
