"""One torchft replica group (one rank) training the mttr benchmark's megatron-core GPT with torchft's
own pieces: its Manager (quorum through its lighthouse, healing over its HTTP checkpoint transport),
its DistributedDataParallel and optimizer wrapper. Started, killed and restarted by
``benchmarks/mttr.py``; needs ``pip install 'mindspeed-ha[peers]'``.

Model arguments as for examples/pretrain_gpt.py; the rest from the environment: FT_REPLICA_ID,
FT_REPLICAS, FT_FAULT_STEP (this replica SIGKILLs itself after completing it, once), FT_EVENTS
(a JSON-lines file this replica appends its step events to), TORCHFT_LIGHTHOUSE, MASTER_ADDR/PORT.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main() -> None:
    from mindspeed_ha.adaptor import apply_patches
    from mindspeed_ha.device import detect
    from mindspeed_ha.trainer.args import build_parser, finalize
    args = finalize(build_parser().parse_args(), 1)
    rid, replicas = int(os.environ["FT_REPLICA_ID"]), int(os.environ["FT_REPLICAS"])
    fault_step = int(os.environ.get("FT_FAULT_STEP", "-1"))
    restarted = os.environ.get("FT_RESTARTED") == "1"
    device = detect()
    apply_patches(device, megatron_lm=False, ha=False)

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from mindspeed_ha.trainer import configs, data

    dist.init_process_group("gloo")  # world of 1: megatron-core's groups, and the Manager's TCPStore
    ps.initialize_model_parallel(1, 1)
    configs.set_seed(args.seed)
    config = configs.transformer_config(args)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=data.padded_vocab_size(args.vocab_size, 1),
                     max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="learned_absolute")
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                              eps=args.adam_eps, weight_decay=args.weight_decay)
    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, replica_id=f"mttr_{rid}",
                      load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
                      state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
                      timeout=timedelta(seconds=30), rank=0, world_size=1)
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    dataset = data.build_train_dataset(args, args.train_iters * args.micro_batch_size * replicas)
    out = open(os.environ["FT_EVENTS"], "a", buffering=1)

    def emit(event: str, **kw) -> None:
        out.write(json.dumps({"event": event, "replica": rid, "pid": os.getpid(), "time": time.time(), **kw}) + "\n")

    emit("start", restarted=restarted)
    batches = None
    while manager.current_step() < args.train_iters:
        t0 = time.perf_counter()
        optimizer.zero_grad()
        if batches is None:  # positioned once the quorum (and a heal) told us the step
            batches = data.SampleIterator(dataset, manager.current_step() * args.micro_batch_size * replicas,
                                          args.micro_batch_size, rid, replicas)
        b = next(batches)
        losses = ddp(b["tokens"], b["position_ids"], None, labels=b["labels"])
        mask = b["loss_mask"].view(-1).float()
        loss = (losses.float().view(-1) * mask).sum() / mask.sum()
        loss.backward()
        optimizer.step()
        step = manager.current_step()
        emit("step", step=step, step_s=time.perf_counter() - t0, participants=manager.num_participants())
        if step == fault_step and not restarted:
            emit("inject", step=step)
            out.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    out.close()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
