"""A trainer's state as the engine handles it: the interface every trainer implements for the
recovery (``interface.TrainerInterface``), its checkpoints (``checkpoint``: megatron-core's
dist-checkpointing save and load; ``checkpoint_dir``: the directory, its tracker and manifests) and
its RNG history (``rng``). Below the trainers and the rank runtime, which both use it."""
