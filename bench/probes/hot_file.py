"""The 3 GiB page-cache-hot file the hot_* probes read, and the pass over it that
compare_checkpoint makes before each hot load (warm), after which the CPU caches hold other
bytes."""
import os

import pinmem
import torch

SIZE = 3 << 30


def make(folder, name):
    """A file of SIZE random bytes in folder, written through the page cache; its path."""
    p = os.path.join(folder, name)
    data = torch.randint(0, 255, (SIZE,), dtype=torch.uint8).numpy()
    pinmem.write_file(p, data, io="buffered").wait()
    return p


def warm(p):
    with open(p, "rb") as f:
        while f.read(16 << 20):
            pass
