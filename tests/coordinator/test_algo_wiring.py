"""Pure-python wiring of the algorithm options: robust advantages in the buffer, engine log-probs kept next to
recomputed ones in a TrainBatch, auto-eps state in the coordinator's checkpoint, the trainer's metric reduction."""
from pathlib import Path

import pytest

from gspo_ray.config import load_config
from gspo_ray.coordinator.buffer import GroupBuffer, pack_groups
from gspo_ray.coordinator.loop import Coordinator, LoopState
from gspo_ray.data.records import Group, Prompt, Sample


def _group(uid, rewards):
    samples = [Sample(prompt_uid=uid, sample_index=i, prompt_ids=[5, 6], completion_ids=[9, 9],
                      logprobs=[-0.5, -0.25], loss_mask=[1, 1], versions=[0, 0], finish_reason="stop", reward=r)
               for i, r in enumerate(rewards)]
    return Group(prompt=Prompt(uid=uid, prompt_ids=[5, 6]), samples=samples)


@pytest.mark.parametrize("robust,expected", [
    ("none", [0.354, -2.475]),   # seed 002 §5: -7/sqrt(8), +1/sqrt(8)
    ("rank", [0.354, -2.475]),   # ranks [5]*7 + [1]: the same numbers (see tests/algo/test_robust_advantages.py)
])
def test_buffer_applies_robust_advantages(robust, expected):
    buf = GroupBuffer(robust=(robust, 0.1))
    buf.admit([_group("a", [1.0] * 7 + [-200.0])], current_version=0)
    adv = buf.groups[0].advantages
    assert [round(adv[0], 3), round(adv[-1], 3)] == expected


def test_buffer_clip_filters_a_lone_outlier():
    # clip winsorises -200 to 1.0: nothing left to learn from, so the group is filtered like an all-equal one
    stats = GroupBuffer(robust=("clip", 0.1)).admit([_group("a", [1.0] * 7 + [-200.0])], current_version=0)
    assert (stats.admitted, stats.zero_adv) == (0, 1)


def test_recomputed_logprobs_anchor_and_engine_logprobs_stay():
    g = _group("a", [1.0, 0.0])
    g.advantages = [0.7, -0.7]
    assert pack_groups([g]).rollout_logp is None  # engine anchor: nothing extra
    for s in g.samples:
        s.old_logprobs = [-0.4, -0.3]  # what Coordinator._recompute_old_logprobs stores
    batch = pack_groups([g])
    # tokens: prompt [5, 6] then completion [9, 9] at positions 2, 3
    assert batch.old_logp[0, 2:].tolist() == pytest.approx([-0.4, -0.3])
    assert batch.rollout_logp[0, 2:].tolist() == pytest.approx([-0.5, -0.25])
    assert batch.select([1]).rollout_logp.shape == (1, 4)


def test_auto_eps_state_rides_in_the_coordinator_checkpoint():
    cfg = load_config(None, ["algorithm.eps=auto", "coordinator.num_iterations=2"])
    coord = Coordinator(cfg, None, None, None, LoopState())
    coord.auto_eps.observe(0.0, 0.02**2, n_tokens=400, n_seqs=100, clip_frac_seq=0.3)
    coord.auto_eps.update()
    state = coord.state_dict()
    resumed = Coordinator(cfg, None, None, None, LoopState())
    resumed.load_state_dict(state)
    assert resumed.auto_eps.band() == coord.auto_eps.band() != (3e-4, 4e-4)


def test_metric_reduction_of_dilution_keys():
    from gspo_ray.trainer.metric_accumulator import MetricAccumulator

    acc = MetricAccumulator(per_sequence_ratio=True)
    # three micro-batches: 1 of 4, 3 of 12 and 0 of 16 completions diluted -> 4/32 (weighted by completions, not
    # tokens: by tokens it would read (25 + 2.5) / 120 = 0.23); the largest |log r| is a maximum, not a mean
    acc.add({"train/dilution_frac": 0.25, "train/dilution_max_abs_logr": 0.3}, n_tok=100, n_seq=4, n_units=4)
    acc.add({"train/dilution_frac": 0.25, "train/dilution_max_abs_logr": 0.9}, n_tok=10, n_seq=12, n_units=12)
    acc.add({"train/dilution_frac": 0.0, "train/dilution_max_abs_logr": 0.0}, n_tok=10, n_seq=16, n_units=16)
    out = acc.reduce()
    assert out["train/dilution_frac"] == pytest.approx(4 / 32) and out["train/dilution_max_abs_logr"] == 0.9


