"""``import mindspeed_ha.megatron_adaptor`` before Megatron: applies every mindspeed-ha patch
(MindSpeed's convention). Idempotent."""
from mindspeed_ha.adaptor import apply_patches

DEVICE = apply_patches()
