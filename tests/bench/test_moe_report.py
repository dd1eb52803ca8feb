"""The MoE bench's report (table and plot) from run results: what a ~50-minute `make bench-moe` ends with."""
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
