"""Drop-in for Megatron-LM's pretrain_gpt.py with mindspeed-ha.

With Megatron-LM's ``megatron.training`` importable (e.g. MEGATRON_LM_PATH pointing at a checkout),
mindspeed-ha's adaptor is applied and Megatron-LM's own pretrain runs. Otherwise the built-in
megatron-core trainer runs, taking the same argument names.
"""
import os
import sys

if os.environ.get("MEGATRON_LM_PATH"):
    sys.path.insert(0, os.environ["MEGATRON_LM_PATH"])

if __name__ == "__main__":
    from mindspeed_ha.adaptor import megatron_lm_available

    if megatron_lm_available():
        from mindspeed_ha.megatron_lm import pretrain_gpt_main
        sys.exit(pretrain_gpt_main())
    from mindspeed_ha.trainer.main import run
    sys.exit(run())
