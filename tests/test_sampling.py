"""Sampled decoding is distributed exactly as the target's own sampling: the JOINT law of the first three
generated tokens, plain and speculative, against the exact law by enumeration.

Target: a tiny random Qwen3 (vocabulary 8, 2 layers) whose lm_head is scaled x16, so its next-token
distributions are peaked (after the prompt [3]: 0.50 / 0.48 / 0.01 for its top three tokens at T=0.5,
0.43 / 0.41 / 0.07 at T=1, 0.36 / 0.35 / 0.11 at T=1.5) and temperature, top-k and top-p change them a
lot. The exact law of (t1, t2, t3) is computed in NumPy (float64) from the target's logits for every prefix
(1 + 8 + 64 full forwards) with this file's own temperature / top-k / top-p filter (not the library's), so
a bug in the library's filter is caught too. Each case draws N = 4000 rows in ONE batched call (the same
prompt repeated; ``choose`` draws one categorical over [B, ..., V] with one key, so rows are independent
draws; one draw repeated would fail the statistic), for plain decoding (``generate``) and for speculative
decoding with a random block-4 draft under both acceptance rules (``speculative_generate``, ``match`` and
``rejection``; token 1 comes from the prefill, tokens 2-3 from verify steps, so the acceptance rule, the
residual and the bonus token matter; the first draft is accepted in 27-63%
of rows, asserted > 10%), the rejection rule with adaptive verify cut to 2 tokens (d_1, then the bonus
from p_1 where the full block would draw the residual or d_2). In two of the cases also tree verification
with 6 nodes (every node's target token drawn independently, then the greedy walk) and a random DFlash2
draft (block 4, selector over its top-5 of the 8 tokens, weights drawn large enough that the pairwise
selector terms move its proposals) under both rules: the walk samples from softmax(s / T) over the
candidates, and the rejection rule must use exactly that q, zero off the candidates; and a random DSpark draft
(3 slots, rnn Markov head; its own head unscaled so that its drafts are accepted in 28% of rows) under the
rejection rule: each slot drawn from its Markov-corrected law given the slot before, and q must be that law.

Statistic: Pearson's chi-square over the 512 outcomes, outcomes with expected count < 5 pooled into one
cell (a sequence the target cannot produce at all: infinite); it must stay below the chi-square quantile
at p = 1e-6, so an exact sampler fails by chance with probability 1e-6 per check (the seeds are fixed
anyway). Power, asserted for every case before sampling: the expected statistic of a sampler that ignores
the temperature (for T != 1) is at least 5x the threshold, and of a uniform sampler at least 20x.
Measured: the exact samplers score 0.14-0.6x the threshold (total variation 0.015-0.09). Cost: ~22 s of
CPU time for the file (2 compilations, 8 batched calls); 55-85 s wall on the shared 2-core machine.

Mutations run by hand once each, one at a time (never committed); statistic / threshold of the cases that fail:
  (a) temperature ignored by the target's sampler (``scores = logits``): CAUGHT, plain and speculative:
      175x at T = 0.5, 6.6x at T = 1.5, 21x at T = 1.5 with top-k + top-p (T = 1 cannot see it).
  (b) tokens sampled uniformly (target ignored): CAUGHT in every case, 80x to infinite.
  (c) top-k off by one: keeping k + 1: CAUGHT (infinite: a token outside the top k appears); keeping
      k - 1: CAUGHT, 26x.
  (d) top-p keeping one token too many: CAUGHT, infinite / 158x (both top-p cases); one too few:
      CAUGHT, 240x / 12x (and 1.01x at T = 1.5 without top-p, where it drops the least likely token).
  (e) acceptance of a draft token that differs from the target's choice (``!=`` for ``==``): CAUGHT
      for speculative decoding in every case, 20x to infinite (plain decoding passes, as it must).
  (f) the bonus token taken from the wrong position (p_{a+1} instead of p_a): CAUGHT for speculative
      decoding in every case, 32x to infinite.
  (g) rejection rule accepting with probability p(d) instead of min(1, p(d) / q(d)): CAUGHT, 10x-15x.
  (h) rejection rule resampling from p instead of the residual max(0, p - q): CAUGHT, 4.5x-21x.
  (i) adaptive verify (2 of 4) drawing the bonus from the residual at p_1 instead of p_1 itself: CAUGHT
      at T = 0.5, 2.1x (the only case run).
  (j) DFlash2: the rejection rule's q taken as softmax(s), without the walk's temperature (the draw still
      from softmax(s / T)): CAUGHT at T = 0.5, 6.3x.
  (k) DFlash2: the rejection rule's q taken from the draft logits (the v1 chain's processed
      distribution) instead of the walk's: CAUGHT at T = 0.5, 14.7x.
  (l) DSpark: the rejection rule's q taken from the base logits, before the Markov correction (the draws still from
      the corrected law): CAUGHT, 17x at T = 0.5, 37x at T = 1.5 with top-k + top-p.
  (m) the load policy's plain steps (block 1 on a draft's engine, the mixed-settings test alternates them with block
      4) sampling at temperature 1 instead of the row's: CAUGHT, 675 / 80 at T = 0.5 (8.4x).
  (n) structured outputs: the rejection rule run against the unmasked target (the grammar's mask applied to the
      greedy argmax only): CAUGHT (test_constrained_law_is_the_masked_targets fails). Masking with -20 in place of
      -inf was not caught: with this peaked head it moves the law by less than the test resolves.
  Not a law bug, so not caught here: DSpark drafting from slots 1.. as DFlash does (the anchor slot's prediction
      dropped), with q still the law of what was drawn: any such proposal stays exact; it loses acceptance, which
      tests/test_dspark.py's comparison with DeepSpec's loop catches (every case).
  Not reliably caught: acceptance without the ``cumprod`` (d_2 accepted after d_1 was rejected): only
      the T = 1.5 case fails, at 1.1x. It changes the output only when d_1 is rejected AND the target's
      sample after the rejected d_1 equals d_2, and then only token 3; rare with this random draft.
"""
from __future__ import annotations

