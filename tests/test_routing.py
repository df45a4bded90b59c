"""The biased sigmoid group-limited router (dflash_jax/routing.py) against transformers' own routers
(``DeepseekV3TopkRouter``, ``MiMoV2FlashTopkRouter``) on random inputs."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config, MiMoV2FlashConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashTopkRouter

from dflash_jax.routing import SigmoidRouter, check_grouped_routing, sigmoid_topk
from tolerances import assert_close, f32_rel

T, D = 64, 24
# (experts, k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
CASES = [(16, 4, 4, 2, True, 2.5), (16, 3, 8, 3, False, 1.0), (12, 4, 1, 1, True, 1.0), (32, 6, 4, 1, True, 0.5)]


def _hf_router(cls, experts, k, n_group, topk_group, norm, scale, seed):
    config_cls = DeepseekV3Config if cls is DeepseekV3TopkRouter else MiMoV2FlashConfig
    cfg = config_cls(hidden_size=D, n_routed_experts=experts, num_experts_per_tok=k, n_group=n_group,
                     topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale)
    router = cls(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, D, generator=g))
        router.e_score_correction_bias.copy_(torch.rand(experts, generator=g) * 0.5)  # reorders the choice
    return router


def _sorted(index, weight):
    """(index, weight) rows sorted by expert id: transformers' top-k is unsorted, the set is what counts."""
    order = np.argsort(index, axis=1)
    return np.take_along_axis(index, order, 1), np.take_along_axis(weight, order, 1)


@pytest.mark.parametrize("cls", [DeepseekV3TopkRouter, MiMoV2FlashTopkRouter], ids=["deepseek_v3", "mimo_v2_flash"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"e{c[0]}-k{c[1]}-g{c[2]}-tg{c[3]}-n{int(c[4])}")
def test_router_matches_transformers(cls, case):
    """Chosen experts (as sets) and their weights equal transformers' router's for 64 random tokens (x [T, D]
    float32), through ``SigmoidRouter`` with the torch weights (the logits) and ``sigmoid_topk`` itself; the
    bias and the group limit both change the choice here, so neither can be skipped unnoticed."""
    experts, k, n_group, topk_group, norm, scale = case
    router = _hf_router(cls, *case, seed=experts + k)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(k))
    with torch.no_grad():
        logits, hf_weight, hf_index = router(x)
    want_index, want_weight = _sorted(hf_index.numpy(), hf_weight.numpy())
    params = {"params": {"kernel": jnp.asarray(router.weight.detach().numpy().T),
                         "e_score_correction_bias": jnp.asarray(router.e_score_correction_bias.numpy())}}
    module = SigmoidRouter(experts, k, n_group, topk_group, norm, scale)
    index, weight = module.apply(params, jnp.asarray(x.numpy()))
    assert weight.dtype == jnp.float32 and index.shape == (T, k)
    got_index, got_weight = _sorted(np.asarray(index), np.asarray(weight))
    np.testing.assert_array_equal(got_index, want_index)
    # JAX against torch: the D-wide logit reduction, the sigmoid, the k-term normalisation and the scale
    assert_close(got_weight, want_weight, D + k + 2, what="weights")
    if norm:  # k normalised weights (each rounded twice) summed: (2k + 1) roundings of eps / 2, x2
        np.testing.assert_allclose(got_weight.sum(1), scale, rtol=f32_rel(2 * k + 1))
    bias = jnp.asarray(router.e_score_correction_bias.numpy())
    kw = dict(k=k, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale)
    plain_index = _sorted(np.asarray(sigmoid_topk(jnp.asarray(logits.numpy()), bias, **kw)[0]), want_weight)[0]
    np.testing.assert_array_equal(plain_index, want_index)
    unbiased = _sorted(np.asarray(sigmoid_topk(jnp.asarray(logits.numpy()), bias * 0, **kw)[0]), want_weight)[0]
    assert (unbiased != want_index).any()  # the bias decides some choices
    if topk_group < n_group:
        ungrouped = sigmoid_topk(jnp.asarray(logits.numpy()), bias, **{**kw, "n_group": 1, "topk_group": 1})[0]
        assert (_sorted(np.asarray(ungrouped), want_weight)[0] != want_index).any()  # so does the group limit


def test_grouped_routing_checks():
    check_grouped_routing(256, 8, 8, 4)  # DeepSeek-V3's
    check_grouped_routing(256, 8, 1, 1)  # MiMo-V2-Flash's
    for args, match in (((16, 4, 3, 1), "divide"), ((8, 2, 8, 2), ">= 2 experts"), ((16, 4, 4, 5), "topk_group"),
                        ((16, 9, 4, 2), "num_experts_per_tok")):
        with pytest.raises(ValueError, match=match):
            check_grouped_routing(*args)
