"""The trainer in one process (TP=1, DP=1): a GRPO step moves log-probs the right way, a retried
rollout is not trained twice, bad batches and checkpoints fail clearly, a checkpoint resumes
bit for bit, and the HF export loads in transformers with the trained weights."""

from __future__ import annotations

import pytest
import torch

from tests.integration.trainer.conftest import tiny_checkpoint
from tests.integration.trainer.hand_batch import hand_batch, hand_config, single_rank_trainer


@pytest.fixture(scope="module")
def ckpt(cache_dir):
    return tiny_checkpoint(cache_dir, "qwen3", True)


def test_grpo_step_moves_log_probs_with_the_advantage_sign(single_rank, ckpt, tmp_path):
    cfg = hand_config(ckpt, tmp_path, num_steps_per_rollout=1)
    trainer = single_rank_trainer(cfg)
    batch = hand_batch()
    before = trainer.compute_log_probs(batch)
    metrics = trainer.train(0, batch)
    after = trainer.compute_log_probs(batch)
    assert metrics["reused_log_probs"] is True  # one step, no KL: old = current, detached
    # ratio == 1 on the only step: loss = -token_mean(A) over the step's response tokens
    mask = [m for ms in batch["loss_mask"] for m in ms]
    adv = [a for a, r in zip(batch["advantage"], batch["response_length"]) for _ in range(r)]
    assert metrics["loss"] == pytest.approx(-sum(a * m for a, m in zip(adv, mask)) / sum(mask), abs=1e-6)
    assert metrics["pg_clipfrac"] == 0.0 and metrics["grad_norm"] > 0
    expected_diff = sum(abs(b - (-2.5)) for bs in before for b in bs) / sum(mask)
    assert metrics["train_rollout_logprob_abs_diff"] == pytest.approx(expected_diff, rel=1e-5)
    for adv_i, b, a in zip(batch["advantage"], before, after):
        deltas = [y - x for x, y in zip(b, a)]
        assert all(d > 0 for d in deltas) if adv_i > 0 else all(d < 0 for d in deltas), (adv_i, deltas)
    again = trainer.train(0, batch)
    assert again["skipped"] is True and again["loss"] == metrics["loss"]
    assert trainer.compute_log_probs(batch) == after  # no second optimizer step


def test_bad_batches_name_the_problem(single_rank, ckpt, tmp_path):
    trainer = single_rank_trainer(hand_config(ckpt, tmp_path))
    batch = hand_batch()
    del batch["loss_mask"]
    with pytest.raises(ValueError, match="loss_mask"):
        trainer.train(5, batch)
    batch = hand_batch()
    batch["loss_mask"][2] = [1]
    with pytest.raises(ValueError, match="sample 2: loss_mask has 1 entries"):
        trainer.train(5, batch)
    assert trainer.last_trained_rollout_id is None


def test_checkpoint_with_missing_or_extra_tensors_is_refused(single_rank, ckpt, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from vime_core.trainer.hf_convert import CheckpointMismatchError

    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors.pop("model.layers.0.mlp.down_proj.weight")
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(broken / "model.safetensors"))
    from vime_core.trainer.trainer import MegatronTrainer

    trainer = MegatronTrainer(hand_config(broken, tmp_path), 0, 1, "127.0.0.1", 0)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"missing: \['model.layers.0.mlp.down_proj.weight'\].*unexpected: \['model.layers.0.mlp.extra.weight'\]",
    ):
        trainer.init()


def test_resume_from_checkpoint_equals_the_uninterrupted_run(single_rank, ckpt, tmp_path):
    """Train rollout 0, save, train rollout 1 (the uninterrupted run); a fresh trainer loads the
    checkpoint and trains rollout 1: same weights and metrics, bit for bit."""
    from vime_core.trainer.checkpoint import latest_checkpoint

    cfg = hand_config(ckpt, tmp_path)  # two steps per rollout: recomputed old log-probs, Adam state
    first = single_rank_trainer(cfg)
    first.train(0, hand_batch())
    first.weight_version = 3
    path = first.save(0, {"data_source": {"cursor": 17}})
    assert latest_checkpoint(cfg) == path
    uninterrupted = first.train(1, hand_batch(scale=0.5))
    want = {n: t.clone() for n, t in first.iter_hf_weights()}

    second = single_rank_trainer(cfg)
    assert second.load(path) == {"data_source": {"cursor": 17}}
    assert second.weight_version == 3 and second.last_trained_rollout_id == 0
    assert second.train(0, hand_batch())["skipped"] is True
    resumed = second.train(1, hand_batch(scale=0.5))
    for name, tensor in second.iter_hf_weights():
        assert torch.equal(tensor, want[name]), name
    for key in ("loss", "pg_loss", "pg_clipfrac", "grad_norm", "entropy"):
        assert resumed[key] == uninterrupted[key], key


