"""Weight push into a live engine (RolloutWorker, no Ray): after pushing perturbed weights bucket by bucket, the
engine's log-probs equal the perturbed transformers model's (fp32, <= 1e-4) for dense (qwen2) and MoE
(qwen3_moe); pushing identical weights changes nothing; tokens carry the pushed version; the probe check
catches a mismatch. One worker per architecture (module-scoped, indirectly parametrised).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from gspo_ray.config import RolloutConfig
from gspo_ray.data.records import Prompt
from gspo_ray.models.tiny import make_tiny_model
from gspo_ray.data.shared_weights import SharedWeightWriter, current_node_id, read_shared
from gspo_ray.rollout.weight_sync import (MiB, PushStats, WeightProbe, WeightSyncError, build_probe_sequences,
                                          checkpoint_tensor_names, expert_names, flatten_buckets,
                                          hf_teacher_forced_logprobs, iter_buckets, push_route,
                                          read_checkpoint_weights)
from gspo_ray.rollout.worker import RolloutWorker

TOL = 1e-4
PROBE = [2] + [3 + (t * 7) % 19 for t in range(40)]
BOTH = pytest.mark.parametrize("setup", ["qwen3_moe", "qwen2"], indirect=True)


def _perturbed_copy(src, dst, std: float = 0.02, seed: int = 0):
    """An HF checkpoint with Gaussian noise on every tensor (noise ~ the init scale: log-probs move ~0.1)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    weights = {n: t + std * torch.randn(t.shape, generator=gen) for n, t in read_checkpoint_weights(src)}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def setup(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    arch, _, dtype = request.param.partition("-")  # "qwen3_moe-bfloat16": a bf16 engine
    root = tmp_path_factory.mktemp(request.param)
    base = make_tiny_model(arch, root / "base", seed=2, hidden=128)
    moved = _perturbed_copy(base, root / "moved")
    cfg = RolloutConfig(max_model_len=128, max_new_tokens=12, group_size=3, dtype=dtype or "float32")
    worker = RolloutWorker(0, base, cfg, run_dir=root / "run", cpu_cores="0")
    hf = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
          for name, path in (("base", base), ("moved", moved))}
    yield worker, hf, {"base": base, "moved": moved}
    worker.shutdown()


def _probe(hf_model) -> WeightProbe:
    return WeightProbe.single(PROBE, hf_teacher_forced_logprobs(hf_model, [PROBE])[0])


def _covering_probe(hf_model, model_dir) -> WeightProbe:
    """What the job builds: sequences sized from the model's experts (fp32 reference, as an fp32 trainer's)."""
    seqs = build_probe_sequences(22, 127, json.loads((model_dir / "config.json").read_text()), seed=0)
    return WeightProbe(seqs, hf_teacher_forced_logprobs(hf_model, seqs))


def _corrupt_expert(worker, model_dir, probe, scale: float = 0.0):
    """The checkpoint with the probe's busiest expert of the last MoE layer scaled (0: zeroed)."""
    _, counts = worker.engine.probe_logprobs(probe.sequences, count_experts=True)
    layer, count = list(counts.items())[-1]
    name = f"{layer}.experts.{int(count.argmax())}.down_proj.weight"
    return [(n, t * scale if n == name else t) for n, t in read_checkpoint_weights(model_dir)]


def _max_diff_to_hf(samples, hf_model) -> float:
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    refs = hf_teacher_forced_logprobs(hf_model, seqs)
    return max(abs(a - b) for s, ref in zip(samples, refs) for a, b in zip(s.logprobs, ref[len(s.prompt_ids) - 1:]))


def _push(worker, path, version, bucket_mb=0.05, probe=None):
    # ~0.05 MiB buckets: the ~2 MiB tiny models arrive in dozens of buckets, layers split across buckets.
    return worker.update_weights(version, iter_buckets(read_checkpoint_weights(path), bucket_mb), probe)


@BOTH
def test_identical_push_changes_nothing(setup):
    worker, hf, paths = setup
    _push(worker, paths["base"], 0)
    before = worker.engine.prompt_logprobs(PROBE)
    metrics = _push(worker, paths["base"], 0)
    after = worker.engine.prompt_logprobs(PROBE)
    assert max(abs(a - b) for a, b in zip(before, after)) <= 1e-6
    assert worker.verify(PROBE, _probe(hf["base"]).logprobs[0]) <= TOL
    assert metrics["sync/num_buckets"] > 10 and metrics["sync/push_mb"] > 0.5 and metrics["sync/push_s"] > 0


