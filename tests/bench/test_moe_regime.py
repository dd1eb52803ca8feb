"""The regime probe (bench/moe_regime.py) on a tiny Llama upcycled to 8 experts, top-2: the top-k churn it reports is 0 without
an update, > 0 after a large one, and the probe leaves the weights as it found them (to float rounding)."""
import torch

from gspo_ray.bench.moe_regime import moe_model, probe_point, topk_churn


def test_topk_churn_counts_changed_choices_not_their_order():
    before = torch.tensor([[0, 1], [2, 3], [1, 2]])
    after = torch.tensor([[1, 0], [2, 0], [3, 0]])  # same set; one of two changed; both changed
    assert topk_churn(before, after, torch.tensor([True, True, True])) == (0 + 0.5 + 1) / 3
    assert topk_churn(before, after, torch.tensor([True, False, False])) == 0.0


def test_no_update_no_drift_a_large_one_moves_routing_and_weights_come_back(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "dense")
    model = moe_model(tmp_path / "dense", tmp_path / "moe", experts=8, top_k=2, router_std=0.02, noise=0.2)
    ids = torch.randint(1, 40, (4, 12))
    valid = torch.ones(4, 12, dtype=torch.bool)
    valid[3, 9:] = False
    loss = valid.clone()
    loss[:, :5] = False
    with torch.no_grad():
        logits = model(ids).logits
    drift = probe_point(model, ids, loss, valid, [0.0, 1e-1])
    assert drift[0.0] == (0.0, 0.0)                       # the sampling weights route as they did
    assert 0.0 < drift[1e-1][0] <= drift[1e-1][1] <= 1.0   # a large first Adam step moves top-k choices
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, logits, atol=1e-5)  # each lr's step was taken back (to rounding)
