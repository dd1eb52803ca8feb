"""The learning bench's report from run results, and the train profile's op classes: what `gspo-ray bench --suite
learn` / `--suite profile` end with (the runs themselves are benchmarks, minutes to hours)."""
import json

from gspo_ray.bench.common import TINY_RECIPE
from gspo_ray.bench.learning import learning_report, over_seeds_table, peer_runs, per_seed_table, plot_curves
from gspo_ray.bench.peer_trl import as_learn_run
from gspo_ray.bench.train_profile import op_class


def _run(seed, curve):
    solved = next(((s, t) for s, t, e, _ in curve if e >= 0.95), (None, None))
    return {"seed": seed, "curve": curve, "solved_at": solved[0], "solved_job_s": solved[1], "train_s": 10.0,
            "wall_s": 60.0, "steps": curve[-1][0]}


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_an_early_stopped_seed_keeps_its_last_value_and_times_come_from_seeds_evaluated_there(tmp_path):
    # seed 0 solves at step 5 and stops; seed 1 goes on to step 10
    runs = [_run(0, [(0, 5.0, 0.0, 0.1), (5, 40.0, 1.0, 1.0)]),
            _run(1, [(0, 6.0, 0.0, 0.2), (5, 44.0, 0.5, 0.6), (10, 80.0, 0.75, 0.8)])]
    lines = over_seeds_table(runs).splitlines()
    assert _cells(lines[2])[:3] == ["0", "0.000", "0.00-0.00"]
    assert _cells(lines[3]) == ["5", "0.750", "0.50-1.00", "0.800", "42.000"]
    # at step 10 seed 0 counts with its final 1.0 (it stopped because it had solved the task); the time is seed 1's
    assert _cells(lines[4]) == ["10", "0.875", "0.75-1.00", "0.900", "80.000"]
    per_seed = per_seed_table(runs).splitlines()
    assert _cells(per_seed[2])[:6] == ["0", "0.000", "1.000", "-", "5", "40.000"]
    assert _cells(per_seed[3])[4:6] == ["-", "-"]  # never solved
    assert plot_curves(runs, tmp_path / "c.png", "t").stat().st_size > 10_000


def test_the_peers_runs_join_the_learning_report(tmp_path):
    # what peer_trl.py writes for a 10-step TRL run evaluated every 5 steps, read back by the learn bench
    rows = [{"step": i, "step_s": 80.0} for i in range(1, 11)]
    evals = [{"step": s, "job_s": 30.0 + 85 * s, "eval_exact": e, "eval_reward": e} for s, e in
             ((0, 0.14), (5, 0.30), (10, 0.97))]
    (tmp_path / "trl_sum_s0.json").write_text(json.dumps(as_learn_run(rows, evals, 0)))
    (tmp_path / "trl_other_s0.json").write_text("{}")  # another recipe's: not read
    peers = peer_runs(tmp_path, "sum")
    assert len(peers) == 1 and peers[0]["peer"].startswith("TRL")
    assert (peers[0]["solved_at"], peers[0]["train_s"], peers[0]["steps"]) == (10, 800.0, 10)
    assert _cells(per_seed_table(peers).splitlines()[2])[:4] == ["0", "0.140", "0.300", "0.970"]
    ours = [_run(0, [(0, 5.0, 0.14, 0.14), (5, 40.0, 0.6, 0.6)])]
    assert plot_curves(ours, tmp_path / "c.png", "t", peers).stat().st_size > 10_000


def test_the_report_is_rebuilt_from_saved_runs_with_the_peers_seeds(tmp_path):
    from gspo_ray.config import load_config

    name = load_config(TINY_RECIPE).name
    (tmp_path / f"learn_{name}.json").write_text(json.dumps([_run(0, [(0, 5.0, 0.1, 0.1), (5, 40.0, 0.6, 0.6)])]))
    for seed, exact in ((0, 0.3), (1, 0.5)):  # two peer seeds: their mean and range are tabled too
        evals = [{"step": 0, "job_s": 30.0, "eval_exact": 0.1, "eval_reward": 0.1},
                 {"step": 5, "job_s": 400.0, "eval_exact": exact, "eval_reward": exact}]
        (tmp_path / f"trl_{name}_s{seed}.json").write_text(
            json.dumps(as_learn_run([{"step": i, "step_s": 80.0} for i in range(1, 6)], evals, seed)))
    text = learning_report(TINY_RECIPE, tmp_path)
    assert "over its seeds [0, 1]" in text
    assert "| 5 | 0.400 | 0.30-0.50 | 0.400 | 400.000 |" in text
    assert (tmp_path / f"learn_{name}.png").stat().st_size > 10_000


def test_profile_op_classes():
    assert op_class("aten::addmm") == op_class("aten::mm") == "matmul"
    assert op_class("aten::_softmax") == op_class("aten::baddbmm") == op_class("aten::bmm") == "attention"
    assert op_class("aten::_foreach_addcdiv_") == "optimizer"
    assert op_class("aten::copy_") == op_class("aten::index_select") == "copies/layout"
    assert op_class("aten::silu") == op_class("aten::mul") == "norms/elementwise"
    assert op_class("aten::something_new") == "other"


def test_an_environments_task_is_scored_by_its_share_solved():
    from gspo_ray.bench.learning import held_out_score

    assert held_out_score({"eval/exact": 0.5, "eval/solved": 0.1}) == 0.5
    assert held_out_score({"eval/solved": 0.3, "eval/reward": -0.2}) == 0.3
    assert held_out_score({"eval/reward": -0.8}) == 0.0  # the key is absent while no episode is solved


def test_the_anchor_bench_reports_each_variant_over_its_seeds(tmp_path):
    from gspo_ray.bench.anchor_learning import anchor_learning_report

    def run(variant, seed, solved, train_s, old_s, cap=450):
        return {**_run(seed, [(0, 5.0, 0.0, 0.0), (25, 40.0, 1.0 if solved else 0.4, 1.9)]), "variant": variant,
                "step_cap": cap, "train_s_per_step": train_s, "old_logprobs_s_per_step": old_s,
                "forwards_per_step": {"train": 1.0, "old_logprobs": 1.0 if old_s else 0.0}, "clip_frac_seq": 0.1,
                "anchor_gap": {} if old_s else {"seq_std": 7e-4, "token_mean": 1e-3}}
    results = tmp_path / "anchor_learn.jsonl"
    runs = [run("engine", 0, True, 1.0, 0.0), run("recomputed", 0, False, 1.5, 0.4), run("engine", 1, False, 1.2, 0.0),
            run("engine", 2, True, 9.0, 0.0, cap=100)]  # another step cap: not in this report
    results.write_text("".join(json.dumps(r) + "\n" for r in runs))
    text = anchor_learning_report(450, results)
    over = text.split("over seeds\n")[1].splitlines()
    assert _cells(over[2]) == ["engine", "2", "1/2", "25.000", "1.100", "0.000"]
    assert _cells(over[3]) == ["recomputed", "1", "0/1", "-", "1.500", "0.400"]
    assert (tmp_path / "anchor_learn.png").stat().st_size > 10_000
