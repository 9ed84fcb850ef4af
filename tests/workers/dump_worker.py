"""Harness for the rank-side recovery engine, standing in for the controller.

A real job of the built-in trainer (built as ``mindspeed_ha.trainer.main`` builds it) trains
DUMP_STEPS=K iterations, then, by DUMP_MODE:

* ``dump``: the ranks in DUMP_KILL (comma list) leave with ``os._exit`` — outside any collective, so
  no stop mechanism is needed here. The survivors form a new default group over a fresh TCPStore
  hosted by the lowest survivor on 127.0.0.1:DUMP_STORE_PORT, exchange their shard status (the
  controller would collect it over its own channel), plan, and write the dying-gasp checkpoint into
  ``--save``. Exit 0 when written, 3 on a refusal.
* ``rebuild``: every rank gives its groups new communicators (same world, a new store hosted by rank
  0 on 127.0.0.1:DUMP_STORE_PORT), then trains on to ``--train-iters``; losses must continue as if
  nothing happened.

Launch one process per rank with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun would kill
the survivors when a rank exits). The new rank 0 prints ``DUMP_RESULT {json}``.
"""
import json
import os
import sys
import time
from datetime import timedelta


def build(argv):
    from mindspeed_ha import layout, options as ha_options
    from mindspeed_ha.adaptor import apply_patches
    from mindspeed_ha.device import detect
    from mindspeed_ha.rank.session import RankSession
    from mindspeed_ha.trainer.args import build_parser, finalize
    from mindspeed_ha.trainer.builtin import BuiltinTrainer, init_distributed
    from mindspeed_ha.trainer.main import _quiet_known_warnings

    _quiet_known_warnings()
    args = build_parser().parse_args(argv)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    device = detect()
    args = finalize(args, world)
    opts = ha_options.from_args(args)
    layout.validate(world, args, opts)
    apply_patches(device, megatron_lm=False)
    device.set_current(int(os.environ.get("LOCAL_RANK", "0")))
    init_distributed(args.distributed_backend or device.backend, args.distributed_timeout_minutes)
    trainer = BuiltinTrainer(args, RankSession(opts, device, rank, world, control_plane=False))
    trainer.setup()
    return trainer


def train_to(trainer, last):
    a = trainer.args
    while trainer.iteration < last:
        trainer.train_step()
        if a.save and a.save_interval and trainer.iteration % a.save_interval == 0:
            trainer.save_checkpoint(a.save)


def write_dump(trainer, rank, world):
    import torch.distributed as dist
    from mindspeed_ha import plan as planner
    from mindspeed_ha.comm import groups
    from mindspeed_ha.rank.recovery import dump
    from mindspeed_ha.replica.topology import ReplicaTopology

    kill = {int(r) for r in os.environ.get("DUMP_KILL", "").split(",") if r}
    bench, reps = {}, int(os.environ.get("DUMP_BENCH", "0"))
    if reps:
        # Same state, same warm writer: periodic saves by all ranks, then the survivors' dumps.
        from mindspeed_ha.trainer_state import checkpoint
        checkpoint.writer_ready()
        bench["periodic_s"] = [checkpoint.save(trainer, f"{trainer.args.save}_periodic{i}")[1] for i in range(reps)]
    if rank in kill:
        trainer.session.events.emit("harness_exit", iteration=trainer.iteration)
        trainer.session.events.close()
        os._exit(17)
    survivors = [r for r in range(world) if r not in kill]
    t0 = time.perf_counter()
    prep = dump.prepare(trainer)  # local: reads parallel_state while the old groups still exist
    t1 = time.perf_counter()
    w = groups.survivor_world(survivors, rank, "127.0.0.1", int(os.environ["DUMP_STORE_PORT"]), generation=1,
                              host_rank=survivors[0], timeout=timedelta(seconds=30))
    t_group = time.perf_counter() - t1
    topo = trainer.optimizer.ha_topology
    statuses = [None] * len(survivors)
    dist.all_gather_object(statuses, {**prep.status, "dp_ranks": list(topo.dp_ranks), "replica_num": topo.replica_num})
    # (the controller knows every rank's replica group from its registration; here the survivors'
    # layouts name those of the dead ranks)
    known = {r: ReplicaTopology(r, tuple(s["dp_ranks"]), s["replica_num"]).replica_group
             for s in statuses for r in s["dp_ranks"]}
    holders = planner.holders(world, {s["rank"]: s for s in statuses}, known)
    plan = planner.plan_dump(holders, dump.newest_checkpoint(trainer.args.save))
    out = {"plan_ok": plan.ok, "message": plan.message(), "group_s": t_group}
    if not plan.ok:
        trainer.session.events.emit("dump_refused", message=plan.message(),
                                    missing=[list(g) for g in plan.missing])
        if w.new_rank == 0:
            print("DUMP_RESULT " + json.dumps(out), flush=True)
            print(f"mindspeed-ha: {plan.message()}", file=sys.stderr, flush=True)
        return 3
    if reps:
        bench["dump_s"] = [dump.write(prep, plan, w, f"{trainer.args.save}_dump{i}").seconds
                           for i in range(reps)]
    res = dump.write(prep, plan, w, trainer.args.save)
    out.update(bench)
    out.update(iteration=res.iteration, path=res.path, seconds=res.seconds, writers=res.writers,
               files=res.files, bytes=res.bytes, total_s=time.perf_counter() - t0)
    if w.new_rank == 0:
        print("DUMP_RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    return 0


def reconnect(trainer, rank, world):
    import torch.distributed as dist
    from mindspeed_ha.comm import groups

    port = int(os.environ["DUMP_STORE_PORT"])
    if rank == 0:  # the controller would serve this store
        server = dist.TCPStore("127.0.0.1", port, world, True, wait_for_workers=False)  # noqa: F841
    t0 = time.perf_counter()
    got = groups.reconnect("127.0.0.1", port, generation=1)
    seconds = time.perf_counter() - t0
    train_to(trainer, trainer.args.train_iters)
    if rank == 0:
        print("DUMP_RESULT " + json.dumps({"reconnected": got["groups"], "seconds": seconds}), flush=True)
    return 0


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainer = build(sys.argv[1:])
    from mindspeed_ha.trainer_state import checkpoint
    if not os.environ.get("DUMP_NO_PREWARM"):
        checkpoint.prewarm_writer()
    train_to(trainer, int(os.environ["DUMP_STEPS"]))
    code = {"dump": write_dump, "rebuild": reconnect}[os.environ.get("DUMP_MODE", "dump")](trainer, rank, world)
    trainer.session.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # The checkpoint writer leaves a spawned multiprocessing manager behind; os._exit would orphan it.
    import multiprocessing
    for child in multiprocessing.active_children():
        child.terminate()
    os._exit(code)  # skip interpreter teardown: the job's groups point at a dead peer


if __name__ == "__main__":  # the checkpoint writer spawns processes
    main()