import numpy as np
import pytest
import scipy.stats

from dflash_jax import decode as S
from dflash_jax.drafts import model as D
from dflash_jax.target import Target, init_params, target_logits
from dflash_jax.grammar import Grammar
from pairs import Alternate, CharTokenizer, random_draft, random_pair
from test_draft import make_draft
from test_draft_formats import DFLASH2
from test_dspark import make_dspark

V, N, NEW, PROMPT = 8, 4000, 3, [3]
P_FALSE_ALARM = 1e-6


def exact_filter(logits, temperature, top_k, top_p):
    """Next-token distribution [..., V] after temperature, then top-k, then top-p (HF's order), in float64.
    top-p keeps the most likely tokens, in order, until their (renormalised) mass reaches top_p."""
    out = np.zeros(logits.shape, np.float64)
    for idx in np.ndindex(logits.shape[:-1]):
        x = logits[idx].astype(np.float64) / temperature
        p = np.exp(x - x.max())
        p /= p.sum()
        order = sorted(range(len(p)), key=lambda i: -p[i])
        kept = order[:top_k] if top_k else order
        mass = sum(p[i] for i in kept)
        support, acc = [], 0.0
        for i in kept:
            support.append(i)
            acc += p[i] / mass
            if acc >= top_p:
                break
        q = np.zeros_like(p)
        q[support] = p[support]
        out[idx] = q / q.sum()
    return out


def exact_joint(logits, temperature, top_k=0, top_p=1.0):
    """P(t1, t2, t3) [V, V, V] from the target's last-position logits of every prefix."""
    l1, l2, l3 = logits
    f = lambda x: exact_filter(x, temperature, top_k, top_p)  # noqa: E731
    return f(l1)[:, None, None] * f(l2)[:, :, None] * f(l3)


def pooled(want, *laws):
    """The cells of the test: outcomes with expected count N * want >= 5, then one cell pooling the rest."""
    big = want.ravel() * N >= 5
    return [np.append(x.ravel()[big], x.ravel()[~big].sum()) for x in (want, *laws)]


def chi_square(counts, want):
    """Pearson's statistic of N draws against the law ``want`` (pooled cells); returns (statistic, threshold)."""
    p, o = pooled(want, counts.astype(np.float64))
    threshold = float(scipy.stats.chi2.isf(P_FALSE_ALARM, (p > 0).sum() - 1))
    if o[p == 0].sum():  # a token sequence the target cannot produce was sampled
        return float("inf"), threshold
    e = N * p[p > 0]
    return float(((o[p > 0] - e) ** 2 / e).sum()), threshold


def law_report(runs: dict, want) -> list:
    """(name, statistic, threshold, total variation) of each run's N rows of NEW tokens against ``want``, printed."""
    report = []
    for name, results in runs.items():
        toks = np.array([r.generated_ids for r in results])
        assert toks.shape == (N, NEW)
        counts = np.bincount(toks @ np.array([V * V, V, 1]), minlength=V ** 3).reshape(V, V, V)
        stat, threshold = chi_square(counts, want)
        tv = 0.5 * np.abs(counts / N - want).sum()
        report.append((name, stat, threshold, tv))
        print(f"{name}: chi-square {stat:.1f} / threshold {threshold:.1f}, total variation {tv:.3f}")
    return report


