"""Released targets and their DFlash drafts by name, as configs only (``python -m infer.plan --target NAME``): the
fields of each target's ``config.json`` the family reads, and its released draft's shape (layers, block, target layer
ids, mask id, widths). Where a field's value was not read from the released file itself, ``source`` says so. A target
can also be a config.json, a checkpoint directory or a hub id whose config is in the local cache (``resolve``)."""
from __future__ import annotations

import dataclasses

from dflash_jax.drafts.config import choose_target_layer_ids
from dflash_jax.synthetic import PRESETS as SYNTHETIC

_QWEN35_LAYERS = (["linear_attention"] * 3 + ["full_attention"]) * 16


@dataclasses.dataclass(frozen=True)
class Released:
    """A target's config.json (``hf``) and its draft: ``draft_layers`` / ``block_size`` / ``target_layer_ids`` /
    ``mask_token_id`` and ``draft_fields`` (config.json fields of the draft that differ from a new draft of the
    target's widths)."""

    hf: dict
    draft_layers: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    source: str
    draft_fields: dict = dataclasses.field(default_factory=dict)


# deepseek-ai/DeepSeek-V3's config.json (the fields the deepseek_v3 family reads); no draft released: a 5-layer one
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}

RELEASED: dict[str, Released] = {
    "qwen3-coder-30b-a3b": Released(
        {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5472,
         "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
         "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 10000000,
         "max_position_embeddings": 262144, "tie_word_embeddings": False, "eos_token_id": 151645,
         "bos_token_id": 151643},
        8, 16, (1, 12, 23, 34, 45), 151669,
        "Qwen/Qwen3-Coder-30B-A3B-Instruct config.json; draft z-lab/Qwen3-Coder-30B-A3B-DFlash (8 layers, block 16, "
        "FFN 6144, from its model card's table; mask id as the Qwen3 drafts')", {"intermediate_size": 6144}),
    "gpt-oss-120b": Released(
        {"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
         "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
         "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
         "layer_types": ["sliding_attention", "full_attention"] * 18, "attention_bias": True, "rms_norm_eps": 1e-5,
         "rope_theta": 150000, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
         "max_position_embeddings": 131072, "swiglu_limit": 7.0, "tie_word_embeddings": False,
         "eos_token_id": 200002, "pad_token_id": 199999},
        8, 10, (1, 9, 17, 25, 33), 200000,
        "openai/gpt-oss-120b's shape (36 layers, 128 experts; other fields as gpt-oss-20b's config.json); draft "
        "z-lab/gpt-oss-120b-DFlash (8 layers, block 10, FFN 7680, from its model card's table; mask id as the 20b "
        "draft's); experts in bf16 here (MXFP4 kept as stored is issue #76)", {"intermediate_size": 7680}),
    "qwen3.5-27b": Released(
        {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
         "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
         "layer_types": _QWEN35_LAYERS, "full_attention_interval": 4, "attn_output_gate": True,
         "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
         "linear_num_value_heads": 48, "linear_value_head_dim": 128, "rms_norm_eps": 1e-6,
         "partial_rotary_factor": 0.25, "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000000,
                                                            "rope_type": "default"},
         "max_position_embeddings": 262144, "tie_word_embeddings": False, "eos_token_id": 248044,
         "bos_token_id": 248044},
        6, 16, (1, 10, 18, 27, 35, 44, 52, 61), 248077,
        "Qwen/Qwen3.5-27B's text config (sizes as Qwen/Qwen3.6-27B's config.json, the same architecture); draft "
        "z-lab/Qwen3.5-27B-DFlash (6 layers: 5 sliding of 4096 + 1 full, 32 / 8 heads of 128)",
        {"layer_types": ["sliding_attention"] * 5 + ["full_attention"], "sliding_window": 4096,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}),
    "gemma-4-31b": Released(
        {"model_type": "gemma4_text", "attention_bias": False, "attention_k_eq_v": True, "bos_token_id": 2,
         "enable_moe_block": False, "eos_token_id": 1, "final_logit_softcapping": 30.0, "global_head_dim": 512,
         "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 5376,
         "hidden_size_per_layer_input": 0, "intermediate_size": 21504,
         "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10, "max_position_embeddings": 262144,
         "num_attention_heads": 32, "num_global_key_value_heads": 4, "num_hidden_layers": 60,
         "num_key_value_heads": 16, "num_kv_shared_layers": 0, "pad_token_id": 0, "rms_norm_eps": 1e-06,
         "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                                "rope_type": "proportional"},
                             "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
         "sliding_window": 1024, "tie_word_embeddings": True, "use_double_wide_mlp": False, "vocab_size": 262144,
         "vocab_size_per_layer_input": 262144},
        5, 16, (1, 12, 23, 35, 46, 57), 4,
        "google/gemma-4-31B-it's text config (tests/test_gemma4.py RELEASED); draft z-lab/gemma-4-31B-it-DFlash "
        "(5 layers: 4 sliding of 2048 + 1 full, FFN 10752, 64 / 8 heads of 128, softcap 30)",
        {"layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 2048,
         "intermediate_size": 10752, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128}),
    "deepseek-v3": Released(DEEPSEEK_V3, 5, 16, choose_target_layer_ids(61, 5), 129279,
                            "deepseek-ai/DeepSeek-V3 config.json (bf16 here: FP8 kept as stored is issue #76); no "
                            "draft released: a new 5-layer DFlash draft of its widths, with heads as Kimi-K2.5's "
                            "released draft (64 / 8 heads of 128)",
                            {"num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128}),
    "kimi-k2.5": Released(
        {**DEEPSEEK_V3, "vocab_size": 163840, "num_attention_heads": 64, "num_key_value_heads": 64,
         "n_routed_experts": 384, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
         "routed_scaling_factor": 2.827, "max_position_embeddings": 262144, "rope_theta": 50000.0,
         "rope_scaling": {"type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
         "bos_token_id": 163584, "eos_token_id": 163585},
        6, 8, (1, 12, 24, 35, 47, 58), 163838,
        "moonshotai/Kimi-K2.5's text config (sizes from its config; routed scaling and rope betas assumed as "
        "Kimi-K2's); draft z-lab/Kimi-K2.5-DFlash (6 layers, block 8, 64 / 8 heads)",
        {"num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128}),
}


def names() -> list[str]:
    return sorted(set(SYNTHETIC) | set(RELEASED))


def _draft(tcfg, r: Released, block_size: int | None):
    from dflash_jax.drafts.config import DraftConfig

    base = DraftConfig.for_target(tcfg, draft_layers=r.draft_layers, block_size=block_size or r.block_size,
                                  mask_token_id=r.mask_token_id, target_layer_ids=r.target_layer_ids)
    return DraftConfig.from_hf({**base.to_hf(), **r.draft_fields}) if r.draft_fields else base


def resolve(target: str, draft: str | None, scan_layers: bool = False):
    """(target config, draft config or None, where they come from). ``target``: a preset name, a config.json, a
    checkpoint directory or a cached hub id; ``draft``: None (plain), "auto" (the preset's released draft, or a new
    5-layer draft of the target's widths) or a draft's config.json / directory / hub id."""
    from dflash_jax.config import read_config_json
    from dflash_jax.checkpoints import resolve_path
    from dflash_jax.drafts.config import DraftConfig
    from dflash_jax.families import config_from_hf

    key = target.lower()
    if key in SYNTHETIC:
        p = SYNTHETIC[key]
        tcfg, source = p.target, p.source
        released = Released({}, p.draft_layers, p.block_size, p.target_layer_ids, p.mask_token_id, p.source)
    elif key in RELEASED:
        released = RELEASED[key]
        tcfg, source = config_from_hf(released.hf), released.source
    else:
        path = target if target.endswith(".json") else resolve_path(target)
        hf = read_config_json(path)
        tcfg, source = config_from_hf(hf), f"config of {target}"
        n = tcfg.num_hidden_layers
        released = Released(hf, 5, 16, choose_target_layer_ids(n, min(5, n)), tcfg.vocab_size - 1,
                            f"config of {target}; a new 5-layer DFlash draft of its widths")
    tcfg = dataclasses.replace(tcfg, scan_layers=scan_layers)
    if draft is None:
        return tcfg, None, source
    if draft == "auto":
        return tcfg, _draft(tcfg, released, None), source
    path = draft if draft.endswith(".json") else resolve_path(draft)
    return tcfg, DraftConfig.from_hf(read_config_json(path)), source
