"""Checkpoints written under Transformer Engine's layers, resharded on load (trainer/checkpoints/shards.py), on
hand-made rank payloads (no process group).

Transformer Engine cannot be built here (no CUDA), so the payloads are what its spec's state dict holds, by name
(trainer/weights/param_names.py: `linear_qkv.layer_norm_weight`, grouped experts `mlp.experts.linear_fc1.weight{j}`) and
TE's module extra state: a uint8 `_extra_state` tensor per TE module (TE's convention; here filled with bytes naming
the rank, as a pickled FP8 scaling state would be, so keeping and dropping are told apart); the local layers' extra
state is None (Megatron's ColumnParallelLinear / RowParallelLinear). Every rank payload's tensors are cut from the
tiny models' HF tensors by the bridge's own rules (merge_hf, shard_tp, global expert = ep_rank * local + j), the
optimizer moments are -w and 2w. Loading in another TP / EP size, and under the other spec, must give each rank
exactly the tensors built directly in its own layout and spec, and the moments with them.
"""
from __future__ import annotations

import functools
import re

import pytest
import torch

from gspo_ray.trainer.checkpoints import checkpoint as ckpt
from gspo_ray.trainer.weights.bridge import HFCheckpoint, merge_hf, param_map, shard_tp
from gspo_ray.trainer.model_spec import read_hf_config, spec_from_hf_config
from gspo_ray.trainer.weights.param_names import LayerKinds, hf_names_by_param, megatron_param_names
from gspo_ray.trainer.checkpoints.shards import Owners, SavedShards, is_expert

EXTRA_STATE = "._extra_state"
KINDS = {"local": LayerKinds(), "te": LayerKinds(te=True), "te_grouped": LayerKinds(te=True, grouped_gemm=True)}
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _global_expert_name(name: str, expert: int) -> str:
    """The TP 1 / EP 1 name of expert `expert` (SequentialMLP's `local_experts.{j}.`, TEGroupedMLP's `weight{j}`)."""
    if ".local_experts." in name:
        return re.sub(r"\.local_experts\.\d+\.", f".local_experts.{expert}.", name)
    return re.sub(r"\.weight\d+$", f".weight{expert}", name)


