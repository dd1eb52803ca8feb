"""The pool-size controller: grow, shrink or move a pool's workers, or hold, from measured phase times. No Ray.

Inputs, per step (`StepTimes`): the rollout pool's busy seconds for the step's completions (submit to last
completion), the train and sync seconds, the completions trained and their tokens, the groups dropped for age, the
buffer's depth and the oldest trained group's age, at the sizes the step ran with. The controller keeps the last
`window_steps` of them at the current sizes (the first step after a move, half at the old sizes, is not counted)
and predicts each phase's seconds per token (a length drift then reads as neither scaling nor a move's effect) at
other sizes from the measured scaling of each pool: n workers take (n0 / n)^e of the time n0 took, e per pool
measured from the last move that changed that pool (`scaling_prior` before one did; weighted by the move's size).

    sync mode  (the pools alternate)  time per token = rollout + train + sync   -> balance phase times
    async mode (the pools overlap)    time per token = max(rollout, train + sync) -> balance throughputs

and it picks, among the sizes one decision can reach (at most `max_move` workers or trainer layout steps per
pool, within each pool's bounds, the device budget, and trainer sizes `TrainerConfig.resize_problem` accepts):
  - the grow or move whose time saved over the next `horizon_steps` steps (fewer when the job ends sooner) pays
    its measured cost (a rollout grow: its engines' start, together; a trainer resize: save + rebuild + load), and
    that is predicted to raise completions trained per second by at least `min_gain`;
  - else (`give_back`) the shrink that gives back the most devices for at most `shrink_tolerance` x their share
    of throughput, leaving an async pool off the critical path by `min_gain`;
  - else hold.
Never inside the cool-down (`cooldown_steps` and `cooldown_s` since the last move), never a move that raises the
rollout's lead over the trainer while the window dropped groups for staleness, or trained groups at the staleness
bound with more waiting in the buffer (`coordinator.max_staleness`: they would age further), and never again a
move that did not pay: after each move the next window is compared with the one before it, per token; a grow or
move that gained less than half of `min_gain` (a shrink that lost more than twice `shrink_tolerance`), or a
resize the job refused, is blocked from the same sizes until the workload drifts (the time per token at those
sizes moves by more than `DRIFT`).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Literal

DRIFT = 0.25  # a blocked move is allowed again once the time per completion moved this much
ACTIONS = {"hold": 0, "grow": 1, "shrink": 2, "move": 3}  # autoscale/action


@dataclass(frozen=True)
class StepTimes:
    """One step's measurements, at the sizes it ran with."""

    rollout_workers: int
    trainer_workers: int
    rollout_s: float  # the rollout pool's busy seconds for the step's completions
    train_s: float
    sync_s: float
    completions: int  # completions trained this step
    at_s: float  # the job's clock at the step's end
    stale_dropped: int = 0  # groups dropped for age this step
    buffer_depth: int = 0  # scored groups waiting after the step
    staleness: float = 0.0  # the oldest trained group's age, in train steps
    tokens: int = 0  # their completion tokens (0: unknown; the times are then compared per completion)


@dataclass(frozen=True)
class Pools:
    """What the controller may choose from: bounds, devices per worker, the budget, the trainer's layout rule."""

    rollout: tuple[int, int]  # (min, max) workers
    trainer: tuple[int, int]  # (min, max) ranks
    rollout_devices: float = 1.0  # per worker
    trainer_devices: float = 1.0  # per rank
    max_devices: float | None = None
    trainer_problem: Callable[[int], str | None] = lambda n: None  # TrainerConfig.resize_problem
    mode: Literal["sync", "async"] = "sync"
    max_staleness: float | None = None  # coordinator.max_staleness in train steps (async); None: no bound to hold

    def devices(self, r: int, t: int) -> float:
        return r * self.rollout_devices + t * self.trainer_devices

    def trainer_sizes(self) -> list[int]:
        lo, hi = self.trainer
        return [n for n in range(lo, hi + 1) if self.trainer_problem(n) is None]


@dataclass(frozen=True)
class Decision:
    """One decision at a step boundary. Throughputs are completions trained per second."""

    action: Literal["hold", "grow", "shrink", "move"]
    rollout_workers: int  # the sizes to apply (the current ones on hold)
    trainer_workers: int
    reason: str
    throughput: float = math.nan  # measured over the window at the current sizes
    predicted: float = math.nan  # expected at the target sizes
    cost_s: float = 0.0  # the move's expected cost


