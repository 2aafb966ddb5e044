#!/usr/bin/env python3
"""A torch training loop fed by pinmem.Loader instead of torch.utils.data.DataLoader.

The three changed lines are marked. Batches are read by pinmem's worker threads straight into
pinned memory and copied to the GPU on pinmem's stream while the previous step computes;
as_torch() hands them over with torch.from_dlpack, which makes torch's current stream wait for
the copy without blocking the host.

    python3 python/examples/train_torch.py          # on the GPU; stops, saying why, without one
    python3 python/examples/train_torch.py --cpu    # on the CPU, on purpose
"""
import sys

import numpy as np
import torch

import pinmem

g = np.random.default_rng(0)
X = g.normal(size=(50_000, 64)).astype(np.float32)
Y = (X[:, :8].sum(axis=1) > 0).astype(np.int64)
# No silent CPU: without a usable GPU say why and stop, unless the CPU was asked for.
info = pinmem.backend_info()
if "--cpu" in sys.argv[1:]:
    device = "cpu"
elif torch.cuda.is_available() and info["backend"] == "cuda":
    device = "cuda"
else:
    sys.exit(f"train_torch.py: no usable CUDA GPU (pinmem: {info['reason']}; torch sees "
             f"{torch.cuda.device_count()} device(s)); run with --cpu to train on the CPU")

model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                            torch.nn.Linear(128, 2)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.05)

# Before:
#   loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
#       torch.from_numpy(X), torch.from_numpy(Y)), batch_size=256, shuffle=True,
#       num_workers=4, pin_memory=True)
#   for x, y in loader:
#       x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
loader = pinmem.Loader((X, Y), batch_size=256, shuffle=True, num_workers=4,  # 1
                       seed=0, device=device)                                 # 2
for epoch in range(3):
    total = 0.0
    for x, y in loader.as_torch():                                            # 3
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item()
    print(f"epoch {epoch}: loss {total / len(loader):.4f}")
print("loader:", {k: v for k, v in loader.stats().items()
                  if k in ("batches", "stall_seconds", "copy_seconds")})
