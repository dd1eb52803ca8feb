"""The colocated layout as pure functions (coordinator/colocation.py) and the layouts refused before Ray."""
import pytest
from typer.testing import CliRunner

from gspo_ray.cli import app
from gspo_ray.coordinator.colocation import (EngineSlot, bundle_shapes, engine_slots, free_slot, node_groups,
                                             rank_bundles, shares_trainer_gpus, visible_devices)


def test_sixteen_ranks_on_two_nodes_with_tp2_engines():
    groups = node_groups(16, 2, [8, 8])
    assert groups == [8, 8]  # one placement group per node
    assert rank_bundles(groups)[9] == (1, 1)  # rank 9: node group 1, bundle 1
    slots = engine_slots(groups, 2)
    assert len(slots) == 8 and slots[4] == EngineSlot(1, (0, 1))  # engine 4 spans ranks 8, 9
    assert visible_devices([["6"], ["7"]], EngineSlot(0, (0, 1))) == "6,7"
    assert node_groups(4, 2, [3, 2]) == [2, 2]  # 3 GPUs hold one TP 2 engine; no engine spans two nodes
    with pytest.raises(ValueError, match="blocks of 2"):
        node_groups(4, 2, [3, 1])


def test_the_engine_actor_cpus_ride_in_its_first_bundle_and_slots_are_reused_only_when_dead():
    shapes = bundle_shapes(4, 2, 2.0, 1.0, {"trainer_node": 1.0}, {})
    assert [s["CPU"] for s in shapes] == [3.0, 2.0, 3.0, 2.0] and all(s["GPU"] == 1.0 for s in shapes)
    assert free_slot(2, {}, set()) == 0
    assert free_slot(2, {0: 0, 1: 1}, {0, 1}) is None
    assert free_slot(2, {0: 0, 1: 1}, {0}) == 1  # worker 1 died: its GPUs take the replacement
    assert shares_trainer_gpus({("n", "0")}, {("n", "0"), ("n", "1")})
    assert not shares_trainer_gpus({("m", "0")}, {("n", "0")})  # same GPU id on another node


GPU = ["rollout.num_gpus_per_worker=0.5", "trainer.num_gpus_per_worker=0.5"]


@pytest.mark.parametrize("overrides, named", [
    (GPU + ["coordinator.mode=async"], "coordinator.mode async"),
    (GPU + ["trainer.num_workers=2", "rollout.tensor_parallel_size=2", "rollout.num_workers=2"],
     "rollout.num_workers 2 x rollout.tensor_parallel_size 2"),
    (["rollout.num_gpus_per_worker=1", "trainer.num_gpus_per_worker=1", "rollout.weight_transfer=ipc"],
     "rollout.weight_transfer 'ipc'"),
    (["rollout.num_gpus_per_worker=0.5", "rollout.tensor_parallel_size=2", "trainer.num_gpus_per_worker=1"],
     "fractions of 2 GPUs"),
])
def test_layouts_that_cannot_be_placed_end_in_one_line_and_exit_2(tmp_path, overrides, named):
    job = tmp_path / "job.yaml"
    job.write_text("name: colocated\n")
    result = CliRunner().invoke(app, ["config", "validate", str(job), *overrides])
    assert result.exit_code == 2, result.output
    assert named in result.output and "Traceback" not in result.output