@BOTH
def test_perturbed_push_matches_perturbed_model(setup):
    worker, hf, paths = setup
    _push(worker, paths["base"], 0)
    prompts = [Prompt(uid=f"p{i}", prompt_ids=[2, 3 + i, 4 + 2 * i]) for i in range(4)]
    old = worker.generate(prompts, seed=3)
    metrics = _push(worker, paths["moved"], 1, probe=_probe(hf["moved"]))
    assert metrics["sync/verify_max_abs_diff"] <= TOL
    new = worker.generate(prompts, seed=3)
    assert _max_diff_to_hf(new, hf["moved"]) <= TOL
    # The push really moved the policy: the old samples' log-probs are far from the new model's.
    assert _max_diff_to_hf(old, hf["moved"]) > 1e-2
    assert {v for s in old for v in s.versions} == {0} and {v for s in new for v in s.versions} == {1}
    assert worker.current_version() == 1


def _engine_params(worker) -> dict[str, torch.Tensor]:
    model = worker.engine.llm.collective_rpc(lambda w: w.get_model())[0]
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@BOTH
def test_shared_memory_push_is_bit_identical(setup):
    worker, hf, paths = setup
    _push(worker, paths["moved"], 5)  # the object-store path's result
    reference = _engine_params(worker)
    _push(worker, paths["base"], 6)
    base_reference = _engine_params(worker)
    writer = SharedWeightWriter()
    try:
        shared = writer.write(read_checkpoint_weights(paths["moved"]))
        metrics = worker.update_weights(7, shared, _probe(hf["moved"]))
        assert metrics["sync/verify_max_abs_diff"] <= TOL and metrics["sync/num_buckets"] == 1
        got = _engine_params(worker)
        assert got.keys() == reference.keys() and all(torch.equal(got[n], reference[n]) for n in reference)
        # the engine copied the weights out of the file: a later export into it leaves the engine as it was
        base = writer.write(read_checkpoint_weights(paths["base"]))
        assert all(torch.equal(t, reference[n]) for n, t in _engine_params(worker).items())
        with pytest.raises(WeightSyncError, match="generation"):  # the old record now names overwritten bytes
            worker.update_weights(8, shared)
        # the next export read through the mapping the engine kept from the first: the new bytes, bit for bit,
        # and a good push repairs the refused one
        worker.update_weights(9, base)
        got = _engine_params(worker)
        assert all(torch.equal(got[n], base_reference[n]) for n in base_reference)
    finally:
        writer.close()


def test_push_route_by_node():
    assert push_route("n1", "n1", has_fallback=False) == "shared"
    assert push_route("n1", "n2", has_fallback=True) == "object_store"
    with pytest.raises(WeightSyncError, match="one node only"):
        push_route("n1", "n2", has_fallback=False)
    # an export from another node reads its fallback buckets, never the (unreachable) file
    writer = SharedWeightWriter()
    try:
        shared = writer.write([("a", torch.ones(3))])
        assert torch.equal(dict(read_shared(shared))["a"], torch.ones(3))
        shared.node_id = current_node_id() + "-elsewhere"
        shared.fallback = [[("a", torch.full((3,), 2.0))]]
        stats = PushStats()
        assert [(n, t.tolist()) for n, t in flatten_buckets(shared, stats)] == [("a", [2.0, 2.0, 2.0])]
    finally:
        writer.close()
    shared.node_id = current_node_id()  # the writer is gone (closed, or its process died): a clear refusal
    with pytest.raises(WeightSyncError, match="cannot map"):
        list(flatten_buckets(shared, PushStats()))


@BOTH
def test_probe_catches_a_wrong_push(setup):
    worker, hf, paths = setup
    _push(worker, paths["moved"], 2)
    stale = _probe(hf["base"])  # the trainer thinks it pushed `base`
    assert worker.verify(stale.sequences[0], stale.logprobs[0]) > 1e-2
    with pytest.raises(WeightSyncError, match="verify_tol"):
        _push(worker, paths["moved"], 3, probe=stale)
    _push(worker, paths["base"], 4, probe=_probe(hf["base"]))  # and back: passes


