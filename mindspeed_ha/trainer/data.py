"""Training data through megatron.core.datasets: MockGPTDataset (default) or indexed .bin/.idx files.

The position in the data is one number, ``consumed_samples``: the iterator for a step is a pure
function of it, so a resumed or repaired rank reads exactly the samples the lost one would have.
Sampling follows Megatron-LM's MegatronPretrainingSampler: each global batch is laid out as
micro-batch-sized slices, DP rank r reading slice r of every micro-batch group.
"""
from __future__ import annotations

import os

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset, MockGPTLowLevelDataset
from megatron.core.datasets.utils import get_blend_from_list

from mindspeed_ha.device import current


class NullTokenizer:
    """What megatron.core.datasets reads of a tokenizer for mock data and pre-tokenized files, as
    Megatron-LM's NullTokenizer gives it: the end-of-document id is the one after the vocabulary
    (so the vocabulary is one larger), and no padding id. The engine's own: megatron-core has a
    NullTokenizer of its own only from 0.15 (``megatron.core.tokenizers``)."""

    def __init__(self, vocab_size: int):
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1
        self.pad = -1
        self.unique_identifiers = {"class": "NullTokenizer", "vocab_size": self.vocab_size}


class _MockTokens(MockGPTLowLevelDataset):
    """megatron-core's mock documents (1, 2, 3, ... then EOD), each token within the vocabulary as
    0.16 and later make it; before 0.16 they count up to 4,095 whatever the vocabulary, past a small
    one's embedding (IndexError in the first forward). The same tokens in every release."""

    def __getitem__(self, idx: int):
        return super().__getitem__(idx) % self.tokenizer_vocab_size

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.tokenizer_vocab_size = tokenizer.vocab_size


class _MockDataset(MockGPTDataset):
    """MockGPTDataset over ``_MockTokens``."""

    @staticmethod
    def build_low_level_dataset(dataset_path, config):
        return _MockTokens(config.tokenizer)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's rule: NullTokenizer adds EOD, then pad to a multiple of 128 x TP."""
    multiple = divisible_by * tp
    n = vocab_size + 1
    return ((n + multiple - 1) // multiple) * multiple


def data_prefixes(data_path: list[str] | None) -> list[str]:
    """The dataset prefixes of a --data-path value; a clear error when a .bin/.idx pair is missing."""
    if not data_path:
        return []
    prefixes, _ = get_blend_from_list(data_path)
    for prefix in prefixes:
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            hint = " (give the prefix, without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
            raise FileNotFoundError(f"--data-path {prefix}: no {' or '.join(prefix + e for e in missing)}{hint}")
    return prefixes


def build_train_dataset(args, train_samples: int):
    data_prefixes(args.data_path)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        # Megatron-LM's --data-path grammar: "prefix [prefix ...]" or "w1 prefix1 w2 prefix2 ...".
        blend=get_blend_from_list(args.data_path) if args.data_path else None,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=NullTokenizer(args.vocab_size),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        # (the mid-level datasets' surplus: megatron-core's default, 0.005, in every release; 0.12 has
        # no such field)
    )
    cls = GPTDataset if args.data_path else _MockDataset
    train, _, _ = BlendedMegatronDatasetBuilder(
        cls, [train_samples, 0, 0], lambda: True, config).build()
    return train


_MASK40 = (1 << 40) - 1


def sample_fingerprint(indices) -> int:
    """An order-free fingerprint of sample indices: a sum of 40-bit mixes (splitmix64's finaliser),
    so that the data-parallel ranks' parts add up (one int64 all-reduce, no overflow below 2^23
    samples) to the same value whichever way a global batch is split among them."""
    total = 0
    for i in indices:
        z = (i + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        total += (z ^ (z >> 31)) & _MASK40
    return total


def tokens_fingerprint(tokens) -> int:
    """``sample_fingerprint`` over samples known by their tokens (a batch's rows), where a loop's
    batches carry no sample index (Megatron-LM's): each row's bytes stand for its index."""
    import hashlib
    rows = tokens.reshape(tokens.shape[0], -1).cpu().numpy()
    return sample_fingerprint(int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little")
                              for row in rows)


class SampleIterator:
    """Micro-batches for one DP rank, starting at ``consumed_samples``. ``fingerprint``: of the
    samples read since the caller last reset it (a step's, for its ``samples_hash``)."""

    def __init__(self, dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.dataset = dataset
        self.next_index = consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.fingerprint = 0

    def __iter__(self):
        return self

    def __next__(self):
        start = self.next_index + self.dp_rank * self.mbs
        samples = [self.dataset[i] for i in range(start, start + self.mbs)]
        self.fingerprint += sample_fingerprint(range(start, start + self.mbs))
        self.next_index += self.mbs * self.dp_size
        # Read on the CPU, trained on the rank's device.
        return {k: torch.stack([torch.as_tensor(s[k], device="cpu") for s in samples]).to(current())
                for k in ("tokens", "labels", "loss_mask", "position_ids")}
