"""`algorithm.dilution_mask` from the job config to the policy-gradient weights the trainer's loss takes
(trainer/pg_weights.py): `token` zeroes exactly the diluted tokens, `sequence` the diluted completions, `none` leaves
the loss alone. The hand-built rows are tests/algo/test_dilution.py's (threshold 0.2, band 3e-4/4e-4)."""
import torch

from gspo_ray.config import load_config
from gspo_ray.trainer.pg_weights import build_pg_weight

F64 = torch.float64
LOG_R = [[0.3, -0.1, -0.1, -0.1], [0.3, 0.0, 0.0, 0.0], [0.01, -0.01, 0.0, 0.0], [0.0, 0.0, -0.5, 0.0]]
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)


def _weight(mode):
    algo = load_config(None, [f"algorithm.dilution_mask={mode}", "algorithm.dilution_threshold=0.2"]).algorithm
    old = torch.full((4, 4), -1.0, dtype=F64)
    logp = old + torch.tensor(LOG_R, dtype=F64)
    return build_pg_weight(logp, old, None, torch.ones(4, dtype=F64), MASK, algo, 3e-4, 4e-4)


def test_dilution_mask_token_drops_exactly_the_diluted_tokens():
    weight, metrics = _weight("token")
    # row 0's 0.3 (unclipped, s = 1) and row 3's -0.5 (s = 0.846 < 1 but A > 0: unclipped) are diluted
    expected = torch.ones(4, 4, dtype=F64)
    expected[0, 0] = expected[3, 2] = 0.0
    assert torch.equal(weight, expected)
    assert metrics["train/dilution_frac"] == 0.5


def test_dilution_mask_sequence_and_none():
    weight, _ = _weight("sequence")
    assert weight[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0] and bool((weight == weight[:, :1]).all())
    weight, metrics = _weight("none")
    assert weight is None and metrics["train/dilution_frac"] == 0.5  # measured, not applied
