"""Tiny random Hugging Face models saved with save_pretrained (no network), shared by the tests."""
from __future__ import annotations

import numpy as np
import torch
import transformers
from tolerances import assert_close, forward_depth

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6)
# model_type -> (config class, causal LM class); MoE configs take their expert sizes as overrides.
CLASSES = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
           "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
           "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
           "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
           "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
           "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)}


def hf_config(model_type: str = "qwen3", **overrides):
    kw = {**TINY, **overrides}
    return CLASSES[model_type][0](**kw)


def save_tiny(path, model_type: str = "qwen3", seed: int = 0, dtype=torch.float32, **overrides):
    """Build a random tiny causal LM, save it to ``path``; returns the torch model (eval, fp32)."""
    cfg = hf_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = CLASSES[model_type][1](cfg).eval()
    with torch.no_grad():  # norms start at 1 (or 0), biases at 0, sinks near 0: perturb them so a
        for name, p in model.named_parameters():  # mis-mapped one is caught
            if ("norm" in name or name.endswith("dt_bias")
                    or (model_type == "gpt_oss" and (name.endswith("bias") or "sinks" in name))):
                p.add_((1.0 if "sinks" in name else 0.1) * torch.randn_like(p))
    buffers = {name: b.clone() for name, b in model.named_buffers()}  # RoPE's inv_freq: computed, not stored
    model.to(dtype).save_pretrained(path)
    model.float()
    with torch.no_grad():  # the loaded model computes them in float32: so does the reference (not bf16-rounded)
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    return model


