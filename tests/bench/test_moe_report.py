"""The MoE bench's report (table and plot) from run results: what a ~50-minute `make bench-moe` ends with."""
import pytest

from gspo_ray.bench.moe import UPDATES, format_moe, plot_moe


def _result(label, drift_at, reward):
    return {"label": label, "level": "token", "replay": "none", "seed": 0, "steps": len(reward), "drift": 0.01,
            "drift_at": drift_at, "drift_layer": [0.01, 0.03], "layers": [0, 1], "logr_std": 0.02,
            "clip_tok": 0.25, "clip_seq": 0.1, "reward": reward, "skipped": 0.0, "wall_s": 1.0}


def test_table_reads_drift_after_k_updates_and_reward_ends(tmp_path):
    drift_at = [k / 100 for k in range(UPDATES)]
    table = format_moe([_result("GRPO + R2", drift_at, [0.1, None, 0.4])])
    header, _, row = table.splitlines()
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == header.count("|") - 1
    assert cells[:3] == ["GRPO + R2", "0", "3"]
    assert cells[3:6] == ["0.0100", "0.0400", f"{drift_at[UPDATES - 1]:.4f}"]  # after 1, 4 and 7 updates
    assert cells[7] == "0.0300" and cells[11] == "0.100 -> 0.400"           # worst layer; first -> last reward
    assert cells[13:] == ["-", "-", "-"]  # no routing-noise probe under R2
    noisy = _result("GRPO", drift_at, [0.1])
    noisy.update(noise_d=0.0123, noise_tok_removed=0.5, noise_seq_removed=0.25)
    assert format_moe([noisy]).splitlines()[2].rstrip("|").split("|")[-3:] == [" 0.0123 ", " 0.500 ", " 0.250 "]
    png = plot_moe([_result("GSPO", drift_at, [0.2, 0.3])], tmp_path / "moe.png")
    assert png.stat().st_size > 10_000


def test_the_over_seed_summary_averages_each_variant_and_shows_the_seeds_range(tmp_path):
    from gspo_ray.bench.moe_tiny import format_summary, plot_rewards, summarise

    runs = []
    for seed, (last, end) in enumerate([(1.0, 1.5), (1.4, 1.9)]):
        r = _result("GSPO", [0.0, 0.06, 0.1], [0.2] * 5 + [last] * 5)
        r.update(seed=seed, drift=0.08, grad_norm=[1.0, 1.0, 4.0 + seed], eval=[(0, 0.0), (10, end)],
                 noise_d=0.01 * (seed + 1), noise_tok_removed=0.4, noise_seq_removed=0.2)
        runs.append(r)
    r2 = _result("GRPO + R2", [0.0, 0.02, 0.03], [0.1] * 10)
    r2.update(grad_norm=[2.0, 2.0], eval=[(0, 0.0), (10, 0.5)])
    rows = summarise(runs + [r2])
    assert [r["label"] for r in rows] == ["GSPO", "GRPO + R2"]
    gspo = rows[0]
    assert gspo["seeds"] == 2 and gspo["updates"] == 10 * 3
    assert gspo["drift_1"] == 0.06 and gspo["noise_d"] == pytest.approx(0.015)
    assert gspo["reward_first"] == pytest.approx(0.2) and gspo["reward_last"] == pytest.approx((1.2, 1.0, 1.4))
    assert gspo["eval_end"] == pytest.approx((1.7, 1.5, 1.9))
    assert gspo["grad_norm_peak"] == 5.0  # the worse seed's peak over its median
    assert rows[1]["noise_d"] is None  # no routing-noise probe under R2
    table = format_summary(rows).splitlines()
    assert len(table) == 4 and "| GSPO | 2 | 30 | 0.0600 |" in table[2]
    assert "1.200 (1.000-1.400)" in table[2] and "1.700 (1.500-1.900)" in table[2]
    assert plot_rewards(runs + [r2], tmp_path / "tiny.png").stat().st_size > 10_000


def test_async_runs_kept_over_sittings_add_up_and_a_rerun_replaces_its_earlier_row(tmp_path):
    from gspo_ray.bench.moe_async import append_result, load_results

    path = tmp_path / "moe_async.jsonl"
    append_result(path, {"label": "GRPO", "seed": 0, "requested_steps": 200, "eval_final": 0.5})
    append_result(path, {"label": "GRPO", "seed": 0, "requested_steps": 30, "eval_final": 0.1})
    append_result(path, {"label": "GRPO", "seed": 1, "requested_steps": 200, "eval_final": 0.7})
    append_result(path, {"label": "GRPO", "seed": 0, "requested_steps": 200, "eval_final": 0.9})
    kept = load_results(path, 200)
    assert [(r["seed"], r["eval_final"]) for r in kept] == [(1, 0.7), (0, 0.9)]
    assert [r["eval_final"] for r in load_results(path, 30)] == [0.1]
    assert load_results(tmp_path / "absent.jsonl", 200) == []


def test_every_async_variant_is_a_config_the_job_accepts(tmp_path):
    from gspo_ray.bench.moe_async import VARIANTS, variant_config

    for label, level, replay, extra in VARIANTS:
        cfg = variant_config(label, level, replay, 200, 0, tmp_path, extra)
        assert cfg.coordinator.mode == "async" and cfg.trainer.routing_replay == replay


def test_held_out_curve_averages_only_steps_every_seed_reached():
    from gspo_ray.bench.moe_async import held_out_mean

    runs = [{"eval_history": [[0, 0.0], [10, 1.0], [20, 2.0]]}, {"eval_history": [[0, 0.5], [10, 0.0]]}]
    assert held_out_mean(runs) == {0: 0.25, 10: 0.5}


def test_a_run_the_early_stop_ended_is_solved_and_counts_at_its_last_value():
    from gspo_ray.bench.moe_async import held_out_mean, solved_at, solved_reward

    assert solved_reward() == 1.95  # the tiny recipe's early stop, which ends a solved run
    solved = {"eval_history": [[0, 0.0], [10, 1.96]]}
    running = {"eval_history": [[0, 0.2], [10, 1.0], [20, 1.5], [30, 1.7]]}
    assert solved_at(solved) == 10 and solved_at(running) == "-"
    assert held_out_mean([solved, running]) == {0: 0.1, 10: 1.48, 20: 1.73, 30: 1.83}


def test_the_largest_dip_is_the_deepest_fall_below_the_best_so_far():
    from gspo_ray.bench.moe_async import largest_dip

    assert largest_dip({"eval_history": [[0, 0.1], [10, 1.0], [20, 0.4], [30, 1.5], [40, 1.2]]}) == 0.6
    assert largest_dip({"eval_history": [[0, 0.1], [10, 0.2]]}) == 0.0