def test_buckets_respect_size_and_order():
    tensors = [(f"t{i}", torch.zeros(1000 * (i % 3 + 1))) for i in range(12)]  # 4, 8, 12 kB
    buckets = list(iter_buckets(tensors, bucket_mb=20_000 / MiB))
    assert [name for b in buckets for name, _ in b] == [name for name, _ in tensors]
    assert all(sum(t.numel() * 4 for _, t in b) <= 20_000 for b in buckets)
    assert len(buckets) == 6  # 4+8 | 12 | 4+8 | ... : every pair fits, a third does not
    big = list(iter_buckets([("huge", torch.zeros(10_000))], bucket_mb=1 / MiB))
    assert len(big) == 1  # a tensor larger than the limit travels alone
    stats = PushStats()
    assert len(list(flatten_buckets(buckets, stats))) == 12
    assert (stats.num_buckets, stats.num_tensors, stats.nbytes) == (6, 12, 4 * 12_000 * 2)


def test_probe_needs_one_logprob_per_next_token():
    with pytest.raises(ValueError, match="probe"):
        WeightProbe.single([1, 2, 3], [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="probe"):
        WeightProbe([[1, 2], [3, 4, 5]], [[0.0]])


def test_fused_expert_checkpoints_name_each_expert(tmp_path):
    """A checkpoint that stores experts fused ([E, ...] tensors) names the same tensors as the trainer's
    per-expert export, so the completeness check of a push passes instead of failing on every push."""
    from safetensors.torch import save_file

    save_file({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(3, 8, 4),
               "model.layers.0.mlp.experts.down_proj": torch.zeros(3, 4, 4),
               "model.layers.0.mlp.experts.down_proj_bias": torch.zeros(3, 4),
               "model.layers.0.mlp.gate.weight": torch.zeros(3, 4)}, str(tmp_path / "model.safetensors"))
    pushed = {f"model.layers.0.mlp.experts.{e}.{p}" for e in range(3)
              for p in ("gate_proj.weight", "up_proj.weight", "down_proj.weight", "down_proj.bias")}
    assert checkpoint_tensor_names(tmp_path) == pushed | {"model.layers.0.mlp.gate.weight"}
    assert expert_names("model.layers.0.mlp.experts.2.up_proj.weight", (4, 4)) == [
        "model.layers.0.mlp.experts.2.up_proj.weight"]  # per-expert names pass through
    assert expert_names("model.layers.0.mlp.shared_experts.gate_proj.weight", (4, 4)) == [
        "model.layers.0.mlp.shared_experts.gate_proj.weight"]


def test_a_push_need_not_hold_the_multi_token_prediction_layers(tmp_path):
    """GLM-4.5 / DeepSeek-V3 checkpoints carry MTP layers after the decoder (num_nextn_predict_layers), which vLLM's
    sampler skips on load and the trainer never pushes: they are not part of a complete push. A layer past the
    decoder that config.json does not announce stays (vLLM would try to load it too)."""
    import json

    from safetensors.torch import save_file

    names = ("model.layers.0.mlp.gate.weight", "model.layers.2.eh_proj.weight", "model.layers.3.eh_proj.weight")
    save_file({n: torch.zeros(2, 2) for n in names}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_nextn_predict_layers": 1}))
    assert checkpoint_tensor_names(tmp_path) == {"model.layers.0.mlp.gate.weight", "model.layers.3.eh_proj.weight"}


@pytest.mark.parametrize("setup", ["qwen3_moe"], indirect=True)
def test_probe_reaches_every_expert_and_counts_like_the_model(setup):
    worker, hf, paths = setup
    probe = _covering_probe(hf["base"], paths["base"])
    metrics = _push(worker, paths["base"], 30, probe=probe)
    assert metrics["sync/probe_expert_coverage"] == 1.0 and metrics["sync/probe_min_expert_tokens"] >= 1
    # the counter reads the engine's own routers: the same counts as transformers' routers on the same tokens
    _, counts = worker.engine.probe_logprobs(probe.sequences, count_experts=True)
    expected = [torch.zeros(4, dtype=torch.long) for _ in counts]
    with torch.no_grad():
        for ids in probe.sequences:
            router_logits = hf["base"](input_ids=torch.tensor([ids]), output_router_logits=True).router_logits
            for acc, logits in zip(expected, router_logits):
                acc += torch.bincount(logits.topk(2, dim=-1).indices.flatten(), minlength=4)
    assert [c.tolist() for c in counts.values()] == [c.tolist() for c in expected]


@BOTH
def test_transfer_phases_through_the_worker_verbs(setup):
    """The rollout actor's protocol verbs (`weight_transfer_call`, `publish_weights`: what the trainer's sender drives
    for nccl / ipc) over the engine's own gspo_shm backend: a push passes the probe check; a stale push (the old
    weights) fails it and the worker refuses to sample at its old version."""
    from gspo_ray.rollout.shm_transfer import update_info

    worker, hf, paths = setup
    _push(worker, paths["base"], 20)
    writer = SharedWeightWriter()
    try:
        for path, version in ((paths["moved"], 21), (paths["base"], 22)):
            shared = writer.write(read_checkpoint_weights(path))
            worker.weight_transfer_call("start_weight_update")
            with pytest.raises(WeightSyncError, match="in progress"):  # nothing samples from a half-pushed engine
                worker.generate([Prompt(uid="x", prompt_ids=[2, 3])], n=1)
            worker.weight_transfer_call("update_weights", {"update_info": update_info(shared)})
            with pytest.raises(WeightSyncError, match="in progress"):  # not finished: never published
                worker.publish_weights(version)
            worker.weight_transfer_call("finish_weight_update")
            if version == 21:
                metrics = worker.publish_weights(version, _probe(hf["moved"]))
                assert metrics["sync/verify_max_abs_diff"] <= TOL and worker.current_version() == 21
        with pytest.raises(WeightSyncError, match="verify_tol"):  # 22 carried the old weights
            worker.publish_weights(22, _probe(hf["moved"]))
        assert worker.current_version() == 21
        with pytest.raises(WeightSyncError):
            worker.generate([Prompt(uid="x", prompt_ids=[2, 3])], n=1)
        with pytest.raises(ValueError, match="not a weight-transfer phase"):
            worker.weight_transfer_call("reload_weights")
    finally:
        writer.close()
    _push(worker, paths["base"], 23)  # a complete push repairs it


@pytest.mark.parametrize("setup", ["qwen3_moe"], indirect=True)
def test_failed_verify_leaves_the_worker_unusable_at_its_old_version(setup):
    worker, hf, paths = setup
    probe = _covering_probe(hf["base"], paths["base"])
    _push(worker, paths["base"], 40, probe=probe)
    with pytest.raises(WeightSyncError, match="verify_tol"):
        worker.update_weights(41, [_corrupt_expert(worker, paths["base"], probe)], probe)
    assert worker.current_version() == 40  # never published
    with pytest.raises(WeightSyncError, match="complete weight push"):
        worker.generate([Prompt(uid="x", prompt_ids=[2, 3])], n=1)
    _push(worker, paths["base"], 42, probe=probe)  # a push that passes repairs it
    assert worker.generate([Prompt(uid="x", prompt_ids=[2, 3])], n=1)[0].versions[0] == 42


@pytest.mark.parametrize("setup", ["qwen3_moe-bfloat16"], indirect=True)
def test_bf16_default_tolerance_passes_good_pushes_and_catches_a_corrupt_expert(setup):
    worker, hf, paths = setup
    assert worker.verify_tolerance() == ("mean", 0.2)
    probe = _covering_probe(hf["base"], paths["base"])  # fp32 reference: an fp32 trainer's log-probs
    metrics = _push(worker, paths["base"], 1, probe=probe)  # bf16 rounding alone passes (measured mean ~1e-3)
    assert metrics["sync/verify_mean_abs_diff"] <= 0.2 and metrics["sync/verify_max_abs_diff"] > 1e-4
    with pytest.raises(WeightSyncError, match="mean over the probe"):  # what bf16 can catch: gross errors
        worker.update_weights(2, [_corrupt_expert(worker, paths["base"], probe, scale=50.0)], probe)
    assert worker.current_version() == 1


@pytest.mark.parametrize("setup", ["qwen3_moe"], indirect=True)
def test_bad_push_is_loud_and_a_complete_push_repairs(setup):
    worker, hf, paths = setup
    weights = list(read_checkpoint_weights(paths["base"]))
    version = worker.current_version()
    # A layer that receives only some of its tensors would be re-processed with the rest undefined.
    with pytest.raises(WeightSyncError, match="incomplete weight push"):
        worker.update_weights(9, [weights[:-3]])
    with pytest.raises(WeightSyncError, match="complete weight push"):
        worker.generate([Prompt(uid="x", prompt_ids=[2, 3])])
    with pytest.raises(WeightSyncError, match="reload failed"):
        worker.update_weights(9, [weights[:4] + [("model.layers.0.no_such.weight", torch.zeros(2))]])
    assert worker.current_version() == version  # a failed push never bumps it
    _push(worker, paths["base"], 10, probe=_probe(hf["base"]))
    assert worker.generate([Prompt(uid="x", prompt_ids=[2, 3])], n=1)[0].versions[0] == 10
