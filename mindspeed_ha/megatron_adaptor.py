"""``import mindspeed_ha.megatron_adaptor`` before Megatron: applies every mindspeed-ha patch
(MindSpeed's convention). Idempotent. In a spare worker (recover) the import then waits until the
agent hands it a lost rank: the script goes on as that rank, its imports and patches already done."""
from mindspeed_ha.adaptor import apply_patches
from mindspeed_ha.launcher import spare

DEVICE = apply_patches()
if spare.is_spare():
    spare.wait_for_assignment()
