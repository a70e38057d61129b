"""A model's KV shape for kvalloc replay: options, --group, MLA and a Hugging Face config.json;
the replay's cache has that many bytes per token, and shapes given twice or malformed are
refused before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pykvalloc
from kvalloc_cli import main
from pykvalloc.replay.model_config import geometry_from_config, read_model_config

G = pykvalloc.KVGroup
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168,
               "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "v_head_dim": 128, "torch_dtype": "bfloat16"}
LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "torch_dtype": "bfloat16"}


def test_configs_of_real_model_families():
    assert geometry_from_config(DEEPSEEK_V3) == ((G.mla(61, 512, 64),), "bfloat16", 7168)
    assert geometry_from_config(LLAMA_8B) == ((G(32, 8, 128),), "bfloat16", 4096)
    qwen3 = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "hidden_size": 1024, "head_dim": 128, "dtype": "bfloat16"}  # head_dim is not 1024/16
    assert geometry_from_config(qwen3) == ((G(28, 8, 128),), "bfloat16", 1024)
    mha = {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768}
    assert geometry_from_config(mha) == ((G(12, 12, 64),), None, 768)
    vision = {"text_config": LLAMA_8B, "vision_config": {"hidden_size": 1152}}
    assert geometry_from_config(vision).groups == (G(32, 8, 128),)


@pytest.mark.parametrize("config, message", [
    ({**LLAMA_8B, "hidden_size": 4097}, "not a multiple"),
    ({k: v for k, v in LLAMA_8B.items() if k != "num_hidden_layers"}, "num_hidden_layers"),
    ({**DEEPSEEK_V3, "qk_rope_head_dim": None}, "qk_rope_head_dim"),
    ({**LLAMA_8B, "torch_dtype": "float128"}, "unknown KV dtype"),
    ({**LLAMA_8B, "num_key_value_heads": 0}, "num_key_value_heads"),
    ([1, 2], "not a JSON object"),
])
def test_bad_configs_are_refused(config, message):
    with pytest.raises(pykvalloc.InvalidArgument, match=message):
        geometry_from_config(config)


def test_unreadable_config_files(tmp_path):
    with pytest.raises(pykvalloc.InvalidArgument, match="cannot read"):
        read_model_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(pykvalloc.InvalidArgument, match="not JSON"):
        read_model_config(tmp_path / "bad.json")


def replay_capacity(capsys: pytest.CaptureFixture[str], *options: str) -> int:
    status = main(["replay", "--requests", "20", "--kv-tokens", "20000", "--quiet", "--json",
                   *options])
    said = capsys.readouterr()
    assert status == 0, said.err
    return int(json.loads(said.out)["runs"][0]["capacity_bytes"])


def test_replay_takes_the_shape_of_a_model_config(capsys, tmp_path: Path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    assert replay_capacity(capsys, "--model-config", str(path)) == 20000 * 61 * 576 * 2
    # --dtype wins over the config's
    assert replay_capacity(capsys, "--model-config", str(path), "--dtype", "fp8") == 20000 * 61 * 576
    path.write_text(json.dumps(LLAMA_8B))
    assert replay_capacity(capsys, "--model-config", str(path), "--mode", "contiguous") == \
        20000 * 2 * 32 * 8 * 128 * 2


def test_replay_takes_mla_and_groups_as_options(capsys):
    assert replay_capacity(capsys, "--layers", "4", "--kv-lora-rank", "512", "--rope-dim", "64") == \
        20000 * 4 * 576 * 2
    assert replay_capacity(capsys, "--group", "24:8:128", "--group", "4:1:576:1") == \
        20000 * 2 * (2 * 24 * 8 * 128 + 4 * 576)
    assert replay_capacity(capsys) == 20000 * 2 * 32 * 8 * 128 * 2  # the default model


@pytest.mark.parametrize("options, message", [
    (["--model-config", "x.json", "--layers", "3"], "would give it again"),
    (["--group", "2:8:128", "--kv-heads", "4"], "would give it again"),
    (["--kv-lora-rank", "512"], "needs both"),
    (["--kv-lora-rank", "512", "--rope-dim", "64", "--head-dim", "64"], "replace"),
    (["--group", "2:8"], "LAYERS:KV_HEADS:HEAD_DIM"),
    (["--group", "2:8:128:3"], "PARTS 1 or 2"),
])
def test_shapes_given_twice_or_malformed_are_usage_errors(capsys, options, message):
    try:
        status = main(["replay", "--requests", "5", "--quiet", *options])
    except SystemExit as exit:  # argparse's own refusal of a malformed --group
        status = exit.code
    assert status == 2
    said = capsys.readouterr()
    assert message in said.err and said.out == ""


def test_engine_buffers_take_the_models_width():
    from pykvalloc.replay.backends import Geometry
    from pykvalloc.replay.engine import QUERY_HEADS_PER_KV_HEAD, EngineBuffers
    with pykvalloc.Pool(64 << 20) as pool:
        deepseek = Geometry(layers=61, groups=(G.mla(61, 512, 64),), hidden_size=7168)
        assert EngineBuffers(pool, deepseek).hidden == 7168
        hybrid = Geometry(layers=28, groups=(G(24, 4, 64), G(4, 8, 128)))
        assert EngineBuffers(pool, hybrid).hidden == 4 * 64 * QUERY_HEADS_PER_KV_HEAD
        assert EngineBuffers(pool, Geometry()).hidden == 4096