def expected_chi_square(q, want):
    """E[statistic] of N draws from the law q tested against ``want``."""
    p, q = pooled(want, q)
    p, q = p[p > 0], q[p > 0]
    return float((N * (q - p) ** 2 / p + q * (1 - q) / p).sum())


@pytest.fixture(scope="module")
def peaked():
    """(target, draft, exact logits per prefix length) for a peaked tiny target and a random block-4 draft."""
    target, draft = random_pair(vocab=V, block_size=4, seed=0, layers=2, target_layer_ids=(0, 1), draft_layers=1)
    params = dict(target.params, lm_head={"kernel": target.params["lm_head"]["kernel"] * 16})
    target = Target(target.config, params)
    l1 = target_logits(target, np.array([PROMPT]))[0, -1]
    l2 = target_logits(target, np.array([PROMPT + [a] for a in range(V)]))[:, -1]
    l3 = target_logits(target, np.array([PROMPT + [a, b] for a in range(V) for b in range(V)]))[:, -1]
    dflash2 = make_draft(target.config, layers=1, block=4, ids=(0, 1), seed=3, dflash2_scale=0.6, **DFLASH2)
    dspark = make_dspark(target, seed=4, head="rnn", rank=4, block=3)  # 3 slots propose 3: 4 verified
    # its own head unscaled (the target's x16 made its random drafts as peaked as the target, rarely accepted)
    dspark = D.Draft(dspark.config, dict(dspark.params, lm_head={"kernel": dspark.params["lm_head"]["kernel"] / 16}))
    return target, (draft, dflash2, dspark), (l1, l2, l3.reshape(V, V, V))


CASES = [  # (temperature, top_k, top_p)
    (0.5, 0, 1.0),
    pytest.param(1.5, 0, 1.0, marks=pytest.mark.slow),  # temperature alone: (0.5, 0, 1.0) holds it in the fast suite
    (1.5, 3, 0.8),
    (1.0, 0, 0.9),
]
DFLASH2_CASES = CASES[0::2]  # the tree's and the DFlash2 draft's runs (two cases keep the file's time down)


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_joint_law_of_first_three_tokens_is_the_targets(peaked, temperature, top_k, top_p):
    target, (draft, dflash2, dspark), logits = peaked
    want = exact_joint(logits, temperature, top_k, top_p)
    # The top-p cut is not a near-tie anywhere (fp32 vs float64 could not flip it).
    for lg in logits:
        for row in lg.reshape(-1, V):
            p = exact_filter(row[None], temperature, top_k, 1.0)[0]
            cum = np.cumsum(np.sort(p)[::-1])
            assert top_p == 1.0 or np.abs(cum - top_p).min() > 1e-4
    # Power: what a wrong sampler would score, in expectation.
    _, threshold = chi_square(np.zeros_like(want), want)
    if temperature != 1.0:
        assert expected_chi_square(exact_joint(logits, 1.0, top_k, top_p), want) > 5 * threshold
    assert expected_chi_square(np.full_like(want, V ** -3.0), want) > 20 * threshold

    kw = dict(max_new_tokens=NEW, temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=[])
    runs = {"plain": S.generate(target, [PROMPT] * N, seed=1, **kw),
            "speculative, match rule": S.speculative_generate(target, draft, [PROMPT] * N, block_size=4, seed=2,
                                                              acceptance="match", **kw),
            "speculative, rejection rule": S.speculative_generate(target, draft, [PROMPT] * N, block_size=4, seed=3,
                                                                  acceptance="rejection", **kw),
            # adaptive verify cut to 2 of the 4 block tokens: d_1 verified, the bonus from the target's p_1
            "speculative, rejection rule, verify 2 of 4": S.speculative_generate(
                target, draft, [PROMPT] * N, block_size=4, seed=4, acceptance="rejection", verify_lengths=(2, 4),
                verify_threshold=2.0, **kw)}
    if (temperature, top_k, top_p) in DFLASH2_CASES:
        # tree verification: 6 nodes (siblings at depth 1), the target sampled at every node, then the walk
        runs["tree of 6"] = S.speculative_generate(target, draft, [PROMPT] * N, block_size=4, seed=7, tree_budget=6,
                                                   **kw)
        # DFlash2: the selector walk samples over its top-5 candidates
        runs["DFlash2, match rule"] = S.speculative_generate(target, dflash2, [PROMPT] * N, seed=5,
                                                             acceptance="match", **kw)
        runs["DFlash2, rejection rule"] = S.speculative_generate(target, dflash2, [PROMPT] * N, seed=6,
                                                                 acceptance="rejection", **kw)
        # DSpark: the Markov walk samples each slot given the drafted previous token; q is that corrected law
        runs["DSpark, rejection rule"] = S.speculative_generate(target, dspark, [PROMPT] * N, seed=8,
                                                                acceptance="rejection", **kw)
        # DSpark's tree: from its Markov-corrected greedy walk, fixed before the target's draws
        runs["DSpark, tree of 6"] = S.speculative_generate(target, dspark, [PROMPT] * N, seed=10, tree_budget=6, **kw)
    assert {v for r in runs["speculative, rejection rule, verify 2 of 4"] for v in r.verify_lengths} == {2}
    rates = {k: np.mean([r.acceptance_lengths[0] > 1 for r in runs[k]]) for k in runs if k != "plain"}
    accepted = min(rates.values())
    print(f"T={temperature} top_k={top_k} top_p={top_p}: first drafts accepted in >= {accepted:.0%} of rows",
          {k: f"{v:.0%}" for k, v in rates.items()})
    report = law_report(runs, want)
    assert all(stat < threshold for _, stat, threshold, _ in report), report
    assert accepted > 0.1  # drafts were accepted often, not just bonus tokens


