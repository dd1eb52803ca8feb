"""MoE routing on the trainer side: what the routers decide, how it moves, and what holding it would change.

    churn.py         router churn: top-k choices an update flips (re-forward after the step), find_routers
    drift.py         routing drift: top-k choices that differ from a row's first trainer forward, by updates since
    replay.py        Routing Replay (R2) on megatron-core's RouterReplay
    records.py       the per-row record store (current rollout batch only; each record on the DP rank using it)
    noise_probe.py   trainer.routing_noise: the routing-induced log-ratio (a held-routing forward beside each one)
    agreement.py     trainer top-k vs the engine's per trained token, by version lag
    selection.py     router_topk: the experts a router selects (softmax: top-k logits; sigmoid: + expert bias, groups)
    worker.py        TrainerRouting: what a TrainerWorker runs around its forwards with all of the above
"""
