#!/usr/bin/env bash
# Sweep the staging of pageable copies (copy_memcpy x copy_chunk x copy_slots x copy_threads) at
# one size: the whole-copy bounce block and the ring side by side with the plain pageable copy,
# H2D and D2H, one JSON line per row (each row names the configuration). Used to pick the copy
# engine's defaults on a GPU machine (docs/performance.md).
#   bench/gpu_sweep.sh [PINMEM_BINARY] [SIZE]   (defaults: build-gpu/pinmem, 1G)
# MOVERS and CONFIGS (chunk:slots pairs) and THREADS override the lists below.
set -uo pipefail
BIN=${1:-build-gpu/pinmem}
SIZE=${2:-1G}
CASES=plain_pageable,pinmem_pageable,pinmem_pageable_ring
MOVERS=${MOVERS:-libc movsb stream}
CONFIGS=${CONFIGS:-4M:32 1M:16 2M:8}
THREADS=${THREADS:-8 16}
for mover in $MOVERS; do
  for threads in $THREADS; do
    for cfg in $CONFIGS; do
      chunk=${cfg%%:*} slots=${cfg##*:}
      PINMEM_COPY_MEMCPY=$mover PINMEM_COPY_THREADS=$threads PINMEM_COPY_CHUNK=$chunk \
        PINMEM_COPY_SLOTS=$slots timeout 120 "$BIN" bench copy --json --sizes "$SIZE" \
        --cases "$CASES" 2>/dev/null | grep '"bench":"copy"' | grep -v bidir
    done
  done
done
