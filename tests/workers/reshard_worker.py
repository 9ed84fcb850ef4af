"""Four real gloo ranks move optimizer state with ``mindspeed_ha.replica.reshard`` and write what each
ended up with to OUT/rank<r>.json.

    reshard_worker.py OUT              synthetic state, DP=4 layout -> DP=2 layout
    reshard_worker.py OUT ARGS...      a real job of the built-in trainer (ARGS: its command line,
                                       DP=4, two instances) trains two steps; rank 0 then gathers its
                                       instance's whole optimizer state, rank 3 the other instance's
"""
import json
import sys

import torch
import torch.distributed as dist

from mindspeed_ha.replica.reshard import exchange, schedule

SIZES = {"w": 102, "b": 10}         # two parameters; 102 splits unevenly at the new layout


def value(key, i, k):              # state tensor k (main, exp_avg, exp_avg_sq) at element i
    return (1000 * k + i + (0.5 if key == "b" else 0.0)) * (-1 if k == 2 else 1)


def split(n, parts):
    step = -(-n // parts)
    return [(min(n, p * step), min(n, (p + 1) * step)) for p in range(parts)]


def main(out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    held = {r: [(key, *split(n, 4)[r]) for key, n in SIZES.items()] for r in range(4)}
    wanted = {0: [(key, *split(n, 2)[0]) for key, n in SIZES.items()],
              3: [(key, *split(n, 2)[1]) for key, n in SIZES.items()]}
    moves = schedule(held, wanted)
    mine = {(key, a, b): torch.tensor([[value(key, i, k) for i in range(a, b)] for k in range(3)])
            for key, a, b in held[rank]}

    def read(m):
        for (key, a, b), t in mine.items():
            if key == m.key and a <= m.start and m.end <= b:
                return t[:, m.start - a:m.end - a]
        raise KeyError(m)

    new = {(key, a, b): torch.full((3, b - a), float("nan")) for key, a, b in wanted.get(rank, ())}

    def write(m, piece):
        for (key, a, b), t in new.items():
            if key == m.key and a <= m.start and m.end <= b:
                t[:, m.start - a:m.end - a] = piece
                return
        raise KeyError(m)

    got = exchange(moves, rank, read, write, chunk_bytes=12 * 7)  # (7 elements a message: moves cut and packed)
    wrong = [f"{key}[{a + j}] state {k}" for (key, a, b), t in new.items()
             for k in range(3) for j in range(b - a) if t[k, j].item() != value(key, a + j, k)]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"received": got, "wrong": wrong, "moves": len(moves)}, f)
    dist.destroy_process_group()


def gather_real(out, argv):
    import hashlib
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from dump_worker import build
    from mindspeed_ha.replica.reshard import described, state_io
    trainer = build(argv)
    for _ in range(2):
        trainer.train_step()
    opt, rank = trainer.optimizer, dist.get_rank()
    ranges = opt.ha_state_ranges()
    every = [None] * 4
    dist.all_gather_object(every, (opt.ha_topology.instance, described(ranges)))
    params = {name: p for name, (p, _) in opt.ha_param_positions().items()}
    full = {key: (0, params[key[1]].numel()) for _, desc in every for key, _, _ in desc}
    moves = []
    for inst, dst in ((0, 0), (1, 3)):
        held = {r: desc for r, (i, desc) in enumerate(every) if i == inst}
        moves += schedule(held, {dst: [(key, a, b) for key, (a, b) in full.items()]})
    new = {(key, a, b): tuple(torch.full((b - a,), float("nan")) for _ in range(3))
           for key, (a, b) in full.items()} if rank in (0, 3) else {}
    read, _ = state_io(ranges)
    _, write = state_io(new)
    got = exchange(moves, rank, read, write)
    digest = hashlib.sha256()
    for key in sorted(new, key=str):
        for t in new[key]:
            digest.update(t.numpy().tobytes())
    digests = [None] * 4
    dist.all_gather_object(digests, digest.hexdigest() if new else None)
    main_is_param = all(torch.equal(new[k][0], params[k[0][1]].detach().reshape(-1).float()) for k in new)
    moments_set = all(bool(torch.isfinite(t).all()) and bool((t != 0).any()) for ts in new.values() for t in ts[1:])
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"received": got, "twins_equal": digests[0] == digests[3], "main_is_param": main_is_param,
                   "moments_set": moments_set, "entries": len(new), "params": len(params)}, f)
    # End as a worker of the built-in trainer does: left to the interpreter's teardown, the process
    # groups' threads aborted a rank once ("terminate called without an active exception").
    from mindspeed_ha.process import end_of_job
    trainer.session.close()
    end_of_job()


if __name__ == "__main__":
    if len(sys.argv) > 2:
        gather_real(sys.argv[1], sys.argv[2:])
    else:
        main(sys.argv[1])
