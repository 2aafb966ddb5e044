#!/usr/bin/env python3
"""Offload the KV cache of a real attention layer to pinned memory and bring it back.

A two-layer decoder attention over a paged KV cache (per layer, K and V apart, each
[num_blocks, block_size, heads, head_dim], as vLLM lays it out): a prefill writes three
sequences' keys and values into pages through their block tables, and a decode step runs
torch.nn.functional.scaled_dot_product_attention over the pages. Then every page goes to a
pinmem.KVBlockStore in one swap_out, the device pages are wiped and reused, and one swap_in
brings the blocks back into other pages (new block tables). The decode step's outputs must be
identical, bit for bit.

    python3 python/examples/kv_offload.py

Runs on a GPU (pinmem's cuda backend) and on the CPU (PINMEM_BACKEND=host: the KV cache lives in
pinmem device memory, which the host backend keeps in RAM).
"""
import torch
import torch.nn.functional as F

import pinmem

LAYERS, HEADS, HEAD_DIM, BLOCK, PAGES = 2, 4, 32, 16, 48
DTYPE = torch.float32
device = "cuda" if pinmem.backend() == "cuda" else "cpu"
g = torch.Generator().manual_seed(0)

# One Wq, Wk, Wv per layer; the cache: per layer a K and a V tensor of pages.
hidden = HEADS * HEAD_DIM
W = [[(torch.randn(hidden, hidden, generator=g) / hidden ** 0.5).to(device) for _ in range(3)]
     for _ in range(LAYERS)]
caches = [pinmem.kv_device_tensor((PAGES, BLOCK, HEADS, HEAD_DIM), DTYPE) for _ in range(2 * LAYERS)]
for c in caches:
    c.zero_()


def prefill(tokens, table):
    """Write the sequence's K and V of every layer into its pages."""
    for layer in range(LAYERS):
        k = (tokens @ W[layer][1]).view(-1, HEADS, HEAD_DIM)
        v = (tokens @ W[layer][2]).view(-1, HEADS, HEAD_DIM)
        for pos in range(tokens.shape[0]):
            page, slot = table[pos // BLOCK], pos % BLOCK
            caches[2 * layer][page, slot] = k[pos]
            caches[2 * layer + 1][page, slot] = v[pos]


def decode(query, length, table):
    """One query token's attention output in every layer, reading K and V from the pages."""
    outs = []
    for layer in range(LAYERS):
        q = (query @ W[layer][0]).view(HEADS, 1, HEAD_DIM)
        idx = torch.tensor(table, device=caches[0].device)
        k = caches[2 * layer][idx].reshape(-1, HEADS, HEAD_DIM)[:length].transpose(0, 1)
        v = caches[2 * layer + 1][idx].reshape(-1, HEADS, HEAD_DIM)[:length].transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(q.to(k.device), k, v))
    return torch.stack(outs)


lengths = [37, 16, 70]
free_pages = list(range(PAGES))
tables, seqs, queries = [], [], []
for n in lengths:
    pages = (n + BLOCK - 1) // BLOCK
    tables.append([free_pages.pop(0) for _ in range(pages)])
    seqs.append(torch.randn(n, hidden, generator=g).to(device))
    queries.append(torch.randn(hidden, generator=g).to(device))
    prefill(seqs[-1], tables[-1])
before = [decode(q, n, t) for q, n, t in zip(queries, lengths, tables)]

# Offload every page of every sequence in one call.
store = pinmem.KVBlockStore(caches, num_blocks=64)
used = [p for t in tables for p in t]
host = store.alloc(len(used))
store.swap_out(used, host).wait()

# The device pages are wiped and reused; the blocks come back into other pages.
for c in caches:
    c.fill_(float("nan"))
new_pages = list(range(PAGES - 1, PAGES - 1 - len(used), -1))
store.swap_in(new_pages, host).wait()
where = dict(zip(used, new_pages))
tables = [[where[p] for p in t] for t in tables]
after = [decode(q, n, t) for q, n, t in zip(queries, lengths, tables)]

for b, a in zip(before, after):
    assert torch.equal(b, a), "the attention output changed after the KV round trip"
s = store.stats()
print(f"{len(used)} blocks of {store.block_bytes} bytes ({LAYERS} layers, K and V) out and back "
      f"on the {pinmem.backend()} backend: decode outputs identical; pieces by kernel "
      f"{s['pieces_kernel']}, by DMA {s['pieces_dma']}")
store.free(host)
store.close()
