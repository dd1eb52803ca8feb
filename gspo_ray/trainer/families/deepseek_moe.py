"""DeepSeekMoE: the MoE block DeepSeek-V3 / Kimi-K2 and GLM-4.5 share, stated once for the families that have it.

    class Glm4Moe(DeepSeekMoEFamily): ...       # families/glm4_moe.py adds its attention facts

What it is (transformers' `Glm4MoeMoE` / `DeepseekV3MoE`, vLLM's `Glm4MoE` / `DeepseekV2MoE`):
- the first `first_k_dense_replace` layers have a dense MLP (`intermediate_size`), every later layer an MoE
  (Megatron's `moe_layer_freq` list, from `Family.moe_layers`);
- `n_routed_experts` routed experts of width `moe_intermediate_size`, `num_experts_per_tok` per token, and
  `n_shared_experts` shared experts every token passes through, one MLP of width n_shared x moe_intermediate_size
  with no gate on its output (Megatron's `moe_shared_expert_intermediate_size`, `moe_shared_expert_gate=False`);
- the router: fp32 logits, sigmoid scores, the top-k chosen on `score + e_score_correction_bias` (optionally
  group-limited: `n_group` / `topk_group`), the weights the unbiased scores of the chosen experts, renormalised
  (`norm_topk_prob`) and multiplied by `routed_scaling_factor` (`Router` in base.py says how Megatron states it).

Refused by name (config.json key and value) where Megatron's router would compute something else: `norm_topk_prob`
false with top-k > 1 or true with top-k 1 (Megatron's sigmoid router renormalises exactly when k > 1); group
routing whose groups Megatron would rank otherwise (it sums a group's best top_k / topk_group scores, transformers
and vLLM its best 2); a `scoring_func` other than sigmoid or a `topk_method` other than noaux_tc (DeepSeek's
config.json states them; transformers 5 does not read them); `moe_layer_freq` other than 1.
"""
from __future__ import annotations

from gspo_ray.models.mtp import is_mtp_tensor
from gspo_ray.trainer.families.base import LLAMA_NAME_RULES, SHARED_EXPERT_NAME_RULES, MoEFamily, Router


class DeepSeekMoEFamily(MoEFamily):
    """A family whose MoE layers are DeepSeekMoE blocks (shared experts, biased sigmoid router, dense first layers).
    Subclasses state the attention and the rest."""

    name_rules = LLAMA_NAME_RULES + SHARED_EXPERT_NAME_RULES
    router_has_expert_bias = True

    # ---- the HF config keys read --------------------------------------------------------------------------------
    def num_experts(self, cfg: dict) -> int:
        return int(cfg.get("n_routed_experts") or 0)

    def moe_layers(self, cfg: dict, num_layers: int) -> tuple[int, ...]:
        """Dense MLPs in the first `first_k_dense_replace` layers, MoE in every later one."""
        if not self.num_experts(cfg):
            return ()
        return tuple(range(int(cfg.get("first_k_dense_replace", 0) or 0), num_layers))

    def moe_ffn_hidden_size(self, cfg: dict) -> int:
        return int(cfg["moe_intermediate_size"])

    def norm_topk_prob(self, cfg: dict) -> bool:
        return bool(cfg.get("norm_topk_prob", True))

    def shared_expert_ffn_hidden_size(self, cfg: dict) -> int:
        return int(cfg.get("n_shared_experts") or 0) * int(cfg.get("moe_intermediate_size") or 0)

    def router(self, spec) -> Router:
        cfg = spec.hf_config
        groups = int(cfg.get("n_group") or 1)
        return Router(score_function="sigmoid", normalize_topk=spec.extra["norm_topk_prob"], expert_bias=True,
                      bias_update_rate=float(spec.extra.get("router_bias_update_rate", 0.0)),
                      scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0), num_groups=groups,
                      group_topk=int(cfg.get("topk_group") or 1) if groups > 1 else 1)

    def ignored_hf_tensor(self, cfg: dict, name: str) -> bool:
        """The multi-token-prediction layers past the decoder (`num_nextn_predict_layers` of them, GLM-4.5's and
        DeepSeek-V3's, models/mtp.py): skipped on load, copied unchanged by the HF export
        (trainer/weights/hf_export.py)."""
        return is_mtp_tensor(cfg, name)

    # ---- the HF config keys refused -----------------------------------------------------------------------------
    def refuse_unsupported(self, cfg: dict, hf_dir) -> None:
        super().refuse_unsupported(cfg, hf_dir)
        where = f"{hf_dir}/config.json"
        for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if cfg.get(key, allowed) != allowed:
                raise ValueError(f"{where}: {key} {cfg[key]!r} is not supported (only {allowed!r}: the sigmoid "
                                 "router with its correction bias)")
        if int(cfg.get("moe_layer_freq", 1) or 1) != 1:
            raise ValueError(f"{where}: moe_layer_freq {cfg['moe_layer_freq']!r} is not supported (only 1: every "
                             "layer after first_k_dense_replace is MoE)")
        experts, k = self.num_experts(cfg), int(cfg.get("num_experts_per_tok") or 0)
        if not experts:
            return
        if not 0 < k <= experts:
            raise ValueError(f"{where}: num_experts_per_tok {k} must be in 1..n_routed_experts ({experts})")
        first_dense = cfg.get("first_k_dense_replace", 0) or 0
        if not 0 <= int(first_dense) <= int(cfg["num_hidden_layers"]):
            raise ValueError(f"{where}: first_k_dense_replace {first_dense!r} must be in 0..num_hidden_layers")
        norm = self.norm_topk_prob(cfg)
        if norm != (k > 1):  # Megatron: probs / sum(probs) exactly when topk > 1
            raise ValueError(f"{where}: norm_topk_prob {norm} with num_experts_per_tok {k} is not supported "
                             "(Megatron's sigmoid router renormalises the weights exactly when top-k > 1)")
        self._refuse_groups(cfg, where, experts, k)

    @staticmethod
    def _refuse_groups(cfg: dict, where: str, experts: int, k: int) -> None:
        groups, chosen = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
        if groups == 1:
            if chosen != 1:
                raise ValueError(f"{where}: topk_group {chosen} with n_group 1 (one group: topk_group must be 1)")
            return
        if experts % groups:
            raise ValueError(f"{where}: n_group {groups} does not divide n_routed_experts {experts}")
        if not 0 < chosen <= groups or k > chosen * (experts // groups):
            raise ValueError(f"{where}: topk_group {chosen} must be in 1..n_group ({groups}) and its groups must "
                             f"hold num_experts_per_tok ({k}) experts")
        # transformers / vLLM rank a group by its 2 best scores, Megatron's group_limited_topk by its best
        # top_k // topk_group: the same only when that is 2 (DeepSeek-V3's 8 / 4)
        if k // chosen != 2 or experts // groups < 2:
            raise ValueError(f"{where}: n_group {groups} / topk_group {chosen} with num_experts_per_tok {k} is not "
                             "supported: Megatron ranks a group by its best num_experts_per_tok // topk_group "
                             f"({k // chosen}) scores, transformers and vLLM by its best 2")

    # ---- the engine -----------------------------------------------------------------------------------------------
    def engine_routes_shape(self, config) -> tuple[int, int, int]:
        """vLLM makes every layer from `first_k_dense_replace` on MoE, as the trainer does."""
        first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
        return config.num_hidden_layers - first_dense, config.num_experts_per_tok, config.n_routed_experts
