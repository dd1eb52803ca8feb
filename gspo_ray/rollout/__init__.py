"""Rollout: vLLM engines in Ray actors that sample groups and return the engine's per-token log-probs.

    engine.py                 RolloutEngine: token ids in, Samples (ids, log-probs, versions) out; abort/continue
    engine_env.py             where an engine runs (in-process / multi-process for TP > 1), its cores and environment
    shm_transfer.py           gspo_shm: our backend of vLLM's weight-transfer protocol (every TP worker maps the push)
    worker.py                 RolloutWorker: the actor (generate, continue_samples, update_weights, verify, pause)
    weight_sync.py            bucketed weight push into a live engine, probe check
    expert_coverage.py        router counts of the push probe: which experts of an MoE it reached
    scoring.py                RewardRunner: reward functions with timeouts (child processes or threads)
    reward_procs.py           killable child processes for reward calls
    episodes.py               multi-turn episodes on the engine's step loop
    partial.py                staleness rules for partial rollouts (pure)

Importing this package does not import vLLM (the modules do, lazily, when an engine starts).
"""
