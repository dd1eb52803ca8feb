"""R16: an adapter push counts as swapped in memory only when every vLLM worker (each TP rank) swapped it; one
worker without the slot sends the push down the file path (`add_lora`, run by every worker). vLLM's engine is
replaced by a recorder of the two calls the push makes (a TP 2 LoRA engine is not needed to see the decision)."""
import torch

from gspo_ray.rollout.lora_adapter import AdapterServing, all_swapped


class _Engine:
    def __init__(self):
        self.added = []

    def add_lora(self, request):
        self.added.append(request.lora_path)
        return True


class _LLM:
    def __init__(self, swap_results):
        self.llm_engine = _Engine()
        self.swap_results = swap_results

    def collective_rpc(self, fn, kwargs):
        return list(self.swap_results)


def _tensors(rank=8):
    return [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(rank, 16)),
            ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(16, rank))]


def test_all_swapped():
    assert all_swapped([True, True]) and not all_swapped([True, False]) and not all_swapped([])


def test_a_worker_that_did_not_swap_sends_the_push_through_the_file(tmp_path):
    serving = AdapterServing(tmp_path, rank=8)
    llm = _LLM([True, False])
    serving.load(llm, _tensors())  # the first push: always the file
    serving.load(llm, _tensors())  # rank 1 kept the old adapter: the file path again, on every worker
    assert len(llm.llm_engine.added) == 2 and llm.llm_engine.added[-1].endswith("push-2")
    assert (tmp_path / "adapter" / "push-2" / "adapter_model.safetensors").exists()
    llm.swap_results = [True, True]
    stats = serving.load(llm, _tensors())  # every worker swapped: no file
    assert stats["sync/adapter_write_s"] == 0.0 and len(llm.llm_engine.added) == 2
