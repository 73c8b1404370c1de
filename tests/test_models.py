"""batchfit.models: presets load with their real sizes, models build real or fake, step functions."""

from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from batchfit import InvalidArgument
from batchfit.memory import get_backend
from batchfit.models import (
    build_causal_lm,
    list_presets,
    load_config,
    parse_dtype,
    preset_info,
    specs,
)

# --------------------------------------------------------------------------- presets


def test_the_required_presets_ship():
    assert {"tiny", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3.1-8b"} <= set(list_presets())


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # (hidden, layers, heads, kv heads, intermediate, vocab, rope theta, tied)
        ("qwen2.5-0.5b", (896, 24, 14, 2, 4864, 151936, 1e6, True)),
        ("qwen2.5-1.5b", (1536, 28, 12, 2, 8960, 151936, 1e6, True)),
        ("qwen2.5-7b", (3584, 28, 28, 4, 18944, 152064, 1e6, False)),
        ("llama-3.1-8b", (4096, 32, 32, 8, 14336, 128256, 5e5, False)),
    ],
)
def test_presets_have_the_real_architecture(name, expected):
    c = load_config(name)
    rope_theta = c.rope_parameters["rope_theta"]
    got = (
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.vocab_size,
        rope_theta,
        c.tie_word_embeddings,
    )
    assert got == expected


@pytest.mark.parametrize(
    ("name", "parameters"),
    [
        ("tiny", 223_552),
        ("qwen2.5-0.5b", 494_032_768),  # the published counts
        ("qwen2.5-1.5b", 1_543_714_304),
        ("qwen2.5-7b", 7_615_616_512),
        ("llama-3.2-1b", 1_235_814_400),
        ("qwen3-0.6b", 596_049_920),
        ("llama-3.1-8b", 8_030_261_248),
    ],
)
def test_presets_build_fake_with_their_published_parameter_counts(name, parameters):
    model = build_causal_lm(name, backend=get_backend("estimate"), dtype="bf16")
    assert isinstance(next(model.parameters()), FakeTensor)
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_llama_3_1_uses_llama3_rope_scaling():
    rope = load_config("llama-3.1-8b").rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == (
        "llama3",
        8.0,
        8192,
    )


def test_preset_info_and_names_are_case_insensitive():
    assert preset_info("Qwen2.5-0.5B")["hub_id"] == "Qwen/Qwen2.5-0.5B"
    assert load_config("TINY").hidden_size == 64


def test_overrides_do_not_change_the_preset():
    assert load_config("tiny", num_hidden_layers=1).num_hidden_layers == 1
    assert load_config("tiny").num_hidden_layers == 2


def test_a_local_directory_with_config_json_loads(tmp_path):
    data = dict(preset_info("tiny")["config"], hidden_size=32, head_dim=8)
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert load_config(tmp_path).hidden_size == 32
    assert load_config(str(tmp_path / "config.json")).hidden_size == 32


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        pytest.param("qwen2.5-05b", r"spec=.qwen2.5-05b.; did you mean 'qwen2.5-0.5b'\?", id="typo"),
        pytest.param("gpt5", r"spec must be a preset \(.*tiny.*\).*got spec='gpt5'", id="unknown"),
        pytest.param(42, r"spec must be a preset name, a path, a hub id.*got spec=42 \(int\)", id="not-a-string"),
        pytest.param(
            torch.nn.Linear(2, 2), r"spec must be a transformers model \(with a config\).*a Linear without one", id="module"
        ),
        pytest.param("/nonexistent/dir/config.json", r"does not exist", id="missing-file"),
    ],
)
def test_bad_specs_name_the_value_and_the_choices(spec, match):
    with pytest.raises(InvalidArgument, match=match):
        load_config(spec)


