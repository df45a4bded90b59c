"""Tiny random Hugging Face models saved with save_pretrained (no network), shared by the tests."""
from __future__ import annotations

import torch
import transformers

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6)
# model_type -> (config class, causal LM class); MoE configs take their expert sizes as overrides.
CLASSES = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
           "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM)}


def hf_config(model_type: str = "qwen3", **overrides):
    kw = {**TINY, **overrides}
    return CLASSES[model_type][0](**kw)


def save_tiny(path, model_type: str = "qwen3", seed: int = 0, dtype=torch.float32, **overrides):
    """Build a random tiny causal LM, save it to ``path``; returns the torch model (eval, fp32)."""
    cfg = hf_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = CLASSES[model_type][1](cfg).eval()
    with torch.no_grad():  # norms start at 1, gpt-oss's biases at 0 and its sinks near 0: perturb them so a
        for name, p in model.named_parameters():  # mis-mapped one is caught
            if "norm" in name or (model_type == "gpt_oss" and (name.endswith("bias") or "sinks" in name)):
                p.add_((1.0 if "sinks" in name else 0.1) * torch.randn_like(p))
    model.to(dtype).save_pretrained(path)
    return model.float()


def torch_forward(model, ids, layer_ids=()):
    """(logits [B,T,V], concatenated hidden_states[id+1]) as numpy, fp32."""
    with torch.no_grad():
        out = model(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1).numpy() if layer_ids else None
    return out.logits.float().numpy(), feats
