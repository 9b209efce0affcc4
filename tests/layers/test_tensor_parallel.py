"""The tensor-parallel layout: each rank's share of heads, KV heads, MLP width and vocabulary, and
the loader filling each rank's shard straight from the checkpoint (no process group needed to load)."""

from __future__ import annotations

import pytest
import torch

from asyncspec.errors import ConfigError
from asyncspec.layers.tensor_parallel import TensorParallel, check_divisible
from asyncspec.models.loader import load_model
from asyncspec.models.model_config import ModelConfig
from tests.hf_tiny_models import save_random_hf_model, save_tiny_family_model

CPU = torch.device("cpu")


def test_split_gives_equal_contiguous_shares() -> None:
    assert [TensorParallel(r, 4).split(32, "x") for r in range(4)] == [(0, 8), (8, 8), (16, 8), (24, 8)]
    with pytest.raises(ConfigError, match="num_attention_heads=6 is not divisible by tensor_parallel_size=4"):
        TensorParallel(0, 4).split(6, "num_attention_heads")


def test_kv_heads_are_split_or_replicated_on_whole_groups_of_ranks() -> None:
    assert [TensorParallel(r, 2).kv_heads(8) for r in range(2)] == [(0, 4), (4, 4)]
    # Two KV heads over four ranks: ranks 0-1 hold head 0, ranks 2-3 head 1.
    assert [TensorParallel(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ConfigError, match="num_key_value_heads=3 is below tensor_parallel_size=4"):
        TensorParallel(0, 4).kv_heads(3)
    with pytest.raises(ConfigError, match="num_key_value_heads=6"):
        TensorParallel(0, 4).kv_heads(6)


def test_query_heads_of_a_rank_map_to_its_own_kv_heads() -> None:
    """With GQA every query head h reads KV head h // (heads / kv_heads); on each rank that KV
    head must be one the rank holds."""
    for heads, kv, size in [(8, 2, 2), (8, 2, 4), (8, 1, 4), (32, 8, 4), (4, 4, 2)]:
        check_divisible(TensorParallel(0, size), heads, kv, 64)
        for rank in range(size):
            tp = TensorParallel(rank, size)
            q0, nq = tp.split(heads, "heads")
            k0, nk = tp.kv_heads(kv)
            group = heads // kv
            assert {h // group for h in range(q0, q0 + nq)} <= set(range(k0, k0 + nk)), (heads, kv, size, rank)


def test_vocab_shards_pad_the_last_rank() -> None:
    assert [TensorParallel(r, 2).vocab_shard(509) for r in range(2)] == [(0, 255), (255, 255)]
    with pytest.raises(ConfigError, match="intermediate_size=96 is not divisible by tensor_parallel_size=5"):
        check_divisible(TensorParallel(0, 5), 5, 5, 96)


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("qwen2", dict(tie_word_embeddings=False)),  # q/k/v biases
        ("llama", dict(num_key_value_heads=1, vocab_size=509, tie_word_embeddings=True)),  # MQA, padded vocab
    ],
)
def test_shards_reassemble_the_checkpoint(tmp_path, family, overrides) -> None:
    hf = save_tiny_family_model(family, tmp_path, torch.float32, **overrides)
    expected = {k: v for k, v in hf.state_dict().items()}
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    full = load_model(str(tmp_path), cfg, torch.float32, CPU)
    shards = [load_model(str(tmp_path), cfg, torch.float32, CPU, tp=TensorParallel(r, 2)) for r in range(2)]
    hd, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        attns = [list(s.model.decoder_layers)[i].self_attn for s in shards]
        # Column-parallel q: each rank's rows are its heads; concatenated they are the whole matrix.
        q = torch.cat([a.qkv_proj.weight[: a.q_size] for a in attns])
        assert torch.equal(q, expected[p + "self_attn.q_proj.weight"])
        for a in attns:
            k = a.qkv_proj.weight[a.q_size : a.q_size + a.kv_size]
            head = a.kv_head_start
            assert torch.equal(k, expected[p + "self_attn.k_proj.weight"][head * hd : (head + a.num_kv_heads) * hd])
            if a.qkv_proj.bias is not None:
                v_bias = a.qkv_proj.bias[a.q_size + a.kv_size :]
                assert torch.equal(
                    v_bias, expected[p + "self_attn.v_proj.bias"][head * hd : (head + a.num_kv_heads) * hd]
                )
            assert a.num_kv_heads == max(1, kv // 2)
        # Row-parallel o_proj and down_proj: columns.
        o = torch.cat([a.o_proj.weight for a in attns], dim=1)
        assert torch.equal(o, expected[p + "self_attn.o_proj.weight"])
        mlps = [list(s.model.decoder_layers)[i].mlp for s in shards]
        down = torch.cat([m.down_proj.weight for m in mlps], dim=1)
        assert torch.equal(down, expected[p + "mlp.down_proj.weight"])
        gate = torch.cat([m.gate_up_proj.weight[: m.intermediate_size] for m in mlps])
        assert torch.equal(gate, expected[p + "mlp.gate_proj.weight"])
    assert heads % 2 == 0
    # Vocabulary-parallel embedding: rows, the last shard padded with zeros.
    embed = torch.cat([s.model.embed_tokens.weight for s in shards])
    assert torch.equal(embed[: cfg.vocab_size], expected["model.embed_tokens.weight"])
    assert torch.equal(embed[: cfg.vocab_size], full.model.embed_tokens.weight)
    assert (embed[cfg.vocab_size :] == 0).all() and embed.shape[0] == 2 * -(-cfg.vocab_size // 2)


def test_row_parallel_biases_are_added_once(tmp_path) -> None:
    """A row-parallel projection's bias is held by rank 0 only: the all-reduce sums it once."""
    import transformers

    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    config.update(num_key_value_heads=2, attention_bias=True, mlp_bias=True)
    save_random_hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, config, tmp_path)  # random biases
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    full = load_model(str(tmp_path), cfg, torch.float32, CPU)
    shards = [load_model(str(tmp_path), cfg, torch.float32, CPU, tp=TensorParallel(r, 2)) for r in range(2)]
    o_bias = [list(s.model.decoder_layers)[0].self_attn.o_proj.bias for s in shards]
    assert torch.equal(o_bias[0], list(full.model.decoder_layers)[0].self_attn.o_proj.bias)
    assert (o_bias[1] == 0).all() and o_bias[0].abs().sum() > 0


def test_dummy_weights_do_not_depend_on_the_sharding(tmp_path) -> None:
    # Row-parallel biases (zero off rank 0) are drawn on every rank all the same: the tensors after
    # them come out equal too.
    save_tiny_family_model("llama", tmp_path, torch.float32, attention_bias=True, mlp_bias=True)
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    full = load_model(str(tmp_path), cfg, torch.float32, CPU, load_format="dummy", seed=5)
    shards = [
        load_model(str(tmp_path), cfg, torch.float32, CPU, load_format="dummy", seed=5, tp=TensorParallel(r, 2))
        for r in range(2)
    ]
    o = torch.cat([list(s.model.decoder_layers)[1].self_attn.o_proj.weight for s in shards], dim=1)
    assert torch.equal(o, list(full.model.decoder_layers)[1].self_attn.o_proj.weight)
    embed = torch.cat([s.model.embed_tokens.weight for s in shards])[: cfg.vocab_size]
    assert torch.equal(embed, full.model.embed_tokens.weight)
    down = torch.cat([list(s.model.decoder_layers)[1].mlp.down_proj.weight for s in shards], dim=1)
    assert torch.equal(down, list(full.model.decoder_layers)[1].mlp.down_proj.weight)
    bias = [list(s.model.decoder_layers)[1].mlp.down_proj.bias for s in shards]
    assert torch.equal(bias[0], list(full.model.decoder_layers)[1].mlp.down_proj.bias) and (bias[1] == 0).all()


def test_collectives_captured_in_a_graph_use_the_graph_group(monkeypatch) -> None:
    """Collectives issued while a CUDA graph is captured go to `graph_group` (a communicator that then sees
    only graphed launches), every other one to `group`; without a graph_group, everything to `group`."""
    import torch.distributed as dist

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: calls.append(("all_reduce", group)))

    def gather(out, x, group=None):
        calls.append(("all_gather", group))
        out.copy_(x.repeat(2, 1))

    monkeypatch.setattr(dist, "all_gather_single", gather, raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", gather)
    eager, graphed = object(), object()
    tp = TensorParallel(rank=0, size=2, group=eager, graph_group=graphed)
    x = torch.ones(1, 4)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    tp.all_reduce(x)
    tp.all_gather_rows(x, 7)
    capturing[0] = True
    tp.all_reduce(x)
    tp.all_gather_rows(x, 7)
    assert calls == [("all_reduce", eager), ("all_gather", eager), ("all_reduce", graphed), ("all_gather", graphed)]
    calls.clear()
    TensorParallel(rank=0, size=2, group=eager).all_reduce(x)  # no graph group: the one group, capturing or not
    assert calls == [("all_reduce", eager)]