def test_mini_batches_with_every_token_masked_are_skipped_not_trained():
    """rollout.partial's stale_rule "mask" can leave a mini-batch with no trained token: it is skipped (a train_step
    on it fails this test) and counted; the version stays; the batch still ends (its routing records go)."""
    class NoTraining:  # the trainer's two calls train_on makes; training must not be one of them here
        ended = 0

        def train_step(self, batch, eps=None):
            raise AssertionError("an all-masked mini-batch reached the trainer")

        def end_batch(self):
            self.ended += 1

    cfg = load_config(None, ["coordinator.num_minibatches=2", "coordinator.num_iterations=2", "algorithm.eps=fixed",
                             "coordinator.recompute_old_logprobs=false"])
    trainer = NoTraining()
    coord = Coordinator(cfg, None, trainer, None, LoopState(version=3))
    groups = [_group("a", [1.0, 0.0]), _group("b", [0.0, 1.0])]
    for g in groups:
        g.advantages = [0.7, -0.7]
        for s in g.samples:
            s.loss_mask = [0, 0]
    out = coord.train_on(groups)
    assert out["train/skipped"] == 1.0 and out["train/optimizer_steps"] == 0
    assert out["train/empty_minibatches"] == 4  # 2 passes x 2 mini-batches
    assert out["train/version"] == coord.state.version == 3 and trainer.ended == 1


class _Rollout:
    """The rollout pool's calls collect_groups makes: every round returns the next scripted list of groups."""
    num_workers, redispatched, max_restarts, restarts_left = 1, 0, 0, 0

    def __init__(self, rounds):
        self.rounds = list(rounds)

    def submit(self, prompts, group_size, version):
        return prompts

    def wait(self, pending):
        return self.rounds.pop(0), {"rollout/samples": 2.0}


class _Prompts:
    def take(self, n):
        return [Prompt(uid=f"p{i}", prompt_ids=[5, 6]) for i in range(n)]


def test_fewer_groups_than_mini_batches_wait_in_the_buffer_not_dropped():
    # 2 mini-batches, no refill round: the first step yields one informative group (the other is all-equal), which
    # cannot fill 2 mini-batches. It must wait for the next step, not vanish while the step counts as done.
    cfg = load_config(None, ["coordinator.prompts_per_step=2", "coordinator.num_minibatches=2",
                             "coordinator.max_refill_rounds=0", "algorithm.eps=fixed"])
    rollout = _Rollout([[_group("a", [1.0, 0.0]), _group("b", [1.0, 1.0])], [_group("c", [0.0, 1.0])]])
    coord = Coordinator(cfg, rollout, None, _Prompts(), LoopState())
    taken, m = coord.collect_groups()
    assert taken == [] and m["rollout/groups_trained"] == 0 and [g.prompt.uid for g in coord.buffer.groups] == ["a"]
    taken, m = coord.collect_groups()
    assert [g.prompt.uid for g in taken] == ["a", "c"] and m["rollout/groups_trained"] == 2


def test_step_metrics_reduce_maxima_by_max_counts_by_sum_states_by_last():
    class Scripted:  # two mini-batches' metrics, as the trainer returns them
        rows = [{"train/ratio_max": 1.5, "train/ratio_min": 0.9, "train/forward_tokens": 100.0,
                 "train/forward_passes_train": 2.0, "train/policy_version": 4.0, "train/skipped_steps": 0.0,
                 "train/dilution_max_abs_logr": 0.2, "train/clip_frac_seq": 0.1},
                {"train/ratio_max": 1.1, "train/ratio_min": 0.7, "train/forward_tokens": 60.0,
                 "train/forward_passes_train": 2.0, "train/policy_version": 5.0, "train/skipped_steps": 1.0,
                 "train/dilution_max_abs_logr": 0.6, "train/clip_frac_seq": 0.3}]

        def train_step(self, batch, eps=None):
            return self.rows.pop(0)

        def end_batch(self):
            pass

    cfg = load_config(None, ["coordinator.num_minibatches=2", "algorithm.eps=fixed",
                             "coordinator.recompute_old_logprobs=false"])
    coord = Coordinator(cfg, None, Scripted(), None, LoopState(version=3))
    groups = [_group("a", [1.0, 0.0]), _group("b", [0.0, 1.0])]
    for g in groups:
        g.advantages = [0.7, -0.7]
    out = coord.train_on(groups)
    # a mean would read 1.3, 0.8, 80, 2, 4.5, 0.5, 0.4
    assert (out["train/ratio_max"], out["train/ratio_min"], out["train/forward_tokens"]) == (1.5, 0.7, 160.0)
    assert out["train/forward_passes_train"] == 4.0 and out["train/dilution_max_abs_logr"] == 0.6
    assert (out["train/policy_version"], out["train/skipped_steps"]) == (5.0, 1.0)
    assert out["train/clip_frac_seq"] == pytest.approx(0.2)  # a share: the mean


