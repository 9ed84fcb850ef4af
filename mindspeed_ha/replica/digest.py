"""The digest of a tensor's bytes, on its own device: what replica peers compare (verify.py) and what
a shard's fingerprint is made of (ReplicaMixin.ha_fingerprint)."""
from __future__ import annotations

import torch

# A digest of a tensor's bytes, on its own device: the bytes read as integers (the widest word that
# divides them), each multiplied by an odd weight drawn from its position and summed modulo 2**64.
# Flipping any bit changes one word by a power of two, which times an odd weight is not 0 modulo
# 2**64: a single flipped bit always changes the digest. Words are taken in chunks, so what the digest
# allocates beside the tensor stays bounded (a few int64 copies of one chunk).
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
DIGEST_CHUNK = 1 << 22  # words per chunk
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as an int64: Weyl's sequence for the weights


def digest(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """An int64 scalar on ``device`` (the tensor's by default): see the comment above."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if device is not None and raw.device != device:
        raw = raw.to(device)  # (Adam's step counter, a CPU scalar beside a device shard: 4 bytes)
    size = next(n for n in (8, 4, 2, 1) if raw.numel() % n == 0 and raw.storage_offset() % n == 0)
    words = raw.view(_WORDS[size])
    total = torch.zeros((), dtype=torch.int64, device=raw.device)
    for at in range(0, words.numel(), DIGEST_CHUNK):
        chunk = words[at:at + DIGEST_CHUNK]
        weights = torch.arange(at, at + chunk.numel(), dtype=torch.int64, device=raw.device).mul_(_GOLDEN).bitwise_or_(1)
        total += weights.mul_(chunk).sum()  # (in the weights: the chunk may be the tensor's own memory)
    return total + words.numel()  # (the length too: a tensor of zeros is told from an empty one)
