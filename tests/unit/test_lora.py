"""LoRA: the configuration's checks (one line naming the flag), and the adapters on a one-rank
Megatron model: a zero B leaves the model as it was, the forward equals the merged weights',
switching the adapters off gives the base model, only the adapters train, and the PEFT-named
tensors round-trip."""

from __future__ import annotations

import pytest
import torch

from vime_core.config import ConfigError, load_config


def test_lora_is_off_by_default_and_all_linear_expands_to_the_hf_names():
    assert load_config().lora_rank == 0
    assert load_config(overrides={"lora_rank": 8, "lora_publish": "adapter"}).lora_publish == "adapter"
    cfg = load_config(overrides={"lora_rank": 8})
    assert cfg.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    commas = load_config(overrides={"lora_rank": 8, "target_modules": ["v_proj,q_proj,k_proj", "down_proj"]})
    assert commas.target_modules == ["q_proj", "k_proj", "v_proj", "down_proj"]


@pytest.mark.parametrize(
    "over, message",
    [
        ({"lora_rank": -1}, "lora_rank=-1 must be >= 0"),
        ({"lora_alpha": 32.0}, "lora_alpha=32.0 has no effect without lora_rank > 0"),
        ({"lora_rank": 4, "target_modules": ["qkv"]}, "target_modules=qkv matches no linear layer (qkv unknown)"),
        ({"lora_rank": 4, "target_modules": []}, "target_modules=(empty) matches no linear layer"),
        ({"lora_rank": 4, "target_modules": ["q_proj"]}, "target_modules has q_proj without k_proj, v_proj"),
        ({"lora_rank": 4, "target_modules": ["gate_proj,down_proj"]}, "has gate_proj without up_proj"),
        ({"lora_rank": 4, "advantage_estimator": "ppo"}, "lora_rank=4 with advantage_estimator=ppo"),
        ({"lora_rank": 1024, "lora_publish": "adapter"}, "lora_rank=1024 with lora_publish=adapter"),
        (
            {
                "lora_rank": 4,
                "lora_publish": "adapter",
                "check_weight_update_equal": True,
                "async_staleness": 1,
                "use_tis": True,
            },
            "check_weight_update_equal with lora_publish=adapter and async_staleness=1",
        ),
    ],
)
def test_bad_lora_settings_fail_with_one_line_naming_the_flag(over, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=over)
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 1 and message in lines[0], lines


@pytest.fixture()
def one_rank_model(tiny_model_dir):
    """A tiny fp32 Megatron model at TP=1 with the checkpoint's weights, and its architecture."""
    from vime_core.trainer.hf_convert import load_hf_into_model
    from vime_core.trainer.model import architecture_from_hf, build_gpt_model, read_hf_config
    from vime_core.trainer.parallel import destroy_parallel, free_port, init_parallel

    init_parallel(0, 1, "127.0.0.1", free_port(), 1, "cpu")
    try:
        arch = architecture_from_hf(read_hf_config(tiny_model_dir))
        model = build_gpt_model(arch, 1, torch.float32, torch.device("cpu"))
        load_hf_into_model(model, tiny_model_dir, arch, 1, 0)
        yield model, arch
    finally:
        destroy_parallel()


def _logits(model, tokens):
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    return model(tokens, positions, attention_mask=None)


def _randomise_b(model, seed):
    from vime_core.trainer.lora import adapted_layers

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, module in adapted_layers(model):
            module.lora.B.copy_(torch.randn(module.lora.B.shape, generator=gen) * 0.05)


def test_adapters_start_as_the_base_model_and_equal_the_merged_weights(one_rank_model):
    from vime_core.trainer.lora import adapted_layers, adapters_disabled, apply_lora, merged_weight

    model, arch = one_rank_model
    cfg = load_config(overrides={"lora_rank": 4, "lora_alpha": 8.0})
    tokens = torch.randint(0, arch.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = _logits(model, tokens)
        count = apply_lora(model, cfg, arch, 1, 0)
        assert torch.equal(_logits(model, tokens), base)  # B = 0
        _randomise_b(model, 1)
        adapted = _logits(model, tokens)
        with adapters_disabled(model):
            assert torch.equal(_logits(model, tokens), base)
        assert (adapted - base).abs().max() > 1e-3
        layers = list(adapted_layers(model))
        assert len(layers) == 4 * arch.num_layers
        assert count == sum(m.lora.A.numel() + m.lora.B.numel() for _, _, m in layers)
        for _, _, module in layers:  # fold s B A into W, adapters off: the same model
            module.weight.copy_(merged_weight(module))
        with adapters_disabled(model):
            merged = _logits(model, tokens)
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if n.endswith((".lora.A", ".lora.B"))}
    assert len(trainable) == 2 * len(layers)


