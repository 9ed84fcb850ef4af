"""The Megatron-LM adaptor: Megatron-LM's own ``pretrain`` under mindspeed-ha.

``entry``: ``pretrain_gpt_main()`` (what examples/pretrain_gpt.py runs when Megatron-LM is there) and
``prepare()``. ``hooks``: the ``on_*`` functions ``patches/megatron/training`` re-routes Megatron-LM's
own functions into (looked up here, by name, on every call). ``trainer``: the engine's trainer
interface over Megatron-LM's objects; ``loop``: where Megatron-LM's loop is.
"""
from .entry import CPU_ARGS, close_session, prepare, pretrain_gpt_main
from .hooks import (on_build_data_iterators, on_get_megatron_optimizer, on_get_num_microbatches,
                    on_initialize_distributed, on_load_checkpoint, on_parse_args, on_save_checkpoint,
                    on_setup_model_and_optimizer, on_train_step, on_update_num_microbatches)
from .trainer import MegatronLMTrainer

__all__ = ["CPU_ARGS", "close_session", "prepare", "pretrain_gpt_main", "MegatronLMTrainer",
           "on_build_data_iterators", "on_get_megatron_optimizer", "on_get_num_microbatches",
           "on_initialize_distributed", "on_load_checkpoint", "on_parse_args",
           "on_save_checkpoint", "on_update_num_microbatches", "on_setup_model_and_optimizer", "on_train_step"]
