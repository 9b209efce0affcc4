"""load_model: weights land where they belong, dummy weights, and one test per ModelLoadError case."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from asyncspec.errors import ModelLoadError
from asyncspec.models.loader import load_model
from asyncspec.models.model_config import ModelConfig

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
CPU = torch.device("cpu")


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _write_model(path, cfg: dict = CONFIG, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=gen).to(dtype) for n, s in _expected_shapes(cfg).items()}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return tensors


def _load(path, dtype=torch.float32):
    return load_model(str(path), ModelConfig.from_pretrained(str(path)), dtype, CPU)


def _assert_weights(model, tensors: dict[str, torch.Tensor]) -> None:
    targets = {name: target.tensor for name, target in model.checkpoint_tensors().items()}
    assert set(targets) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(targets[name], t.to(targets[name].dtype)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loads_every_tensor_into_place(tmp_path, dtype) -> None:
    tensors = _write_model(tmp_path)
    model = _load(tmp_path, dtype)
    _assert_weights(model, tensors)
    assert all(p.dtype == dtype and p.device == CPU for p in model.parameters())
    assert all(b.device == CPU for b in model.buffers())  # nothing left on the meta device
    # The fused q/k/v parameter holds the three checkpoint tensors in order.
    fused = model.model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([tensors[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"]).to(dtype)
    assert torch.equal(fused, expected)


def test_sharded_index(tmp_path) -> None:
    tensors = _write_model(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / shard))
        weight_map.update({n: shard for n in shard_names})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _assert_weights(_load(tmp_path), tensors)


def test_tied_embeddings_share_storage_and_ignore_lm_head(tmp_path) -> None:
    cfg = {**CONFIG, "tie_word_embeddings": True}
    tensors = _write_model(tmp_path, cfg)
    # Some exporters still write the tied head and the rotary buffer; both are harmless.
    extra = {
        **tensors,
        "lm_head.weight": tensors["model.embed_tokens.weight"].clone(),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2),
    }
    save_file(extra, str(tmp_path / "model.safetensors"))
    model = _load(tmp_path)
    assert model.lm_head is None
    h = torch.randn(3, cfg["hidden_size"])
    expected = h @ tensors["model.embed_tokens.weight"].float().T
    torch.testing.assert_close(model.compute_logits(h), expected)


def test_tied_model_with_a_different_head_in_its_checkpoint_is_refused(tmp_path) -> None:
    """transformers 5 keeps such a head untied; dropping it silently would change every logit."""
    cfg = {**CONFIG, "tie_word_embeddings": True}
    tensors = _write_model(tmp_path, cfg)
    head = tensors["model.embed_tokens.weight"].clone()
    head[-1, 0] += 1.0  # one value in the last row
    save_file({**tensors, "lm_head.weight": head}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="tie_word_embeddings.*lm_head.weight.*differs"):
        _load(tmp_path)


def test_rope_tables_end_at_max_position_below_the_models_limit(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    full = load_model(str(tmp_path), cfg, torch.float32, CPU, load_format="dummy")
    short = load_model(str(tmp_path), cfg, torch.float32, CPU, load_format="dummy", max_position=40)
    longer = load_model(str(tmp_path), cfg, torch.float32, CPU, load_format="dummy", max_position=10**6)
    rows = [m.model.rotary_emb.cos_cache.shape[0] for m in (full, short, longer)]
    assert rows == [cfg.max_position_embeddings, 40, cfg.max_position_embeddings]
    torch.testing.assert_close(short.model.rotary_emb.sin_cache, full.model.rotary_emb.sin_cache[:40], rtol=0, atol=0)


def test_dummy_weights_are_seeded_and_need_no_files(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    a = load_model(str(tmp_path), cfg, torch.float32, CPU, load_format="dummy", seed=3)
    b = load_model(str(tmp_path), cfg, torch.float32, CPU, load_format="dummy", seed=3)
    c = load_model(str(tmp_path), cfg, torch.float32, CPU, load_format="dummy", seed=4)
    ta, tb, tc = ({n: t.tensor for n, t in m.checkpoint_tensors().items()} for m in (a, b, c))
    for name in ta:
        assert torch.isfinite(ta[name]).all()
        assert torch.equal(ta[name], tb[name]), name
        if name.endswith("norm.weight"):
            assert (ta[name] == 1).all()
        else:
            assert not torch.equal(ta[name], tc[name]), name
            assert 0.01 < ta[name].std() < 0.04


def _error(path) -> str:
    with pytest.raises(ModelLoadError) as info:
        _load(path)
    return str(info.value)


def test_missing_weight_file_lists_what_was_looked_for(tmp_path) -> None:
    _write_model(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    msg = _error(tmp_path)
    assert "model.safetensors" in msg and "model.safetensors.index.json" in msg and str(tmp_path) in msg


def test_pickle_weights_are_refused(tmp_path) -> None:
    tensors = _write_model(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    msg = _error(tmp_path)
    assert "pytorch_model.bin" in msg and "pickle" in msg and "convert to safetensors" in msg


def test_missing_tensor_is_named(tmp_path) -> None:
    tensors = _write_model(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    msg = _error(tmp_path)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "model.safetensors" in msg


def test_unexpected_tensor_is_named(tmp_path) -> None:
    tensors = _write_model(tmp_path)
    tensors["model.layers.0.self_attn.mystery.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    msg = _error(tmp_path)
    assert "model.layers.0.self_attn.mystery.weight" in msg and "model.safetensors" in msg


def test_missing_lm_head_of_untied_model_is_named(tmp_path) -> None:
    # Untied config but checkpoint without lm_head: the head is missing, not silently random.
    tensors = _write_model(tmp_path)
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" in _error(tmp_path)


def test_shape_mismatch_names_tensor_file_and_shapes(tmp_path) -> None:
    tensors = _write_model(tmp_path)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    msg = _error(tmp_path)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "model.safetensors" in msg
    assert "(8, 16)" in msg and "(5, 16)" in msg


def test_index_referencing_missing_shard(tmp_path) -> None:
    tensors = _write_model(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    save_file(tensors, str(tmp_path / "shard-a.safetensors"))
    weight_map = {n: "shard-a.safetensors" for n in tensors}
    weight_map["model.norm.weight"] = "shard-b.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    msg = _error(tmp_path)
    assert "shard-b.safetensors" in msg and "model.safetensors.index.json" in msg


def test_missing_directory(tmp_path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="nope"):
        load_model(str(missing), ModelConfig.from_dict(CONFIG), torch.float32, CPU)
