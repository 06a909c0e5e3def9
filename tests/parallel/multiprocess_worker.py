"""One process of the multi-process tests (``tests/parallel/test_multiprocess.py``); started by ``treejax.launch``
(``--module multiprocess_worker``) or directly with ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
``JAX_PROCESS_ID`` in its environment.

``python -m multiprocess_worker helpers OUT``: checks the host-side rules of :mod:`treejax.parallel.multihost`
against one global mesh over every process's devices and writes what it saw to ``OUT/result{i}.json``.

``python -m multiprocess_worker die``: after a first collective, process 1 kills itself (SIGKILL) while process 0
keeps running collectives; process 0 exits with status 3 if it is still running after 120 s (nothing stopped it).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def helpers(out_dir: str) -> None:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from treejax.checkpoint import Checkpointer, abstract_state_with_shardings
    from treejax.errors import ConfigError, record_failure
    from treejax.metrics import MetricsWriter, NullWriter
    from treejax.parallel import multihost
    from treejax.parallel.mesh import MeshConfig, make_mesh, replicated
    from treejax.run_dir import LOCK_NAME, claim_log_dir

    pid, n = jax.process_index(), jax.process_count()
    out: dict = {"process": pid, "processes": n, "devices": jax.device_count(), "local": jax.local_device_count()}
    mesh = make_mesh(MeshConfig(fsdp=-1))
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    value = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    x = jax.make_array_from_callback(value.shape, rows, lambda idx: value[idx])
    out["x_fully_addressable"] = x.is_fully_addressable
    try:
        np.asarray(x)
        out["np_asarray"] = "read"
    except RuntimeError as e:
        out["np_asarray"] = str(e).split(".")[0]
    host = multihost.host_tree({"x": x, "sum": jax.jit(lambda a: a.sum(), out_shardings=replicated(mesh))(x),
                                "np": value[:1]})
    out["gathered_equal"] = bool(np.array_equal(host["x"], value)) and float(host["sum"]) == float(value.sum())
    out["packed_equal"] = _packing_of_a_sharded_forest(mesh)
    out["any_true"] = multihost.any_process(pid == 1)
    out["any_false"] = multihost.any_process(False)
    out["broadcast"] = multihost.broadcast_text(f"from process {pid}")
    out["broadcast_none"] = multihost.broadcast_text(None if pid == 0 else "not sent")

    # a refused log folder: every process raises process 0's ConfigError
    finished = os.path.join(out_dir, "finished")
    if pid == 0:
        os.makedirs(finished, exist_ok=True)
        with open(os.path.join(finished, "summary.json"), "w") as f:
            f.write("{}")
    multihost.sync("finished_written")
    try:
        with claim_log_dir(finished, "new"):
            out["refused"] = None
    except ConfigError as e:
        out["refused"] = str(e)
    # a free folder: process 0 holds the lock for everyone; no process fails
    run = os.path.join(out_dir, "run")
    with claim_log_dir(run, "new"):
        multihost.sync("claimed")
        with open(os.path.join(run, LOCK_NAME)) as f:
            out["lock_holder"] = f.read()
        out["pid"] = os.getpid()
        writer = MetricsWriter(run) if multihost.is_primary() else NullWriter()
        writer.write_scalars(1, {"loss": 1.0}, console=False)
        writer.close()
        # orbax across processes: a sharded state saved and restored by every process together
        state = {"w": x, "step": jax.device_put(np.int32(7), replicated(mesh))}
        with Checkpointer(os.path.join(run, "checkpoints")) as ckpt:
            ckpt.save(1, state, {"rl_step": 1, "by": pid}, force=True)
            ckpt.wait()
            restored, data = ckpt.restore(abstract_state_with_shardings(state))
        back = multihost.host_tree(restored)
        out["restored_equal"] = bool(np.array_equal(back["w"], value)) and int(back["step"]) == 7
        out["restored_sharding"] = str(restored["w"].sharding.spec)
        out["data"] = data
        record_failure(run, 3, RuntimeError(f"test failure on process {pid}"), process=pid if n > 1 else None)
        multihost.sync("done")
    with open(os.path.join(out_dir, f"result{pid}.json"), "w") as f:
        json.dump(out, f)


def _packing_of_a_sharded_forest(mesh) -> bool:
    """The packed batch of a forest whose arrays are sharded over both processes' devices (as the sampler's are
    on GPUs) equals the one of the same forest held in NumPy."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from treejax.forest import forest_from_paths
    from treejax.parallel import multihost
    from treejax.rl import packing

    paths = np.array([[0, 1, 2], [0, 1, 3], [0, 4, 5], [0, 4, 6]])[None].repeat(8, 0)  # 8 prompts, W=4, depth 2
    tokens = np.random.default_rng(0).integers(3, 50, (8, 4, 4))
    tokens[:, 1, :2], tokens[:, 3, :2] = tokens[:, 0, :2], tokens[:, 2, :2]  # shared first segments
    forest = forest_from_paths(paths, np.full((8, 4), 4), 2, tokens=tokens)
    adv = np.random.default_rng(1).normal(size=(8, 4, 4)).astype(np.float32)
    prompts, lens = np.full((8, 3), 7, np.int32), np.full((8,), 3, np.int32)
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    shard = lambda a: jax.make_array_from_callback(a.shape, rows, lambda idx: np.asarray(a)[idx])  # noqa: E731
    sharded = jax.tree.map(shard, forest)
    assert not sharded.tokens.is_fully_addressable
    cfg = packing.PackingConfig(granule=4)
    got = packing.forest_to_packed(shard(prompts), shard(lens), sharded, shard(adv), config=cfg)
    want = packing.forest_to_packed(prompts, lens, forest, adv, config=cfg)
    got, want = multihost.host_tree(got), multihost.host_tree(want)
    return all(bool(np.array_equal(a, b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def die() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from treejax.parallel import multihost
    from treejax.parallel.mesh import MeshConfig, make_mesh, replicated

    mesh = make_mesh(MeshConfig(fsdp=-1))
    step = jax.jit(lambda a: jnp.sum(a) + 1, out_shardings=replicated(mesh))
    x = jax.device_put(np.ones(jax.device_count(), np.float32), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("fsdp")))
    float(step(x))
    multihost.sync("both_running")
    print(f"process {jax.process_index()}: running", flush=True)
    if jax.process_index() == 1:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    while time.monotonic() - start < 120:
        float(step(x))  # a collective with every process, again and again
        time.sleep(0.05)
    print("process 0: still running 120 s after process 1 died", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    from treejax.parallel.multihost import maybe_initialize_distributed

    if not maybe_initialize_distributed():
        sys.exit("multiprocess_worker: no JAX_COORDINATOR_ADDRESS in the environment")
    {"helpers": lambda: helpers(sys.argv[2]), "die": die}[sys.argv[1]]()
