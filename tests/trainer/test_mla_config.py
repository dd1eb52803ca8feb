"""attention/mla.py: the HF config keys of multi-latent attention -> Megatron's MLATransformerConfig options, and
the configs refused by name (one line naming the config.json key and value): DeepSeek-V3.2's indexer, kv_lora_rank
without its head dims, RoPE types not implemented, rope_interleave false, YaRN variants on which transformers and
vLLM / Megatron disagree, a latent-norm eps transformers does not use, layouts MLA cannot run. No torch, no model."""
from __future__ import annotations

import math

import pytest

from gspo_ray.trainer.attention.mla import check_mla_layout, mla_options, yarn_mscale

WHERE = "m/config.json"
BASE = dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=16, v_head_dim=24, rms_norm_eps=1e-6, rope_interleave=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # DeepSeek-V3's


def test_options_of_a_deepseek_v3_config():
    assert mla_options(dict(BASE, kv_lora_rank=None), WHERE) == {}  # not MLA
    got = mla_options(BASE, WHERE)
    assert got == dict(q_lora_rank=16, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=24,
                       rotary_base=10000.0, rotary_percent=1.0, rope_type="rope")
    yarn = mla_options(dict(BASE, q_lora_rank=None, rope_parameters=YARN), WHERE)
    assert yarn["q_lora_rank"] is None and yarn["rope_type"] == "yarn" and yarn["rotary_scaling_factor"] == 40.0
    assert (yarn["mscale"], yarn["mscale_all_dim"], yarn["original_max_position_embeddings"]) == (1.0, 1.0, 4096)
    # transformers 4.x configs: rope_scaling with `type`, rope_theta at the top level
    scaling = {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")} | {"type": "yarn"}
    old = mla_options(dict(BASE, rope_parameters=None, rope_theta=50000.0, rope_scaling=scaling), WHERE)
    assert old["rotary_base"] == 50000.0 and old["rope_type"] == "yarn"
    assert math.isclose(yarn_mscale(40.0, 1.0), 0.1 * math.log(40.0) + 1.0) and yarn_mscale(0.5, 3.0) == 1.0


@pytest.mark.parametrize("change, words", [
    (dict(index_topk=2048), "index_topk 2048"),
    (dict(qk_rope_head_dim=None), "without qk_rope_head_dim"),
    (dict(v_head_dim=0), "without v_head_dim"),
    (dict(num_key_value_heads=1), "num_key_value_heads 1"),
    (dict(rope_interleave=False), "rope_interleave False"),
    (dict(attention_bias=True), "attention_bias True"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps 1e-05"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_type 'longrope'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), "rope_type 'llama3'"),
    (dict(rope_parameters=dict(YARN, factor=None)), "without rope_parameters.factor"),
    (dict(rope_parameters=dict(YARN, truncate=False)), "truncate False"),
    (dict(rope_parameters=dict(YARN, mscale=0.7, mscale_all_dim=None)), "mscale 0.7 with mscale_all_dim None"),
    (dict(rope_parameters=dict(YARN, attention_factor=1.0)), "attention_factor 1.0"),
])
def test_refused_by_name(change, words):
    with pytest.raises(ValueError) as err:
        mla_options(dict(BASE, **change), WHERE)
    line = str(err.value)
    assert line.startswith(WHERE) and words in line and "\n" not in line


def test_yarn_factors_that_agree_are_taken():
    # both set (the ratio everywhere), neither set (mscale(factor) everywhere), mscale 1 alone (the same)
    for m, m_all in ((0.8, 0.6), (None, None), (1.0, None)):
        mla_options(dict(BASE, rope_parameters=dict(YARN, mscale=m, mscale_all_dim=m_all)), WHERE)


def test_layouts():
    options = mla_options(BASE, WHERE)
    check_mla_layout(options, 1, False, WHERE)
    check_mla_layout(options, 2, True, WHERE)
    with pytest.raises(ValueError, match="needs sequence_parallel"):
        check_mla_layout(options, 2, False, WHERE)
    with pytest.raises(ValueError, match="tp=3 must divide q_lora_rank 16"):
        check_mla_layout(options, 3, True, WHERE)
    check_mla_layout({}, 4, False, WHERE)  # not MLA: nothing to check
