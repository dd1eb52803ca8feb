"""RolloutWorker: one vLLM engine per actor; samples groups, scores them, takes weight pushes.

    Worker = ray.remote(num_cpus=1, max_concurrency=2)(RolloutWorker)   # done where the pool is built
    w = Worker.remote(0, "runs/models/tiny-moe", cfg.rollout, run_dir="runs/job", reward_runner=cfg.rollout.reward)
    samples = ray.get(w.generate.remote(prompts))                       # n = cfg.group_size
    ray.get(w.update_weights.remote(7, bucket_refs, probe))             # -> {"sync/push_s": ..., ...}

Verbs are the coordinator's: `generate`, `continue_samples`, `run_episodes`, `update_weights`, `verify`,
`weight_transfer_call` / `publish_weights` (pushes through vLLM's nccl / ipc backends),
`sleep` / `wake_up` (colocated engines on CUDA), `pause`/`resume`, `current_version`, `last_metrics`, `ping`,
`describe`, `shutdown`. Engine work is serialised
by a lock; `pause`, `resume`, `ping` and `describe` never take it, so with `max_concurrency >= 2` a pause
reaches a running `generate`: its in-flight completions return at once as finish_reason "aborted" (tokens,
log-probs and versions so far kept), and while paused `generate` returns every sample "aborted" with no tokens.
Resume them with `continue_samples` (new tokens are stamped with the then-current version). See RolloutEngine
for what a continuation reproduces.

A weight push must carry every checkpoint tensor (HF names, fused experts or per expert); a failed or partial
push, or a failed probe check, raises WeightSyncError and the worker refuses to sample, at its old version, until
a complete push passes the check (vLLM leaves half-loaded layers behind). The version is published only after.

Rewards are scored off the engine's critical path: a prompt's group goes to the reward runner's thread as soon
as all its samples ended, while the engine keeps generating the others. Aborted samples are scored once a
continuation finishes them.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterable

from gspo_ray.data.records import Prompt, Sample
from gspo_ray.rollout.engine import FINISH_ABORTED, RolloutEngine, SamplingSettings, scheduler_options
from gspo_ray.rollout.weight_sync import VERIFY_TOL, WeightProbe, WeightSyncError, push_buckets, verify_probe
from gspo_ray.rollout.weight_transfer import WEIGHT_TRANSFER_CALLS

MAX_REMEMBERED_PROMPTS = 10_000  # prompts of unfinished samples kept per worker (oldest forgotten first)


def _build_reward_runner(reward_runner: Any, model_path: str):
    """A RewardRunner as is; a RewardConfig -> RewardRunner with the model's tokenizer; None -> no scoring."""
    if reward_runner is None or hasattr(reward_runner, "score_async"):
        return reward_runner
    from gspo_ray.rollout.scoring import RewardRunner

    return RewardRunner.from_config(reward_runner, model_path)


def default_cpu_cores(worker_id: int, cfg, cpu_count: int | None = None) -> str | None:
    """A lone worker keeps every core (None: no pinning); with several, worker i gets cores
    [i*k, (i+1)*k) mod cpu_count, k = num_cpus_per_worker (at least tensor_parallel_size: a core per TP worker),
    so workers sharing a machine do not share cores."""
    cpu_count = cpu_count or os.cpu_count() or 1
    if cfg.num_workers <= 1 or cpu_count < 2:
        return None
    k = max(1, min(int(max(cfg.num_cpus_per_worker, cfg.tensor_parallel_size)), cpu_count))
    first = (worker_id * k) % cpu_count
    return ",".join(str((first + j) % cpu_count) for j in range(k))


# `_broken` between a transfer push's finish_weight_update and publish_weights: complete, not checked yet
PUSHED_UNCHECKED = "weight push finished, its probe check not done"