def test_a_is_kaiming_uniform_and_the_peft_tensors_round_trip(one_rank_model):
    from vime_core.trainer.lora import adapted_layers, apply_lora, load_full_adapter, lora_hf_state, lora_settings

    model, arch = one_rank_model
    cfg = load_config(overrides={"lora_rank": 4, "target_modules": ["q_proj,k_proj,v_proj,down_proj"]})
    apply_lora(model, cfg, arch, 1, 0)
    assert lora_settings(cfg) == {
        "r": 4,
        "lora_alpha": 16.0,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "down_proj"],
    }
    for _, _, module in adapted_layers(model):
        bound = 1 / module.lora.A.shape[1] ** 0.5
        assert 0.5 * bound < module.lora.A.abs().max() <= bound and not module.lora.B.any()
    _randomise_b(model, 2)
    state = lora_hf_state(model, arch)
    prefix = "base_model.model.model.layers.0."
    q, k = state[prefix + "self_attn.q_proj.lora_B.weight"], state[prefix + "self_attn.k_proj.lora_B.weight"]
    assert q.shape == (arch.num_heads * arch.head_dim, 4) and k.shape == (arch.num_kv_heads * arch.head_dim, 4)
    assert state[prefix + "self_attn.v_proj.lora_A.weight"].shape == (4, arch.hidden_size)
    assert state[prefix + "mlp.down_proj.lora_A.weight"].shape == (4, arch.ffn_hidden_size)
    assert len(state) == 2 * 4 * arch.num_layers
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for i, name, module in adapted_layers(model):  # zero them, then load them back from the PEFT tensors
        module.lora.A.data.zero_()
        module.lora.B.data.zero_()
        projs = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"] if "qkv" in name else ["mlp.down_proj"]
        a = [state[f"base_model.model.model.layers.{i}.{p}.lora_A.weight"] for p in projs]
        b = [state[f"base_model.model.model.layers.{i}.{p}.lora_B.weight"] for p in projs]
        load_full_adapter(module, name, arch, 1, 0, a[0], b)
    after = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_a_yaml_string_of_target_modules_reads_as_peft_writes_it(tmp_path):
    """PEFT's and TRL's configs write `target_modules: all-linear` or `q_proj,v_proj`: a string, as
    the flag's list."""
    for text, want in (
        ("all-linear", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        ("q_proj,k_proj,v_proj", ["q_proj", "k_proj", "v_proj"]),
        ("q_proj k_proj v_proj down_proj", ["q_proj", "k_proj", "v_proj", "down_proj"]),
    ):
        path = tmp_path / "run.yaml"
        path.write_text(f"lora_rank: 8\ntarget_modules: {text}\n")
        assert load_config(path).target_modules == want, text
    path.write_text("lora_rank: 8\ntarget_modules: 7\n")  # neither a list nor names: the field's own error
    with pytest.raises(ConfigError, match="target_modules"):
        load_config(path)


def test_the_cli_takes_comma_separated_target_modules(capsys):
    from vime_core.config import parse_args

    cfg = parse_args(["--lora-rank", "8", "--target-modules", "q_proj,k_proj,v_proj", "o_proj"])
    assert cfg.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    with pytest.raises(SystemExit):
        parse_args(["--lora-rank", "8", "--target-modules", "up_proj"])
    assert "target_modules has up_proj without gate_proj" in capsys.readouterr().err


def test_adapter_dropout_acts_in_the_gradient_forward_only(one_rank_model):
    from vime_core.trainer.lora import apply_lora

    model, arch = one_rank_model
    apply_lora(model, load_config(overrides={"lora_rank": 4, "lora_dropout": 0.5}), arch, 1, 0)
    _randomise_b(model, 3)
    tokens = torch.randint(0, arch.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the log-prob passes: deterministic
        assert torch.equal(_logits(model, tokens), _logits(model, tokens))
    assert not torch.equal(_logits(model, tokens), _logits(model, tokens))


def _recompute_every_layer(model):
    """Each decoder layer through a reentrant activation checkpoint, as Megatron's full recompute
    runs it (an autograd Function whose output has a gradient only when an input has one)."""
    from torch.utils.checkpoint import checkpoint

    from vime_core.trainer.hf_convert import unwrap

    for layer in unwrap(model).decoder.layers:

        def forward(*args, _layer_forward=layer.forward, **kwargs):
            hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
            rest = args[1:] if "hidden_states" not in kwargs else args

            def run(h):
                return _layer_forward(h, *rest, **kwargs)[0]

            return checkpoint(run, hidden, use_reentrant=True), None

        layer.forward = forward


def test_adapters_get_gradients_when_every_layer_is_recomputed(one_rank_model):
    """The embedding is frozen, so the first layer's input has no gradient; a reentrant recompute
    would then drop every adapter's gradient (on the GPU: 'element 0 of tensors does not require
    grad'). apply_lora makes the embedding's output require one."""
    from vime_core.trainer.lora import adapted_layers, apply_lora

    model, arch = one_rank_model
    apply_lora(model, load_config(overrides={"lora_rank": 4}), arch, 1, 0)
    _randomise_b(model, 5)
    _recompute_every_layer(model)
    tokens = torch.randint(0, arch.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    _logits(model, tokens).float().pow(2).mean().backward()
    grads = [(m.lora.A.grad, m.lora.B.grad) for _, _, m in adapted_layers(model)]
    assert grads and all(a is not None and b is not None and a.abs().sum() > 0 for a, b in grads)
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora." not in n)
    with torch.no_grad():  # the log-prob passes build no graph
        assert not _logits(model, tokens).requires_grad