def test_mixed_settings_in_one_batch_keep_each_rows_law(peaked):
    """Continuous batching: rows of two sampling settings and greedy rows, interleaved in one batch of slots (the
    rejection rule): each setting's rows follow the exact law of that setting, and the greedy rows equal greedy
    decoding. Per-row temperature / top-k / top-p must not leak between rows (a batch-wide setting fails one
    group's statistic: the two laws differ far beyond the threshold, checked below). The block changes between
    the engine's runs (a block policy alternating plain steps and block 4, as the load-following policy may): a
    row's plain step samples from the target, its block-4 step by the rejection rule, and the law holds."""
    target, (draft, _, _), logits = peaked
    a, b = CASES[0], CASES[2]
    want = {case: exact_joint(logits, *case) for case in (a, b)}
    for x, y in ((a, b), (b, a)):  # power: rows of one setting drawn with the other's would fail its statistic
        assert expected_chi_square(want[y], want[x]) > 20 * chi_square(np.zeros_like(want[x]), want[x])[1]
    cases = [a, b] * N + [None] * 8  # greedy rows at the end: admitted as sampled rows finish
    requests = [S.Request(PROMPT, stream=i, **({} if c is None else dict(zip(("temperature", "top_k", "top_p"), c))))
                for i, c in enumerate(cases)]
    policy = Alternate()
    out = S.continuous_generate(target, draft, requests, max_batch=N, max_new_tokens=NEW, block_size=4, seed=11,
                                stop_token_ids=[], block_policy=policy, warm=False)
    assert policy.calls > 2 and any(set(r.verify_lengths) == {1, 4} for r in out)  # switched inside rows
    greedy = S.generate(target, [PROMPT], max_new_tokens=NEW, stop_token_ids=[])[0]
    assert all(r.output_ids == greedy.output_ids for r, c in zip(out, cases) if c is None)
    for case in (a, b):
        toks = np.array([r.generated_ids for r, c in zip(out, cases) if c == case])
        assert toks.shape == (N, NEW)
        counts = np.bincount(toks @ np.array([V * V, V, 1]), minlength=V ** 3).reshape(V, V, V)
        stat, thr = chi_square(counts, want[case])
        print(f"mixed batch, T={case[0]} top_k={case[1]} top_p={case[2]}: chi-square {stat:.1f} / threshold {thr:.1f}")
        assert stat < thr