@dataclass
class Move:
    """A move made, and what the window after it measured."""

    step: int
    at_s: float
    decision: Decision
    before: tuple[int, int]
    per_token: tuple[float, float, float]  # the window before it: rollout, train, sync seconds per token
    measured: float = math.nan  # completions/s in the first full window after it
    paid: bool | None = None
    judged_at: int | None = None  # the step whose decision measured it

    def outcome(self) -> str:
        """`the grow at step 2: 5.1 -> 9.0 completions/s measured (9.2 predicted), paid`."""
        d = self.decision
        return (f"the {d.action} at step {self.step}: {d.throughput:.3g} -> {self.measured:.3g} completions/s "
                f"measured ({d.predicted:.3g} predicted), {'paid' if self.paid else 'did not pay'}")


@dataclass
class Autoscaler:
    """Call `observe` after every step, `decide` at its boundary, then `applied` (or `refused`) with what the
    resize did. `cfg`: an AutoscaleConfig (or any object with its fields)."""

    cfg: object
    pools: Pools
    history: list[Move] = field(default_factory=list)
    window: list[StepTimes] = field(default_factory=list)
    scaling: dict[str, float] = field(default_factory=dict)  # pool -> measured exponent e
    costs: dict[str, float] = field(default_factory=dict)  # "rollout": s a grow; "trainer": s a resize
    blocked: dict[tuple[int, int, int, int], tuple[float, float]] = field(default_factory=dict)
    settling: bool = False  # the first step after a move is not measured
    current: tuple[int, int] = (0, 0)  # (rollout workers, trainer ranks) now

    def __post_init__(self):
        self.scaling = {"rollout": self.cfg.scaling_prior, "trainer": self.cfg.scaling_prior, **self.scaling}
        self.costs = {"rollout": self.cfg.move_cost_prior_s, "trainer": self.cfg.move_cost_prior_s, **self.costs}

    # -- measurements -----------------------------------------------------------------------------------------
    def observe(self, s: StepTimes) -> None:
        self.current = (s.rollout_workers, s.trainer_workers)
        if self.settling:
            self.settling = False
            return
        if self.window and (self.window[-1].rollout_workers, self.window[-1].trainer_workers) != \
                (s.rollout_workers, s.trainer_workers):
            self.window = []  # sizes changed outside the controller (`gspo-ray scale`): measure afresh
        self.window = (self.window + [s])[-self.cfg.window_steps:]

    def per_token(self) -> tuple[float, float, float]:
        """Median rollout, train and sync seconds per completion token over the window (per completion where
        tokens are unknown): a completion-length drift then shows up neither as a pool's scaling nor as a move
        that paid or did not."""
        return tuple(statistics.median(getattr(s, k) / max(s.tokens or s.completions, 1) for s in self.window)
                     for k in ("rollout_s", "train_s", "sync_s"))

    def tokens_per_completion(self) -> float:
        return statistics.median((s.tokens or s.completions) / max(s.completions, 1) for s in self.window)

    def phase_times(self, r: int, t: int, base: tuple[float, float, float] | None = None) -> tuple[float, ...]:
        """Predicted rollout, train and sync seconds per token at r rollout workers and t trainer ranks."""
        a, b, s = base or self.per_token()
        r0, t0 = self.sizes()
        return a * (r0 / r) ** self.scaling["rollout"], b * (t0 / t) ** self.scaling["trainer"], s

    def time_per_token(self, r: int, t: int, base: tuple[float, float, float] | None = None) -> float:
        """Predicted seconds per token (per completion where tokens are unknown) at these sizes."""
        return _time(self.phase_times(r, t, base), self.pools.mode)

    def sizes(self) -> tuple[int, int]:
        return self.current

    # -- decisions --------------------------------------------------------------------------------------------
    def decide(self, step: int, now_s: float, steps_left: int) -> Decision:
        """What to do at this step boundary (`step` steps done; `now_s` the job's clock)."""
        c = self.cfg
        if len(self.window) < c.window_steps:
            r, t = self.sizes()
            return Decision("hold", r, t, f"measuring: {len(self.window)} of {c.window_steps} steps at these sizes")
        r, t = self.sizes()
        base, per = self.per_token(), self.tokens_per_completion()
        now = 1 / max(self.time_per_token(r, t, base) * per, 1e-12)
        self._judge_last_move(now, base, step)
        hold = lambda why: Decision("hold", r, t, why, now, now)  # noqa: E731
        last = self.history[-1] if self.history else None
        if last is not None and (step - last.step < c.cooldown_steps or now_s - last.at_s < c.cooldown_s):
            return hold(f"cool-down: {step - last.step} steps, {now_s - last.at_s:.0f} s since the last move "
                        f"(cooldown_steps {c.cooldown_steps}, cooldown_s {c.cooldown_s:g})")
        stale = sum(s.stale_dropped for s in self.window)
        bound = self.pools.max_staleness
        at_bound = bound is not None and all(s.buffer_depth > 0 and s.staleness >= bound for s in self.window)
        horizon = max(min(c.horizon_steps, steps_left), 0)
        per_step = statistics.median(s.completions for s in self.window)
        gains, shrinks, skipped = [], [], []
        for r2, t2 in self._reachable(r, t):
            key = (r, t, r2, t2)
            if key in self.blocked and not self._drifted(self.blocked[key], base):
                skipped.append(f"{r}/{t} -> {r2}/{t2} did not pay")
                continue
            if (stale or at_bound) and self._favours_rollout(r, t, r2, t2):
                skipped.append(f"{r}/{t} -> {r2}/{t2}: " + (f"{stale} groups dropped for staleness in the window"
                               if stale else "groups wait in the buffer at the staleness bound"))
                continue
            pred = 1 / max(self.time_per_token(r2, t2, base) * per, 1e-12)
            action = "grow" if r2 >= r and t2 >= t else "shrink" if r2 <= r and t2 <= t else "move"
            if action == "shrink":
                if c.give_back and self._shrink_ok(r, t, r2, t2, base, now, pred):
                    shrinks.append((self.pools.devices(r, t) - self.pools.devices(r2, t2), pred, r2, t2))
                continue
            cost = (self.costs["rollout"] if r2 > r else 0.0) + (self.costs["trainer"] if t2 != t else 0.0)
            saved = horizon * per_step * (1 / now - 1 / pred) - cost
            if pred >= now * (1 + c.min_gain) and saved > 0:
                gains.append((saved, pred, r2, t2, action, cost))
        if gains:
            saved, pred, r2, t2, action, cost = max(gains)
            per_step_saved = (saved + cost) / horizon
            return Decision(action, r2, t2, f"{self._phases(base)}: {r}/{t} -> {r2}/{t2} workers predicted "
                            f"{now:.3g} -> {pred:.3g} completions/s, pays its ~{cost:.0f} s in "
                            f"{cost / per_step_saved:.1f} steps", now, pred, cost)
        if shrinks:
            freed, pred, r2, t2 = max(shrinks, key=lambda x: (x[0], x[1]))
            return Decision("shrink", r2, t2, f"{self._phases(base)}: {r}/{t} -> {r2}/{t2} workers gives back "
                            f"{freed:g} devices for {now:.3g} -> {pred:.3g} completions/s", now, pred)
        why = f"{self._phases(base)}: no move reachable pays"
        return hold(why + (f" ({'; '.join(skipped[:2])})" if skipped else ""))

    def applied(self, decision: Decision, step: int, now_s: float, cost_s: float | None = None) -> None:
        """The decision's sizes are in place; `cost_s`: what the resize took (measured), which the next ones
        are charged."""
        if decision.action == "hold":
            return
        before = self.sizes()
        if cost_s is not None:
            started = decision.rollout_workers - before[0]
            if decision.trainer_workers != before[1]:
                self.costs["trainer"] = cost_s  # the resize dominates: an engine start is seconds of it
            elif started > 0:
                self.costs["rollout"] = cost_s  # new engines start together: a grow costs about one start
        self.history.append(Move(step, now_s, decision, before, self.per_token()))
        self.window, self.settling = [], True
        self.current = (decision.rollout_workers, decision.trainer_workers)

    def refused(self, decision: Decision, reason: str) -> None:
        """The resize was refused (the cluster's room, a placement that failed): not tried again from here until
        the workload drifts."""
        r, t = self.sizes()
        self.blocked[(r, t, decision.rollout_workers, decision.trainer_workers)] = self.per_token()[:2]

    def metrics(self, decision: Decision) -> dict[str, float]:
        last = self.history[-1] if self.history else None
        out = {"autoscale/rollout_workers": decision.rollout_workers,
               "autoscale/trainer_workers": decision.trainer_workers,
               "autoscale/action": ACTIONS[decision.action],
               "autoscale/throughput": decision.throughput, "autoscale/predicted": decision.predicted,
               "autoscale/scaling_rollout": self.scaling["rollout"],
               "autoscale/scaling_trainer": self.scaling["trainer"]}
        if last is not None and last.paid is not None and not math.isnan(last.measured):
            out.update({"autoscale/measured_after": last.measured, "autoscale/predicted_after":
                        last.decision.predicted, "autoscale/paid": float(last.paid)})
        return {k: v for k, v in out.items() if not (isinstance(v, float) and math.isnan(v))}

    # -- helpers ----------------------------------------------------------------------------------------------
    def _reachable(self, r: int, t: int):
        p, m = self.pools, self.cfg.max_move
        sizes = p.trainer_sizes()
        if t not in sizes:
            sizes = sorted(set(sizes) | {t})
        i = sizes.index(t)
        for r2 in range(max(p.rollout[0], r - m), min(p.rollout[1], r + m) + 1):
            for t2 in sizes[max(0, i - m):i + m + 1]:
                if (r2, t2) == (r, t):
                    continue
                if p.max_devices is not None and p.devices(r2, t2) > p.max_devices + 1e-9:
                    continue
                yield r2, t2

    def _shrink_ok(self, r: int, t: int, r2: int, t2: int, base, now: float, pred: float) -> bool:
        """A shrink may lose at most the tolerance x the share of devices it gives back (a run of shrinks cannot
        add up to more than the tolerance). In async mode a pool off the critical path must also stay min_gain
        below it once shrunk, so measurement noise does not make it the bottleneck (and grow it back) next."""
        c, p = self.cfg, self.pools
        share = (p.devices(r, t) - p.devices(r2, t2)) / p.devices(r, t)
        if pred < now * (1 - c.shrink_tolerance * share):
            return False
        if p.mode == "sync":
            return True
        a0, b0, s0 = self.phase_times(r, t, base)
        a, b, s = self.phase_times(r2, t2, base)
        rollout_critical = a0 >= b0 + s0
        if r2 < r and not rollout_critical and a * (1 + c.min_gain) > b + s:
            return False
        if t2 < t and rollout_critical and (b + s) * (1 + c.min_gain) > a:
            return False
        return True

    @staticmethod
    def _favours_rollout(r: int, t: int, r2: int, t2: int) -> bool:
        """More rollout per trainer rank than now: the producer gains on the consumer, groups wait longer."""
        return r2 / t2 > r / t

    @staticmethod
    def _drifted(ref: tuple[float, float], base: tuple[float, float, float]) -> bool:
        return any(abs(now / max(then, 1e-12) - 1) > DRIFT for now, then in zip(base[:2], ref))

    def _phases(self, base: tuple[float, float, float]) -> str:
        a, b, s = base
        return f"rollout {a:.3g} s, train {b:.3g} s, sync {s:.3g} s per token ({self.pools.mode})"

    def _judge_last_move(self, now: float, base: tuple[float, float, float], step: int) -> None:
        """The first full window after a move: measure what it bought, update the changed pools' scaling, block
        it when it did not pay. Compared per token, so a drift in completion length is not taken for the move's
        effect; a small move's measured scaling is weighted by its size (a 10% change in workers is within the
        drift and noise of a few steps; one of 35% or more replaces the estimate)."""
        last = self.history[-1] if self.history else None
        if last is None or last.paid is not None:
            return
        c = self.cfg
        last.measured, last.judged_at = now, step
        r0, t0 = last.before
        r1, t1 = self.sizes()
        for pool, n0, n1, i in (("rollout", r0, r1, 0), ("trainer", t0, t1, 1)):
            if n0 != n1 and last.per_token[i] > 0 and base[i] > 0:  # what the pool's change bought
                e = min(max(math.log(last.per_token[i] / base[i]) / math.log(n1 / n0), 0.0), 1.0)
                weight = min(abs(math.log(n1 / n0)) / math.log(1.35), 1.0)
                self.scaling[pool] += weight * (e - self.scaling[pool])
        before = 1 / max(_time(last.per_token, self.pools.mode), 1e-12)  # tokens/s before and after
        after = 1 / max(_time(base, self.pools.mode), 1e-12)
        if last.decision.action == "shrink":
            last.paid = after >= before * (1 - 2 * c.shrink_tolerance)
        else:
            last.paid = after >= before * (1 + c.min_gain / 2)
        if not last.paid:
            self.blocked[(r0, t0, r1, t1)] = last.per_token[:2]


def _time(base: tuple[float, float, float], mode: str) -> float:
    a, b, s = base
    return a + b + s if mode == "sync" else max(a, b + s)