def test_restore_happens_once_per_trainer(single_rank, ckpt, tmp_path):
    """bootstrap's `restore`: the checkpoint is loaded on the first call only, so a retried
    bootstrap or a new driver that finds the trainer alive cannot roll back what it trained
    since; `state()["restored"]` tells them whether it still has to be done."""
    cfg = hand_config(ckpt, tmp_path)
    first = single_rank_trainer(cfg)
    first.train(0, hand_batch())
    path = first.save(0, {"data_source": {"cursor": 5}})

    second = single_rank_trainer(cfg)
    assert second.state()["restored"] is False
    assert second.restore(path) == {"data_source": {"cursor": 5}}
    assert second.state()["restored"] is True and second.last_trained_rollout_id == 0
    second.train(1, hand_batch(scale=0.5))
    trained = {n: t.clone() for n, t in second.iter_hf_weights()}
    assert second.restore(path) == {"data_source": {"cursor": 5}}  # the same answer, nothing loaded
    assert second.last_trained_rollout_id == 1
    for name, tensor in second.iter_hf_weights():
        assert torch.equal(tensor, trained[name]), name

    fresh = single_rank_trainer(cfg)
    assert fresh.restore(None) == {} and fresh.state()["restored"] is True
    assert fresh.last_trained_rollout_id is None


def test_export_hf_loads_in_transformers_with_trained_weights(single_rank, ckpt, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = single_rank_trainer(hand_config(ckpt, tmp_path, num_steps_per_rollout=1))
    trainer.train(0, hand_batch())
    out = trainer.export_hf(str(tmp_path / "export"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(out)("1+2=")["input_ids"]  # tokenizer copied and loadable
    batch = hand_batch()
    ours = trainer.compute_log_probs(batch)
    for toks, r, lp in zip(batch["tokens"], batch["response_length"], ours):
        with torch.no_grad():
            logp = model(torch.tensor([toks])).logits[0].log_softmax(-1)
        pos = torch.arange(len(toks) - r - 1, len(toks) - 1)
        assert logp[pos, torch.tensor(toks)[pos + 1]].tolist() == pytest.approx(lp, abs=1e-5)
    source = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(model.state_dict()[name], source.state_dict()[name])  # trained, not copied


def test_kl_entropy_and_tis_terms_train(single_rank, ckpt, tmp_path):
    """use_kl_loss builds the frozen reference; at the first step the policy is the reference,
    so KL = 0; the entropy bonus and TIS weights enter the loss without breaking the step."""
    cfg = hand_config(
        ckpt, tmp_path, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01, use_tis=True, num_steps_per_rollout=1
    )
    trainer = single_rank_trainer(cfg)
    assert trainer.ref_model is not None
    first = trainer.train(0, hand_batch())
    assert first["reused_log_probs"] is False  # KL needs the recomputed old log-probs
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)
    assert first["loss"] < first["pg_loss"]  # the entropy bonus (H > 0) lowers the loss
    second = trainer.train(1, hand_batch())
    assert second["kl"] > 0  # the policy has moved away from the reference


def test_ref_load_is_the_reference_of_the_kl_loss(single_rank, ckpt, tmp_path):
    """ref_load: the reference is that checkpoint, not the starting weights: at the first step the
    KL to a perturbed copy is > 0 (to the starting weights it is 0, test above), and the loss holds
    kl_loss_coef times it. A checkpoint of another architecture is refused, naming ref_load."""
    from transformers import AutoModelForCausalLM

    perturbed = tmp_path / "ref"
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(str(perturbed))
    cfg = hand_config(
        ckpt, tmp_path, use_kl_loss=True, kl_loss_coef=0.5, ref_load=str(perturbed), num_steps_per_rollout=1
    )
    first = single_rank_trainer(cfg).train(0, hand_batch())
    assert first["kl"] > 1e-4
    assert first["loss"] == pytest.approx(first["pg_loss"] + 0.5 * first["kl"], rel=1e-4, abs=1e-6)

    from vime_core.demo.model import build_tiny_model

    other = build_tiny_model(
        tmp_path / "three-layers",
        family="qwen3",
        seed=1,
        tie_word_embeddings=True,
        num_heads=4,
        num_kv_heads=2,
        num_layers=3,
    )
    with pytest.raises(ValueError, match=r"ref_load=.* is not the architecture of hf_checkpoint"):
        single_rank_trainer(hand_config(ckpt, tmp_path, use_kl_loss=True, ref_load=str(other), num_steps_per_rollout=1))


def test_sleep_is_a_noop_on_cpu_and_finds_every_state_tensor(single_rank, ckpt, tmp_path):
    """On CPU sleep/wake free nothing; the tensors a GPU sleep considers are every parameter plus
    Adam's state of each (exp_avg, exp_avg_sq and the step counter), found through Megatron's
    ChainedOptimizer."""
    from vime_core.trainer.offload import _tensors

    trainer = single_rank_trainer(hand_config(ckpt, tmp_path, num_steps_per_rollout=1))
    trainer.train(0, hand_batch())
    assert trainer.sleep() == {"freed_bytes": 0, "asleep": False, "weights_asleep": False}
    assert trainer.wake() == {"allocated_bytes": 0, "asleep": False}
    params = list(trainer.model.parameters())
    moved = list(_tensors(trainer.model, trainer.optimizer))
    assert len(moved) == 4 * len(params)  # fp32 on CPU: the params are the optimizer's own
    # offload_train keeps the weights for the publish: only Adam's state goes, nothing that
    # shares storage with a parameter
    kept = {p.untyped_storage().data_ptr() for p in params}
    optimizer_only = list(_tensors(trainer.model, trainer.optimizer, keep_params=True))
    assert len(optimizer_only) == 3 * len(params)
    assert not any(t.untyped_storage().data_ptr() in kept for t in optimizer_only)