def test_tree_verification_on_a_hybrid_target_keeps_the_joint_law():
    """Tree verification (6 nodes) on a Qwen3.5 hybrid (Gated DeltaNet + attention, vocabulary 8, lm_head x16, the
    linear attention's projections scaled up so that its state moves the law): every node's conv window and
    recurrent state come from its own path, so the tokens drawn at every node follow the target's law given that
    path; the walk then keeps the joint law of the first three tokens (T = 0.5). Measured 7.4 / 35.9. A sibling's
    input leaking into a node's conv window (the chain's conv over the slots), injected by hand: 1433 / 35.9."""
    from dflash_jax.families.qwen3_5 import Qwen35Config

    cfg = Qwen35Config.from_hf(dict(model_type="qwen3_5_text", vocab_size=V, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                    max_position_embeddings=256, eos_token_id=1, initializer_range=0.1,
                                    tie_word_embeddings=False))
    params = init_params(cfg, 0)
    gdn = params["layers_0"]["linear_attn"]  # louder linear attention: its path state moves the law
    gdn = dict(gdn, out_proj={"kernel": gdn["out_proj"]["kernel"] * 8},
               in_proj_qkv={"kernel": gdn["in_proj_qkv"]["kernel"] * 4})
    target = Target(cfg, dict(params, layers_0=dict(params["layers_0"], linear_attn=gdn),
                              lm_head={"kernel": params["lm_head"]["kernel"] * 16}))
    draft = random_draft(cfg, block_size=4, seed=1, draft_layers=1, target_layer_ids=(0, 1))
    l1 = target_logits(target, np.array([PROMPT]))[0, -1]
    l2 = target_logits(target, np.array([PROMPT + [a] for a in range(V)]))[:, -1]
    l3 = target_logits(target, np.array([PROMPT + [a, b] for a in range(V) for b in range(V)]))[:, -1]
    want = exact_joint((l1, l2, l3.reshape(V, V, V)), 0.5)
    _, threshold = chi_square(np.zeros_like(want), want)
    assert expected_chi_square(exact_joint((l1, l2, l3.reshape(V, V, V)), 1.0), want) > 5 * threshold  # power
    out = S.speculative_generate(target, draft, [PROMPT] * N, block_size=4, seed=9, tree_budget=6, max_new_tokens=NEW,
                                 temperature=0.5, stop_token_ids=[])
    toks = np.array([r.generated_ids for r in out])
    counts = np.bincount(toks @ np.array([V * V, V, 1]), minlength=V ** 3).reshape(V, V, V)
    stat, threshold = chi_square(counts, want)
    accepted = np.mean([r.acceptance_lengths[0] > 1 for r in out])
    print(f"hybrid tree of 6: chi-square {stat:.1f} / threshold {threshold:.1f}; a draft accepted in {accepted:.0%}")
    assert stat < threshold and accepted > 0.1


# Structured outputs (issue 55): the 8 ids read as characters a-g and an end-of-sequence id 7; the regex allows 5, 5
# and 4 of them at positions 1, 2 and 3.
CONSTRAINED, ALLOWED = r"[a-e][c-g][a-cf]", ([0, 1, 2, 3, 4], [2, 3, 4, 5, 6], [0, 1, 2, 5])


def test_constrained_law_is_the_masked_targets(peaked):
    """The joint law of (t1, t2, t3) under a grammar, at T = 0.8: plain constrained decoding and speculative decoding
    with the rejection rule (block 4; the draft's q as drawn, unmasked: a forbidden proposal has p' = 0 and is always
    rejected) against the exact law of the masked, renormalised target, p'(t) = p(t) 1[t allowed] / sum over the
    allowed. Power, asserted before sampling: masks shifted by one position score > 5x the threshold in expectation
    (a sampler that ignored the grammar draws a forbidden sequence: infinite). 4000 requests through an engine of
    1000 rows, each with its own key stream."""
    from dflash_jax.decode import Request, continuous_generate

    target, (draft, _, _), logits = peaked
    temperature = 0.8

    def law(allowed):
        laws = []
        for x, keep in zip(logits, allowed):
            p = exact_filter(x, temperature, 0, 1.0) * np.isin(np.arange(V), keep)
            laws.append(p / p.sum(axis=-1, keepdims=True))
        return laws[0][:, None, None] * laws[1][:, :, None] * laws[2]

    want = law(ALLOWED)
    _, threshold = chi_square(np.zeros_like(want), want)
    shifted = law((ALLOWED[1], ALLOWED[2], ALLOWED[0]))
    assert expected_chi_square(shifted, want) > 5 * threshold
    requests = [Request(PROMPT, max_new_tokens=NEW, temperature=temperature, seed=1, stream=i,
                        grammar=Grammar.regex(CONSTRAINED), stop_token_ids=[]) for i in range(N)]
    kw = dict(max_batch=1000, tokenizer=CharTokenizer("abcdefg", V, 7), warm=False)
    runs = {"plain, constrained": continuous_generate(target, None, requests, **kw),
            "speculative, rejection rule, constrained": continuous_generate(target, draft, requests, block_size=4,
                                                                            **kw)}
    accepted = np.mean([r.acceptance_lengths[0] > 1 for r in runs["speculative, rejection rule, constrained"]])
    print(f"constrained: first drafts accepted in {accepted:.0%} of rows")
    report = law_report(runs, want)
    assert all(stat < threshold for _, stat, threshold, _ in report), report
    assert accepted > 0.1