class RolloutWorker:
    """A rollout actor (plain class; wrap with `ray.remote`). Owns one `RolloutEngine`."""

    def __init__(self, worker_id: int, model_path: str | Path, cfg=None, run_dir: str | Path = "runs/rollout",
                 reward_runner: Any = None, cpu_cores: str | None = None, sleep_mode: bool = False):
        """cfg: a `RolloutConfig` (defaults if None). cpu_cores: cores to pin the engine to ("0", "2-3"); default
        (see `default_cpu_cores`): none for a single worker, else its own block of `num_cpus_per_worker` cores.
        reward_runner: a RewardRunner, a RewardConfig (built here, so it can travel to an actor), or None (samples
        are not scored). sleep_mode: the engine shares its GPUs with trainer ranks and sleeps while they train
        (vLLM's sleep mode; CUDA only, see `sleep`)."""
        from gspo_ray.config import RolloutConfig

        self.worker_id = worker_id
        self.model_path = str(model_path)
        self.cfg = cfg if cfg is not None else RolloutConfig()
        self.sampling = SamplingSettings.from_config(self.cfg)
        cores = cpu_cores if cpu_cores is not None else default_cpu_cores(worker_id, self.cfg)
        if self.cfg.num_threads is not None and cores is None:  # Ray sets OMP_NUM_THREADS to the actor's num_cpus
            import torch

            torch.set_num_threads(self.cfg.num_threads)
        self.engine = RolloutEngine(model_path, run_dir=Path(run_dir) / f"rollout-{worker_id}", dtype=self.cfg.dtype,
                                    head_dtype=self.cfg.head_dtype,  # fp32 logits in a bf16 engine
                                    max_model_len=self.cfg.max_model_len, kv_cache_gb=self.cfg.kv_cache_gb,
                                    **scheduler_options(self.cfg),  # max_num_seqs, max_num_batched_tokens, ...
                                    # rollout.seed is None outside a job (gspo-ray eval): 0
                                    enforce_eager=self.cfg.enforce_eager, seed=(self.cfg.seed or 0) + worker_id,
                                    gpu_memory_utilization=self.cfg.gpu_memory_utilization, cpu_cores=cores,
                                    worker_id=worker_id, cache_root=self.cfg.cache_dir,  # machine-wide
                                    lora_rank=self.cfg.lora_rank, capture_routes=self.cfg.capture_routes,
                                    tensor_parallel_size=self.cfg.tensor_parallel_size,
                                    enable_expert_parallel=self.cfg.enable_expert_parallel,
                                    # resolved by the job (coordinator/pools.py); "auto" outside one: gspo_shm
                                    weight_transfer="shm" if self.cfg.weight_transfer == "auto"
                                    else self.cfg.weight_transfer, sleep_mode=sleep_mode)
        self._asleep: set[str] = set()  # vLLM memory tags `sleep` freed and no `wake_up` restored yet
        self.reward_runner = _build_reward_runner(reward_runner, str(model_path))
        self._version = 0
        self._lock = threading.Lock()  # one engine operation at a time
        self._paused = threading.Event()
        self._env_host, self._env_host_key = None, None  # multi-turn env processes, built on first use
        self._episode_runner = None  # rollout.multi_turn with rollout.partial: training's resident runner
        self._agent_runners: dict = {}  # rollout.agent's endpoint and processes per sampling, built on first use
        # prompts of aborted samples, to score them when continued here without `prompts`; bounded, because a
        # pool may continue a group on another worker and this entry is then never claimed
        self._unfinished: OrderedDict[str, Prompt] = OrderedDict()
        self._metrics: dict[str, float] = {}
        self._broken: str | None = None  # set by a failed weight push, cleared by the next complete one

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise WeightSyncError(f"rollout worker {self.worker_id} needs a complete weight push first: {self._broken}")

    # ---- sampling ------------------------------------------------------------------------------------------
    def generate(self, prompts: list[Prompt], n: int | None = None, version: int | None = None,
                 budget: int | None = None, seed: int | None = None,
                 temperature: float | None = None) -> list[Sample]:
        """n (default group_size) scored completions per prompt, grouped by prompt, tokens stamped `version`
        (default: the current one). budget: at most this many new tokens per sample in this call.
        temperature: overrides the configured one for this call (0 = greedy, for evaluation)."""
        n = n or self.cfg.group_size
        sampling = self.sampling if temperature is None else dataclasses.replace(self.sampling,
                                                                                   temperature=temperature)
        with self._lock:
            self._check_usable()
            self._wake(["weights", "kv_cache"])
            version = self._version if version is None else version
            scoring: list[Future] = []
            start = time.perf_counter()
            samples = self.engine.generate(
                prompts, n, sampling, version=version, budget=budget, seed=seed, stop_event=self._paused,
                on_group_done=lambda p, group: self._score_async(p, group, scoring))
            gen_s = time.perf_counter() - start
            open_uids = {s.prompt_uid for s in samples if s.finish_reason == FINISH_ABORTED}
            self._unfinished.update({p.uid: p for p in prompts if p.uid in open_uids})
            while len(self._unfinished) > MAX_REMEMBERED_PROMPTS:
                self._unfinished.popitem(last=False)
        self._metrics = self._rollout_metrics(samples, gen_s, self._wait_scores(scoring))
        return samples

    def continue_samples(self, samples: list[Sample], budget: int | None = None, version: int | None = None,
                         prompts: list[Prompt] | None = None) -> list[Sample]:
        """Resume "aborted" samples (others pass through); newly finished ones are scored. `prompts` is only
        needed for samples this worker did not start (their references are unknown here). With rollout.agent the
        samples are agent episodes' (`run_episodes` with a budget): continued from this worker's live episodes, or
        started again and answered from their records (gspo_ray/rollout/agent/runner.py)."""
        if self.cfg.agent is not None:
            return self._run_agent_episodes(list(prompts or []), self.cfg.group_size, version, None, None,
                                            budget=budget, carried=samples)
        if self.cfg.multi_turn is not None:
            return self.run_episodes(list(prompts or []), version=version, budget=budget, carried=samples)
        with self._lock:
            self._check_usable()
            self._wake(["weights", "kv_cache"])
            version = self._version if version is None else version
            start = time.perf_counter()
            out = self.engine.continue_samples(samples, self.sampling, version=version, budget=budget,
                                               stop_event=self._paused)
            gen_s = time.perf_counter() - start
            known = {**self._unfinished, **{p.uid: p for p in prompts or []}}
            still_open = {s.prompt_uid for s in out if s.finish_reason == FINISH_ABORTED}
            for uid in {s.prompt_uid for s in samples} - still_open:
                self._unfinished.pop(uid, None)
        newly_done = [s for s, before in zip(out, samples)
                      if before.finish_reason == FINISH_ABORTED and s.finish_reason != FINISH_ABORTED]
        scoring: list[Future] = []
        for uid in {s.prompt_uid for s in newly_done}:
            if uid in known:
                self._score_async(known[uid], [s for s in newly_done if s.prompt_uid == uid], scoring)
        self._metrics = self._rollout_metrics(out, gen_s, self._wait_scores(scoring))
        return out

    def run_episodes(self, prompts: list[Prompt], n: int | None = None, env_spec: Any = None,
                     version: int | None = None, seed: int | None = None,
                     temperature: float | None = None, budget: int | None = None,
                     carried: list[Sample] | None = None) -> list[Sample]:
        """n (default group_size) multi-turn episodes per prompt (gspo_ray.rollout.episodes), as Samples ready
        for the buffer: reward and token_rewards come from the environment (the reward runner is not used);
        an env failure marks only its episode failed (finish_reason "env_error"). env_spec: a MultiTurnConfig
        or its dict (default: cfg.multi_turn). A pause interrupts running episodes (finish_reason "interrupted",
        failed set). With rollout.partial, training's episodes (no env_spec, no temperature) run on a resident
        runner: budget = at most this many new model tokens per episode now; unfinished episodes come back
        "aborted", stay here (their envs alive) and are continued by `continue_samples` (`carried`), or rebuilt
        from their records where this worker does not hold them; a pause ends the round early instead."""
        from gspo_ray.config import MultiTurnConfig
        from gspo_ray.data.prompts import load_tokenizer
        from gspo_ray.rollout.episodes import EpisodeRunner

        if env_spec is None and self.cfg.agent is not None:
            return self._run_agent_episodes(prompts, n or self.cfg.group_size, version, seed, temperature,
                                            budget=budget)
        resident = self.cfg.partial is not None and env_spec is None and temperature is None
        if (budget is not None or carried) and not resident:
            raise ValueError("run_episodes: a token budget or carried episodes need rollout.partial (training's "
                             "env and sampling)")
        spec = env_spec if env_spec is not None else self.cfg.multi_turn
        if spec is None:
            raise ValueError("rollout.multi_turn is not set: run_episodes needs an environment")
        spec = MultiTurnConfig.model_validate(spec) if isinstance(spec, dict) else spec
        sampling = self.sampling if temperature is None else dataclasses.replace(self.sampling,
                                                                                   temperature=temperature)
        if getattr(self, "_env_tokenizer", None) is None:  # loaded once, on first use
            self._env_tokenizer = load_tokenizer(self.model_path)
        with self._lock:  # the resident runner is built under the lock: a round's fresh and carried calls arrive
            # together (max_concurrency 2) and must find the same runner, which holds the live episodes
            if resident:
                if self._episode_runner is None:  # its own env host: evaluation's env spec may replace the shared one
                    self._episode_runner = EpisodeRunner.from_config(self.engine, spec, self._env_tokenizer,
                                                                     resident=True)
                runner = self._episode_runner
            else:
                runner = EpisodeRunner.from_config(self.engine, spec, self._env_tokenizer, self._env_host_for(spec))
            self._check_usable()
            self._wake(["weights", "kv_cache"])
            version = self._version if version is None else version
            samples = runner.run(prompts, n or self.cfg.group_size, sampling, version=version, seed=seed,
                                 stop_event=self._paused, budget=budget, carried=carried)
            self._metrics = dict(runner.metrics)  # under the lock: the resident runner is shared by concurrent calls
        return samples

    def _run_agent_episodes(self, prompts: list[Prompt], n: int, version: int | None, seed: int | None,
                            temperature: float | None, budget: int | None = None,
                            carried: list[Sample] | None = None) -> list[Sample]:
        """rollout.agent's episodes (gspo_ray.rollout.agent): the agent's endpoint and processes are built on first
        use and kept; reward from the agent's return value. With rollout.partial, training's runner is resident:
        rounds of `budget` tokens, unfinished episodes kept here between them and `carried` ones continued; a
        pause ends a round early (its episodes come back "aborted", continued later). Otherwise a pause
        interrupts them (not continued)."""
        from gspo_ray.data.prompts import load_tokenizer
        from gspo_ray.rollout.agent.runner import AgentRunner

        sampling = self.sampling if temperature is None else dataclasses.replace(self.sampling,
                                                                                   temperature=temperature)
        key = (sampling.temperature, sampling.top_p)  # an endpoint accepts exactly the sampling it serves
        with self._lock:  # built under the lock: two calls arriving together (a round's fresh prompts and its
            # carried episodes, max_concurrency 2) must find the same runner, which holds the live episodes
            runner = self._agent_runners.get(key)
            if runner is None:  # training's and evaluation's (greedy) sampling: one each, kept
                # resident under partial rollouts, whichever sampling: an evaluation at the training temperature
                # shares training's runner (a resident runner without a budget runs each episode to its end)
                runner = self._agent_runners[key] = AgentRunner(self.engine, self.cfg.agent,
                                                                load_tokenizer(self.model_path), sampling,
                                                                resident=self.cfg.partial is not None)
            self._check_usable()
            self._wake(["weights", "kv_cache"])
            version = self._version if version is None else version
            samples = runner.run(prompts, n, version=version, seed=seed, stop_event=self._paused, budget=budget,
                                 carried=carried)
            self._metrics = dict(runner.metrics)  # under the lock: the runner is shared by concurrent calls
        return samples

    def _env_host_for(self, spec: Any) -> Any:
        """The env host (its processes) is kept across batches while the env spec stays the same."""
        from gspo_ray.envs.multiturn import check_env
        from gspo_ray.rollout.env_hosts import make_env_host

        key = (spec.env, repr(sorted(spec.kwargs.items())), spec.isolation, spec.num_procs)
        if self._env_host_key != key:
            if self._env_host is not None:
                self._env_host.close()
            self._env_host = make_env_host(check_env(spec.env), dict(spec.kwargs), self._env_tokenizer,
                                           spec.isolation, spec.num_procs)
            self._env_host_key = key
        return self._env_host

    def _score_async(self, prompt: Prompt, group: list[Sample], futures: list[Future]) -> None:
        done = [s for s in group if s.finish_reason != FINISH_ABORTED]
        if self.reward_runner is not None and done:
            futures.append(self.reward_runner.score_async(done, {prompt.uid: prompt}))

    @staticmethod
    def _wait_scores(futures: list[Future]) -> dict[str, float]:
        """Sum the per-group scoring metrics (seconds and counts add up; abandoned threads: the last count)."""
        total: dict[str, float] = {}
        for f in futures:
            for key, value in f.result().items():
                total[key] = value if key == "reward/abandoned_threads" else total.get(key, 0.0) + value
        return total

    def _rollout_metrics(self, samples: list[Sample], gen_s: float, reward: dict[str, float]) -> dict[str, float]:
        tokens = sum(s.num_tokens for s in samples)
        return {"rollout/gen_s": gen_s, "rollout/tokens": float(tokens),
                "rollout/tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
                "rollout/samples": float(len(samples)),
                "rollout/aborted": float(sum(s.finish_reason == FINISH_ABORTED for s in samples)),
                "rollout/truncated": float(sum(s.finish_reason == "length" for s in samples)), **reward}

    def last_metrics(self) -> dict[str, float]:
        """Metrics of the last generate/continue call (`rollout/*`, `reward/*`)."""
        return dict(self._metrics)

    # ---- weights -------------------------------------------------------------------------------------------
    def update_weights(self, version: int, buckets: Iterable[Any], probe: WeightProbe | None = None
                       ) -> dict[str, float]:
        """Push buckets of (HF name, tensor) (or Ray refs to them) into the live engine; become `version`.

        With a probe (and `verify_push`), the engine's teacher-forced log-probs must match the probe's within the
        tolerance (see `verify_tolerance`) before the version is published; a failed push or verify raises
        WeightSyncError and leaves the worker refusing to sample, at its old version, until a push passes.
        Returns `sync/*` metrics (push seconds and MiB, probe diffs, the probe's expert coverage).
        """
        with self._lock:
            self._broken = "weight push in progress"  # nothing samples from a half-checked engine
            try:
                self._wake(["weights"])
                metrics = push_buckets(self.engine, buckets).metrics() | self._check_probe(probe)
            except WeightSyncError as e:
                self._broken = str(e)  # layers may be half-loaded or wrong: refuse to sample until a good push
                raise
            except BaseException as e:
                self._broken = f"weight push interrupted: {type(e).__name__}: {e}"
                raise
            self._broken = None
            self._version = version
        return metrics

    def _check_probe(self, probe: WeightProbe | None) -> dict[str, float]:
        """The pushed engine against the trainer's probe (rollout.verify_push): `sync/*` metrics, or
        WeightSyncError."""
        if probe is None or not self.cfg.verify_push:
            return {}
        self._wake(["kv_cache"])  # the probe's forward needs it; the push is done by now
        start = time.perf_counter()
        statistic, tol = self.verify_tolerance()
        metrics = verify_probe(self.engine, probe, tol, statistic, count_experts=True)
        metrics["sync/verify_s"] = time.perf_counter() - start
        return metrics

    def weight_transfer_call(self, method: str, request: dict[str, Any] | None = None) -> None:
        """One phase of vLLM's weight-transfer protocol on this engine (`method`: init_weight_transfer_engine,
        start_weight_update, update_weights, finish_weight_update; the request dict as vLLM's `LLM` takes it),
        called by the trainer's sender through `ActorPoolClient` (rollout.weight_transfer nccl / ipc). One verb
        rather than four: `update_weights` is already this actor's push. From `start_weight_update` on the
        worker refuses to sample until `publish_weights` has checked the push."""
        if method not in WEIGHT_TRANSFER_CALLS:
            raise ValueError(f"{method!r} is not a weight-transfer phase ({', '.join(WEIGHT_TRANSFER_CALLS)})")
        with self._lock:
            if method == "start_weight_update":
                self._broken = "weight push in progress"
            if method != "init_weight_transfer_engine":
                self._wake(["weights"])  # vLLM loads into the engine's weights, which must be on the GPU
            try:
                fn = getattr(self.engine.llm, method)
                fn() if request is None else fn(request)
                if method == "finish_weight_update":
                    self.engine.reset_prefix_cache()  # cached KV of the old weights must not serve new requests
                    self._broken = PUSHED_UNCHECKED  # still refusing to sample: publish_weights checks it
            except BaseException as e:
                if method != "init_weight_transfer_engine":
                    self._broken = f"weight transfer {method} failed: {type(e).__name__}: {e}"
                raise

    def publish_weights(self, version: int, probe: WeightProbe | None = None) -> dict[str, float]:
        """After a push through vLLM's weight transfer (`weight_transfer_call`): the probe check (as
        `update_weights`), then become `version`. Raises WeightSyncError (the worker keeps refusing to sample) if
        the push did not finish or the check fails."""
        with self._lock:
            if self._broken not in (None, PUSHED_UNCHECKED):  # a failed phase, or a push never finished
                raise WeightSyncError(f"rollout worker {self.worker_id}: {self._broken}")
            try:
                metrics = self._check_probe(probe)
            except WeightSyncError as e:
                self._broken = str(e)
                raise
            self._broken = None
            self._version = version
        return metrics

    def verify_tolerance(self) -> tuple[str, float]:
        """(statistic, tol) of the push check: `verify_tol` if set, else the engine dtype's default (VERIFY_TOL)."""
        statistic, tol = VERIFY_TOL[self.cfg.dtype]
        return statistic, self.cfg.verify_tol if self.cfg.verify_tol is not None else tol

    def verify(self, probe_ids: list[int], reference_logprobs: list[float], tol: float | None = None) -> float:
        """max |engine - reference| teacher-forced log-prob of probe_ids[1:]; raises above `tol` if given."""
        with self._lock:
            self._check_usable()
            self._wake(["weights", "kv_cache"])
            probe = WeightProbe.single(probe_ids, reference_logprobs)
            return verify_probe(self.engine, probe, tol)["sync/verify_max_abs_diff"]

    def current_version(self) -> int:
        return self._version

    # ---- sleep (colocated engines) ------------------------------------------------------------------------
    def sleep(self) -> bool:
        """Free the engine's GPU memory for the trainer ranks on its GPUs, before they train: vLLM's
        `sleep(level=1, mode="wait")` (in-flight requests finish first, where vLLM's default mode would abort them;
        the weights go to CPU memory, the KV cache is dropped). Returns False, doing nothing, for an engine started
        without sleep mode: not colocated, or on CPU, where vLLM has no sleep mode."""
        if not self.engine.sleeps:
            return False
        with self._lock:
            if not self._asleep:
                self.engine.llm.sleep(level=1, mode="wait")
                self._asleep = {"weights", "kv_cache"}
        return True

    def wake_up(self, tags: list[str]) -> bool:
        """Restore what `sleep` freed, by vLLM's tags: "weights" before a push (it loads into them), "kv_cache"
        after it (so the trainer's push buffers are gone before the cache is allocated again). Returns False for an
        engine without sleep mode. Every engine call wakes what it needs itself, so a missed wake costs order,
        never correctness."""
        if not self.engine.sleeps:
            return False
        with self._lock:
            self._wake(tags)
        return True

    def _wake(self, tags: list[str]) -> None:
        """vLLM's wake_up for those of `tags` still asleep (under the engine lock)."""
        wanted = [t for t in tags if t in self._asleep]
        if wanted:
            self.engine.llm.wake_up(tags=wanted)
            self._asleep -= set(wanted)

    # ---- control -------------------------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop in-flight generation at the next engine step (partial samples return "aborted"); until
        `resume`, generate/continue return at once with nothing new. Never waits for the engine."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def ping(self) -> int:
        return self.worker_id

    def describe(self) -> dict[str, Any]:
        """Who and where this worker is (for status displays and tests)."""
        return {"worker_id": self.worker_id, "pid": os.getpid(), "version": self._version,
                "model_path": self.model_path, "cpu_affinity": sorted(os.sched_getaffinity(0)),
                "paused": self._paused.is_set(), "engine_mode": self.engine.mode,
                "tensor_parallel_size": self.engine.tensor_parallel_size}

    def shutdown(self) -> None:
        self._paused.set()
        with self._lock:
            if self.reward_runner is not None and hasattr(self.reward_runner, "close"):
                self.reward_runner.close()
            if self._env_host is not None:
                self._env_host.close()
            for runner in self._agent_runners.values():
                runner.close()
            if self._episode_runner is not None:
                self._episode_runner.close()
            self.engine.shutdown()
