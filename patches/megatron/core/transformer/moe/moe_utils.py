"""megatron.core.transformer.moe.moe_utils: 0.16.1 reads ``te_general_gemm`` even when Transformer
Engine is absent (NameError in the router); without TE there is no such kernel, i.e. None."""

TARGET = "megatron.core.transformer.moe.moe_utils"


def patches(ctx=None):
    import megatron.core.transformer.moe.moe_utils as target
    return [] if hasattr(target, "te_general_gemm") else [(TARGET, "te_general_gemm", None)]
