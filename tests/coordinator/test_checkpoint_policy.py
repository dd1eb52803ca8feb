"""When a step boundary saves (`coordinator.checkpoint_every`, `checkpoint_every_s`): with the SmolLM2 recipes'
`checkpoint_every: 0`, the time rule alone bounds what a trainer death or a kill replays (600 s by default)."""
from gspo_ray.config import load_config
from gspo_ray.coordinator.job import checkpoint_due


def test_every_n_steps_the_last_step_and_every_n_seconds():
    assert [s for s in range(1, 11) if checkpoint_due(s, 4, s == 10, 0, 0.0)] == [4, 8, 10]
    assert not checkpoint_due(3, 0, False, 600, 599.9)
    assert checkpoint_due(3, 0, False, 600, 600.0)
    assert not checkpoint_due(3, 0, False, 0, 1e9)  # 0: the time rule is off


def test_a_steps_only_recipe_gets_a_save_at_least_every_ten_minutes():
    cfg = load_config("gspo_ray/recipes/smollm2_sum.yaml", [])
    c = cfg.coordinator
    assert c.checkpoint_every == 0 and c.checkpoint_every_s == 600
    # 80 s steps (the slowest measured smollm2_sum step), 20 steps: saves at 8 and 16 (640 s, 1280 s) and the end
    since, saved = 0.0, []
    for step in range(1, c.steps + 1):
        since += 80
        if checkpoint_due(step, c.checkpoint_every, step == c.steps, c.checkpoint_every_s, since):
            saved.append(step)
            since = 0.0
    assert saved == [8, 16, 20]  # a death replays at most 7 steps = 560 s < 600 s + one step (before: from step 0)