def perturb(model, params: dict[str, float], buffers: dict[str, tuple[float, float]] | None = None):
    """In place: add scale * N(0, 1) to each parameter whose name contains a key of ``params`` (its scale), and draw
    each buffer whose name ends with a key of ``buffers`` uniformly in its (low, high): norms start at 1, sinks
    and biases at 0, so that a mis-mapped one would not show. Returns the model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = next((v for k, v in params.items() if k in name), None)
            if scale is not None:
                p.add_(scale * torch.randn_like(p))
        for name, b in model.named_buffers():
            span = next((v for k, v in (buffers or {}).items() if name.endswith(k)), None)
            if span is not None:
                b.uniform_(*span)
    return model


def torch_forward(model, ids, layer_ids=()):
    """(logits [B,T,V], concatenated hidden_states[id+1]) as numpy, fp32."""
    with torch.no_grad():
        out = model(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1).numpy() if layer_ids else None
    return out.logits.float().numpy(), feats


# text model_type -> (config class, class) of the vision-language model around it
VISION_LANGUAGE = {"qwen3_5_text": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
                   "qwen3_5_moe_text": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration)}


def save_vision_language(path, text_model, seed: int = 0, dtype=torch.float32):
    """A Qwen3_5ForConditionalGeneration (or Qwen3_5MoeForConditionalGeneration) checkpoint (tiny random
    vision tower) whose language model is ``text_model`` (a Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM):
    the released Qwen3.5 / 3.6 layout. Returns the VL model."""
    text = text_model.config.to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2, temporal_patch_size=1,
                  spatial_merge_size=1, out_hidden_size=text["hidden_size"], num_position_embeddings=16)
    config_class, model_class = VISION_LANGUAGE[text["model_type"]]
    cfg = config_class(text_config=text, vision_config=vision, tie_word_embeddings=text_model.config.tie_word_embeddings)
    torch.manual_seed(seed)
    model = model_class(cfg).eval()
    own = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
           for k, v in text_model.state_dict().items()}
    missing, unexpected = model.load_state_dict(own, strict=False)
    assert not unexpected and all(k.startswith("model.visual.") for k in missing), (missing, unexpected)
    model.to(dtype).save_pretrained(path)
    return model.float()


def ragged_parity(model, target, lengths, seed: int = 1):
    """One forward of ``target`` over a ragged batch (row r: ``lengths[r]`` random tokens, padded with
    position -1) against the torch ``model`` on each prompt alone: logits and every hidden_states[i]
    within float32 rounding of a forward that deep (``forward_depth`` ulps of each one's scale), the embedding
    output (feature id -1) included. Returns the
    largest feature magnitude (to show the comparison is not of near-zeros)."""
    from dflash_jax.target import forward

    c = target.config
    layers, d = tuple(range(-1, c.num_hidden_layers)), c.hidden_size
    ids = np.random.RandomState(seed).randint(0, c.vocab_size, (len(lengths), max(lengths))).astype(np.int32)
    logits, feats, _ = forward(c, target.params, ids, positions_for(ids, lengths), feature_layer_ids=layers)
    logits, feats = np.asarray(logits), np.asarray(feats)
    depth = forward_depth(c, max(lengths))
    for r, n in enumerate(lengths):
        ref_logits, ref_feats = torch_forward(model, ids[r:r + 1, :n], layers)
        assert_close(logits[r, :n], ref_logits[0], depth, what=f"logits row {r}")
        for j, i in enumerate(layers):
            assert_close(feats[r, :n, j * d:(j + 1) * d], ref_feats[0, :, j * d:(j + 1) * d], depth,
                         what=f"row {r} layer {i}")
    return float(np.abs(feats).max())


def vision_language_loads(path: str, text_model, capfd):
    """The released Qwen3.5 / 3.6 layout (``save_vision_language``: text under model.language_model., a
    vision tower) plus an mtp.* tensor: loads the language model alone, says what it skipped, and its
    logits equal the VL model's on text (transformers' text positions there come from get_rope_index:
    the three mrope streams); our own VL export (``save_target``) reloads to the same. Returns the Target."""
    import json
    import os

    import dflash_jax as dj
    from dflash_jax.checkpoints import iter_safetensors, save_safetensors
    from dflash_jax.target import save_target

    vl = save_vision_language(path, text_model)
    tensors = dict(iter_safetensors(os.path.join(path, "model.safetensors")))
    assert any(n.startswith("model.visual.") for n in tensors)
    d = text_model.config.hidden_size
    tensors["mtp.fc.weight"] = np.zeros((d, 2 * d), np.float32)
    save_safetensors(os.path.join(path, "model.safetensors"), {k: np.array(v) for k, v in tensors.items()})
    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    assert model_type == text_model.config.model_type.removesuffix("_text")
    target = dj.load_target(path)
    err = capfd.readouterr().err
    assert "vision tower" in err and "1 multi-token prediction" in err
    assert target.config.vision_language and target.config.model_type == model_type
    ids = np.random.RandomState(4).randint(0, text_model.config.vocab_size, (1, 20)).astype(np.int32)
    with torch.no_grad():
        want = vl(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    depth = forward_depth(target.config, ids.shape[1])  # JAX against torch: a forward's rounding each
    assert_close(dj.target_logits(target, ids), want, depth, what="VL logits")
    again = dj.load_target(save_target(target, os.path.join(path, "again")))
    assert again.config == target.config
    assert_close(dj.target_logits(again, ids), want, depth, what="re-exported VL logits")
    return target


def broken_checkpoint(src: str, dest, name: str, edit=None, extra=None) -> str:
    """A copy of the checkpoint in ``src`` (config.json + one model.safetensors) at ``dest`` with tensor ``name``
    dropped (``edit`` None) or replaced by ``edit(array)``, plus the ``extra`` tensors; returns ``dest``."""
    import os
    import shutil

    from dflash_jax.checkpoints import iter_safetensors, save_safetensors

    tensors = {k: np.asarray(v) for k, v in iter_safetensors(os.path.join(src, "model.safetensors"))}
    if edit is None:
        tensors.pop(name)
    else:
        tensors[name] = edit(tensors[name])
    os.makedirs(dest)
    save_safetensors(os.path.join(dest, "model.safetensors"), {**tensors, **(extra or {})})
    shutil.copy(os.path.join(src, "config.json"), dest)
    return str(dest)


def fp8_quantise(w, block):
    """w [R, C] float32 -> (float8_e4m3fn [R, C], float32 scales [ceil(R / br), ceil(C / bc)]): amax / 448 per block."""
    import ml_dtypes

    (r, c), (br, bc) = w.shape, block
    scale = np.zeros((-(-r // br), -(-c // bc)), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i, j in np.ndindex(*scale.shape):
        tile = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
        scale[i, j] = max(float(np.abs(tile).max()), 1e-12) / 448.0
        q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (tile / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def fp8_copies(src: str, root, block, pattern: str = r"_proj\.weight$"):
    """Two copies of the checkpoint in ``src`` under ``root``: ``fp8/`` as the FP8 releases are laid out (every
    tensor matching ``pattern`` float8_e4m3fn plus its ``_scale_inv`` block scales, quantization_config fp8
    e4m3 with ``block``) and ``dequantised/`` (those weights x their block's scale, unquantised: what loading
    the FP8 copy must give). -> (fp8 dir, dequantised dir, names quantised)."""
    import json
    import os
    import re
    import shutil

    from dflash_jax.checkpoints import iter_safetensors, save_safetensors

    (br, bc), quantised, dequantised = block, {}, {}
    for name, w in iter_safetensors(os.path.join(src, "model.safetensors")):
        w = np.asarray(w)
        quantised[name] = dequantised[name] = w
        if re.search(pattern, name):
            q, s = fp8_quantise(w, block)
            quantised[name], quantised[name + "_scale_inv"] = q, s
            dequantised[name] = q.astype(np.float32) * np.repeat(np.repeat(s, br, 0)[:w.shape[0]], bc, 1)[:, :w.shape[1]]
    dirs = [os.path.join(root, "fp8"), os.path.join(root, "dequantised")]
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    for d, tensors in zip(dirs, (quantised, dequantised)):
        os.makedirs(d)
        save_safetensors(os.path.join(d, "model.safetensors"), tensors)
        shutil.copy(os.path.join(src, "config.json"), d)
    with open(os.path.join(dirs[0], "config.json"), "w") as f:
        json.dump({**config, "quantization_config": q}, f)
    return dirs[0], dirs[1], [n for n in quantised if n.endswith("_scale_inv")]


def broken_tensors_are_named(src: str, root, cases) -> None:
    """For each (tensor name, edit) of ``cases``: the checkpoint in ``src`` without that tensor (edit None) or with
    ``edit(tensor)`` in its place (``broken_checkpoint`` under ``root``) fails to load with a ValueError naming
    the tensor (and its shape and the config's, for an edit)."""
    import os

    import pytest

    import dflash_jax as dj

    for name, edit in cases:
        d = broken_checkpoint(src, os.path.join(root, name), name, edit)
        shape = ""
        if edit is not None:
            from dflash_jax.checkpoints import iter_safetensors

            shape = ", ".join(map(str, dict(iter_safetensors(os.path.join(d, "model.safetensors")))[name].shape))
        match = rf"lacks 1 tensors.*{name}" if edit is None else rf"{name} has shape \[{shape}\] but the config implies"
        with pytest.raises(ValueError, match=match):
            dj.load_target(d)


def positions_for(ids, lengths=None):
    """Positions 0..T-1 per row; past ``lengths`` (ragged rows): -1, padding."""
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    return pos if lengths is None else np.where(pos < np.asarray(lengths)[:, None], pos, -1).astype(np.int32)


def torch_greedy(model, prompt, new: int, stop=None) -> list[int]:
    """transformers' greedy ``generate``: prompt + up to ``new`` tokens, ending at the ``stop`` token. The attention
    mask is given: generate would otherwise mask every prompt token equal to the pad id it is told."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         eos_token_id=stop, pad_token_id=0 if stop is None else stop)
    return out[0].tolist()


def packed_features_match(target, layer_ids) -> None:
    """Two random documents (9 and 7 tokens) packed in one row of 20 with padding: each one's target features
    (``train.objective.target_features`` with document starts) equal its own unpacked forward's."""
    from train.objective import target_features

    rng = np.random.RandomState(3)
    a, b = rng.randint(0, target.config.vocab_size, 9), rng.randint(0, target.config.vocab_size, 7)
    row = np.zeros((1, 20), np.int32)
    row[0, :9], row[0, 9:16] = a, b
    starts = np.array([[0] * 9 + [9] * 7 + [16] * 4], np.int32)
    packed = np.asarray(target_features(target.config, target.params, row, layer_ids, starts))
    d, depth = target.config.hidden_size, forward_depth(target.config, 20)
    for doc, at in ((a, 0), (b, 9)):
        alone = np.asarray(target_features(target.config, target.params, doc[None].astype(np.int32), layer_ids))
        # the same forward at another shape (20 vs 9 / 7 tokens): a forward's rounding, per layer's scale
        for i in range(len(layer_ids)):
            assert_close(packed[0, at:at + len(doc), i * d:(i + 1) * d], alone[0, :, i * d:(i + 1) * d], depth,
                         what=f"doc at {at} layer {layer_ids[i]}")
