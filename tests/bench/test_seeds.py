"""`gspo-ray bench --seeds`: what is asked for runs, seed 0 alone included; without it each suite's default."""
from gspo_ray.bench import DEFAULT_SEEDS, seeds_for


def test_an_explicit_seed_zero_runs_alone():
    assert seeds_for("learn", (0,)) == (0,)
    assert seeds_for("recovery", (0,)) == (0,)
    assert seeds_for("learn", (3, 1)) == (3, 1)


def test_no_seeds_gives_the_suites_default():
    assert seeds_for("learn", None) == (0, 1, 2) == DEFAULT_SEEDS["learn"]
    assert seeds_for("recovery", None) == (0, 1)
    assert seeds_for("moe", None) == (0,)
    assert seeds_for("tiny", None) == (0,)