def test_a_resumed_loop_deals_the_same_mini_batches_and_keeps_the_failure_streak(tmp_path):
    """Through a real job checkpoint (loop.json, no trainer): the buffer's shuffle RNG and the failure streak come
    back, so the resumed loop puts the same groups together in the same mini-batches and stops at the same step as
    the uninterrupted one (before: the RNG was re-seeded and the streak started at 0)."""
    from gspo_ray.coordinator.checkpoint import CheckpointManager
    from gspo_ray.coordinator.failures import TooManyFailedSamples

    cfg = load_config(None, ["coordinator.prompts_per_step=8", "coordinator.num_minibatches=2",
                             "rollout.reward.max_failed_share=0.5", "rollout.reward.max_failed_steps=2"])
    groups = [_group(f"g{i}", [1.0, 0.0]) for i in range(8)]
    for g in groups:
        g.advantages = [0.7, -0.7]

    def deal(coord):  # the groups of each mini-batch, as one step's train_on splits them
        return [sorted(b.uids) for b in coord.buffer.minibatches(groups, 2)]

    run = Coordinator(cfg, None, None, None, LoopState(step=3, version=3))
    deal(run), deal(run)  # three steps trained: the RNG moved
    run.failures.check(3, 3, 4, {"boom": 3})  # step 3: 75% failed, one step of the streak
    ckpts = CheckpointManager(tmp_path)
    ckpts.save(run.state, lambda d: (Path(d) / "meta.json").write_text("{}"),  # the trainer's part: its marker
               extra={"coordinator": run.state_dict()})

    state, extra = ckpts.load_state(ckpts.latest())
    resumed = Coordinator(cfg, None, None, None, state)
    resumed.load_state_dict(extra["coordinator"])
    assert [deal(resumed) for _ in range(3)] == [deal(run) for _ in range(3)]
    for coord in (run, resumed):  # step 4 fails too: the second step in a row stops both
        with pytest.raises(TooManyFailedSamples, match="for 2 steps in a row"):
            coord.failures.check(4, 3, 4, {"boom": 3})


@pytest.mark.parametrize("sigma", [0.0, 0.02])
def test_eps_auto_in_async_mode_follows_injected_drift(sigma):
    """Async mode, engine log-probs as the anchor, 1 pass x 1 mini-batch (make run's recipe): the batch was sampled
    one version before the trainer's, so its one mini-batch is a reuse mini-batch and eps auto observes it. A
    trainer whose log-ratios spread by `sigma` (drift injected) moves the band; no drift leaves it."""
    class Drifting:
        def train_step(self, batch, eps=None):
            n = float(batch.loss_mask.sum())
            return {"train/logr_mean": 0.0, "train/logr_sq_mean": sigma ** 2, "train/n_tokens": n,
                    "train/n_seqs": float(batch.num_sequences), "train/clip_frac_seq": 0.5 if sigma else 0.0,
                    "train/policy_version": 4.0}

        def end_batch(self):
            pass

    cfg = load_config(None, ["coordinator.mode=async", "algorithm.eps=auto", "coordinator.num_minibatches=1",
                             "coordinator.num_iterations=1", "coordinator.recompute_old_logprobs=false"])
    coord = Coordinator(cfg, None, Drifting(), None, LoopState(version=3))
    groups = [_group("a", [1.0, 0.0]), _group("b", [0.0, 1.0])]
    for g in groups:
        g.advantages = [0.7, -0.7]
        for s in g.samples:
            s.versions = [2, 2]  # sampled one update before the trainer's version 3
    before = coord.auto_eps.band()
    out = coord.train_on(groups)
    if sigma:
        assert coord.auto_eps.band() != before and out["train/auto_eps_sigma"] == pytest.approx(sigma)
    else:
        assert coord.auto_eps.band() == before


def test_routing_agreement_of_a_step_counts_only_the_mini_batches_that_compared():
    """A lag bucket one mini-batch of two did not see is not a 0 there: the step's share comes from the sums."""
    class Agreeing:
        calls = 0

        def train_step(self, batch, eps=None):
            self.calls += 1
            lag0 = {"moe/route_agree_lag0": 1.0, "moe/route_agree_hits_lag0": 10.0,
                    "moe/route_agree_tokens_lag0": 10.0} if self.calls == 1 else {}
            return {**lag0, "moe/route_agree_lag1": 0.5, "moe/route_agree_hits_lag1": 5.0 * self.calls,
                    "moe/route_agree_tokens_lag1": 10.0 * self.calls, "train/policy_version": float(self.calls)}

        def compute_logprobs(self, batch, purpose):  # step 1's anchor-gap check: the engine's own, no gap
            return batch.old_logp

        def end_batch(self):
            pass

    cfg = load_config(None, ["coordinator.num_minibatches=2", "algorithm.eps=fixed",
                             "coordinator.recompute_old_logprobs=false"])
    coord = Coordinator(cfg, None, Agreeing(), None, LoopState(version=0))
    groups = [_group("a", [1.0, 0.0]), _group("b", [0.0, 1.0])]
    for g in groups:
        g.advantages = [0.7, -0.7]
    out = coord.train_on(groups)
    assert out["moe/route_agree_lag0"] == 1.0 and out["moe/route_agree_lag1"] == 0.5