def test_an_unreachable_hub_id_is_a_clear_error(monkeypatch):
    import transformers

    def offline(*args, **kwargs):
        raise OSError("no network")

    calls = []

    def offline_recorded(*args, **kwargs):
        calls.append(kwargs.get("local_files_only", False))
        return offline()

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline_recorded)
    monkeypatch.setattr(specs, "_hub_unreachable", lambda: None)
    with pytest.raises(InvalidArgument, match=r"spec='org/model' looks like a hub id but its config is not cached"):
        load_config("org/model")
    assert calls == [True, False]  # the local cache first, then the network
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls.clear()
    with pytest.raises(InvalidArgument, match=r"HF_HUB_OFFLINE=1 skips the network"):
        load_config("org/model")
    assert calls == [True]  # offline: no network attempt


def test_a_hub_id_without_a_network_fails_fast_and_quietly(monkeypatch, caplog):
    import logging
    import socket

    import transformers

    calls = []

    def retrying(*args, **kwargs):
        calls.append(kwargs.get("local_files_only", False))
        logging.getLogger("huggingface_hub").warning("Retrying in 8s [Retry 1/5].")
        raise OSError("no network")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", retrying)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: refused at once
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    connects = []  # the one connection attempt, with its timeout: what bounds the wait (not timed)

    def connect(address, timeout=None, *args, **kwargs):
        connects.append((address, timeout))
        return create_connection(address, timeout, *args, **kwargs)

    create_connection = socket.create_connection
    monkeypatch.setattr(socket, "create_connection", connect)
    with pytest.raises(InvalidArgument, match=r"127\.0\.0\.1:9 is unreachable"):
        load_config("org/model")
    assert connects == [(("127.0.0.1", 9), specs.HUB_CONNECT_TIMEOUT)] and specs.HUB_CONNECT_TIMEOUT <= 5
    assert calls == [True]  # the cache only: no network attempt, no retries
    monkeypatch.setattr(specs, "_hub_unreachable", lambda: None)
    with caplog.at_level(logging.WARNING), pytest.raises(InvalidArgument):
        load_config("org/model")
    assert "Retrying" not in caplog.text  # the hub's retry log stays off the terminal


# --------------------------------------------------------------------------- building


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"dtype": "int8"}, r"dtype must be torch.float32.*got dtype='int8'", id="dtype-name"),
        pytest.param({"dtype": torch.int64}, r"got dtype=torch.int64", id="dtype-int"),
        pytest.param(
            {"attn_implementation": "flash"},
            r"attn_implementation must be one of .*got attn_implementation='flash'",
            id="attn",
        ),
        pytest.param({"backend": "gpu"}, r"backend must be one of", id="backend"),
    ],
)
def test_build_rejects_bad_arguments(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        build_causal_lm("tiny", **kwargs)


def test_parse_dtype_accepts_names():
    assert parse_dtype("bf16") is parse_dtype("torch.bfloat16") is torch.bfloat16


def test_build_options_take_effect():
    model = build_causal_lm("tiny", dtype="bf16", attn_implementation="eager", gradient_checkpointing=True)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    name = (
        "is_activation_checkpointing"
        if hasattr(type(model), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    assert getattr(model, name) and model.training


def test_value_head_outputs_one_value_per_token():
    critic = build_causal_lm("tiny", value_head=True)
    out = critic(input_ids=torch.randint(0, 1024, (2, 5))).logits
    assert out.shape == (2, 5, 1)


def test_a_presets_own_hub_id_is_answered_by_the_preset_offline(monkeypatch):
    # NOTE [ A preset answers for its hub id offline ]: ROLL's example names pretrain: Qwen/Qwen2.5-7B
    import transformers

    from batchfit.models import specs

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(specs, "_ANSWERED_BY_PRESET", set())
    with pytest.warns(UserWarning, match=r"using batchfit's preset 'qwen2\.5-7b'"):
        config = load_config("Qwen/Qwen2.5-7B")
    preset = load_config("qwen2.5-7b")
    assert config.to_dict() == preset.to_dict()
    with pytest.raises(InvalidArgument, match=r"looks like a hub id"):  # an -Instruct variant's config may differ
        load_config("Qwen/Qwen2.5-7B-Instruct")
    assert specs._preset_of_hub_id("qwen/qwen2.5-7b") is None  # exact, as the hub spells it
