"""Patch group ``checkpoint_writer_fixes`` (megatron.core.dist_checkpointing.strategies: base and
filesystem_async): megatron-core's checkpoint writer, by release — a synchronous save written in
place rather than through the queue of asynchronous saves (before 0.15, where a restarted rank's
first save fails on the queue's count), and torch's ``_write_item`` given the serialization format
torch 2.7 and later require (0.12). The fixes and their gates are ``compat.checkpoint_writer_fixes``."""
from mindspeed_ha import compat


def patches(ctx=None):
    return compat.checkpoint_writer_fixes()