def _layouts(tp: int, ep: int) -> list[dict]:
    # world tp * ep (DP = EP): rank r is TP rank r % tp of DP rank r // tp, which is its EP rank
    return [dict(rank=r, tp_rank=r % tp, ep_rank=r // tp, etp_rank=0, pp_rank=0) for r in range(tp * ep)]


@functools.lru_cache(maxsize=8)
def _full_tensors(hf_dir, kinds: LayerKinds) -> dict[str, torch.Tensor]:
    """{Megatron name at TP 1 / EP 1 under `kinds`: the full tensor}, from the HF checkpoint."""
    spec, hf = spec_from_hf_config(read_hf_config(hf_dir), str(hf_dir)), HFCheckpoint(hf_dir)
    return {name: merge_hf([hf.get(n) for n in names], param_map(name, spec.arch).merge, spec)
            for (_, name), names in hf_names_by_param(spec, kinds).items()}


def _extra_states(names: list[str], kinds: LayerKinds, fill: str | None) -> dict:
    """The linears' `_extra_state` entries: TE's uint8 tensors (holding `fill`, or empty), the local layers' None."""
    modules = dict.fromkeys(n.rpartition(".")[0] for n in names if n.rpartition(".")[0].endswith(LINEARS))
    if not kinds.te:
        return {m + EXTRA_STATE: None for m in modules}
    data = (fill or "").encode()
    return {m + EXTRA_STATE: torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
            torch.zeros(0, dtype=torch.uint8) for m in modules}


def _rank_state(hf_dir, kinds: LayerKinds, tp: int, ep: int, lay: dict, fp8: bool) -> dict:
    """One rank's model state dict in layout (tp, ep) under `kinds`: built directly, never through SavedShards."""
    spec = spec_from_hf_config(read_hf_config(hf_dir), str(hf_dir), tp=tp, ep=ep)
    full, names = _full_tensors(str(hf_dir), kinds), megatron_param_names(spec, kinds)
    state = {}
    for name in names:
        pm = param_map(name, spec.arch)
        if pm.local_expert is not None:
            state[name] = full[_global_expert_name(name, lay["ep_rank"] * spec.num_local_experts + pm.local_expert)]
        else:
            state[name] = shard_tp(full[name], pm, spec, tp, lay["tp_rank"]).clone()
    return state | _extra_states(names, kinds, f"fp8 of rank {lay['rank']}" if fp8 else None)


def _saved(hf_dir, kinds: LayerKinds, tp: int, ep: int) -> tuple[list[dict], dict]:
    """The rank payloads and meta.json of a checkpoint written in layout (tp, ep) under `kinds` (plain Adam:
    each tensor's owner writes its moments whole)."""
    layouts, payloads = _layouts(tp, ep), []
    for lay in layouts:
        owners = Owners(layouts, lay["rank"])
        model = {k: v for k, v in _rank_state(hf_dir, kinds, tp, ep, lay, fp8=True).items() if owners.owns(k)}
        params = {k: {"start": 0, "shape": list(v.shape), "step": torch.tensor(3.0),
                      "exp_avg": -v.reshape(-1), "exp_avg_sq": 2 * v.reshape(-1)}
                  for k, v in model.items() if isinstance(v, torch.Tensor) and not k.endswith(EXTRA_STATE)}
        payloads.append({"model": model, "optimizer": {"params": params, "scalers": [None]}})
    meta = {"format": 2, "tp": tp, "ep": ep, "layouts": layouts,
            "layers": {"te": kinds.te, "grouped_gemm": kinds.grouped_gemm}}
    return payloads, meta


CASES = [  # model, saved (kinds, tp, ep) -> loaded (kinds, tp, ep)
    ("qwen3_moe", ("te_grouped", 2, 1), ("te_grouped", 1, 1)),  # TP 2 -> 1: TE's _extra_state tensors
    ("qwen3_moe", ("te_grouped", 1, 2), ("te_grouped", 1, 1)),  # EP 2 -> 1: grouped experts' weight{j}
    ("qwen3_moe", ("te_grouped", 1, 2), ("te_grouped", 2, 4)),  # EP 2 -> 4 and TP 1 -> 2 at once
    ("qwen3_moe", ("local", 2, 2), ("te_grouped", 1, 1)),       # local -> TE, grouped experts
    ("qwen3_moe", ("te_grouped", 1, 2), ("local", 2, 1)),       # TE grouped -> local
    ("qwen3_moe", ("te", 1, 1), ("te_grouped", 1, 1)),          # SequentialMLP under TE -> grouped GEMM
    ("qwen2", ("te", 2, 1), ("local", 1, 1)),                   # dense: fc1's fused norm -> pre_mlp_layernorm
    ("qwen2", ("local", 1, 1), ("te", 2, 1)),                   # and back, qkv bias, vocabulary padded over TP 2
]


IDS = [f"{m}-{s[0]}-tp{s[1]}ep{s[2]}-to-{d[0]}-tp{d[1]}ep{d[2]}" for m, s, d in CASES]


@pytest.mark.parametrize("model,saved,loaded", CASES, ids=IDS)
def test_te_checkpoints_reshard_and_cross_specs(request, model, saved, loaded):
    hf_dir = request.getfixturevalue({"qwen3_moe": "tiny_moe_dir", "qwen2": "tiny_qwen2_dir"}[model])
    (saved_kinds, saved_tp, saved_ep), (kinds, tp, ep) = (KINDS[saved[0]], *saved[1:]), (KINDS[loaded[0]], *loaded[1:])
    payloads, meta = _saved(hf_dir, saved_kinds, saved_tp, saved_ep)
    spec = spec_from_hf_config(read_hf_config(hf_dir), str(hf_dir), tp=tp, ep=ep)
    ckpt.check_layers(meta, {"te": kinds.te, "grouped_gemm": kinds.grouped_gemm}, "ckpt")  # not refused
    shards = SavedShards("ckpt", meta, spec, lambda d, r: payloads[r])
    for lay in _layouts(tp, ep):
        want = _rank_state(hf_dir, kinds, tp, ep, lay, fp8=False)  # its own extra states: empty (no FP8) / None
        got = shards.model_state(lay, want)
        assert got.keys() == want.keys()
        for name, w in want.items():
            if name.endswith(EXTRA_STATE):
                # the same shard of the module (TP, or EP for experts) and the same TE module (TE both ways, saved)
                same_shard = saved_ep == ep if is_expert(name) else saved_tp == tp
                owner = same_shard and (shards.owners.expert_owner(lay["ep_rank"]) if is_expert(name)
                                        else shards.owners.dense_owner(lay["tp_rank"]))
                if same_shard and saved_kinds.te and kinds.te and name in payloads[owner]["model"]:
                    # kept as saved: the rank holding this shard of the module wrote it
                    assert bytes(got[name].tolist()) == f"fp8 of rank {owner}".encode(), name
                else:  # another shard or other layers: this trainer's own
                    assert got[name] is w, name
                continue
            assert torch.equal(got[name], w), name
            assert torch.equal(shards.tensor("exp_avg", name, lay, None), -w), name
            assert torch.equal(shards.tensor("exp_avg_sq", name, lay, None), 2 * w), name


def test_only_the_older_layout_is_refused_under_other_layers():
    te, local = {"te": True, "grouped_gemm": True}, {"te": False, "grouped_gemm": False}
    ckpt.check_layers({"format": 2, "layers": te}, local, "ckpt")  # mapped by name (test above)
    with pytest.raises(ValueError, match="older layout and was written by Transformer Engine layers, grouped GEMM"):
        ckpt.check_layers({"layers": te}, local, "ckpt")
