"""The top-K distillation KL (``--teacher-topk``): a float64 reference written from NeMo-RL's
formula (both distributions renormalised on the teacher's top K), its gradient, the exact KL at
K = V, the tensor-parallel shards, the teacher's top-K scores and the micro-batch layout."""

from __future__ import annotations

import os

import pytest
import torch
from qwen3_moe_testing import spawn_ranks
from real_sglang import servers as real

from megatron_rl.backend import ParallelConfig, init_distributed
from megatron_rl.rollout import InProcessEngine
from megatron_rl.train.batch import TrainSample, make_micro_batch, merge_micro_batches
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.distillation_kl import topk_kl
from megatron_rl.train.objective import ObjectiveConfig
from megatron_rl.train.teacher import Teacher, TeacherConfig

BATCH, SEQ, VOCAB, K = 3, 7, 12, 4


def _inputs(seed: int = 0, k: int = K):
    """Student logits ``[b, s, V]``; the teacher's top-``k`` ids and log-probs ``[b, s - 1, k]``
    of a random teacher (descending, ids from the whole vocabulary); row 1's last position keeps
    2 ids (-1 padded), row 2's first two positions none (a prompt)."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(BATCH, SEQ, VOCAB, generator=gen)
    teacher = torch.log_softmax(3.0 * torch.randn(BATCH, SEQ - 1, VOCAB, generator=gen), dim=-1)
    values, ids = teacher.topk(k, dim=-1)
    ids, values = ids.clone(), values.clone()
    ids[1, -1, 2:], values[1, -1, 2:] = -1, 0.0
    ids[2, :2], values[2, :2] = -1, 0.0
    return logits, ids, values


def _reference(logits, ids, values, kl_type, alpha=0.5):
    """float64, position by position: ``p``, ``q`` renormalised on the present ids, then
    ``KL(p || q)``, ``KL(q || p)`` or their ``alpha`` mix; 0 without ids."""
    out = torch.zeros(ids.shape[:2], dtype=torch.float64)
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            keep = ids[b, t] >= 0
            if not keep.any():
                continue
            log_q = torch.log_softmax(logits[b, t, ids[b, t][keep]].double(), dim=0)
            log_p = torch.log_softmax(values[b, t][keep].double(), dim=0)
            forward = (log_p.exp() * (log_p - log_q)).sum()
            reverse = (log_q.exp() * (log_q - log_p)).sum()
            out[b, t] = {"forward": forward, "reverse": reverse}.get(
                kl_type, alpha * forward + (1 - alpha) * reverse
            )
    return out


@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
def test_equal_the_float64_renormalised_kl_and_its_gradient(ws1, kl_type):
    logits, ids, values = _inputs(seed=1)
    weights = torch.randn(BATCH, SEQ - 1, generator=torch.Generator().manual_seed(2))
    got_logits = logits.clone().requires_grad_()
    got = topk_kl(got_logits, ids, values, kl_type, 0.3)
    (got * weights).sum().backward()
    want_logits = logits.double().requires_grad_()
    want = _reference(want_logits, ids, values, kl_type, 0.3)
    (want * weights.double()).sum().backward()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_logits.grad.double(), want_logits.grad, atol=1e-5, rtol=0)
    assert got[2, :2].abs().max() == 0 and (got[:, 2:] > 0).all()  # a KL is >= 0


def test_k_equal_to_the_vocabulary_is_the_exact_kl_of_the_full_distributions(ws1):
    logits, ids, values = _inputs(seed=3, k=VOCAB)
    log_q = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    log_p = torch.zeros_like(log_q).scatter_(-1, ids.clamp(min=0), values.double())
    exact = (log_p.exp() * (log_p - log_q)).sum(-1)  # rows 0 and 1 but the padded position
    got = topk_kl(logits, ids, values, "forward")
    torch.testing.assert_close(got[0].double(), exact[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1, :-1].double(), exact[1, :-1], atol=1e-5, rtol=0)
    exact_reverse = (log_q.exp() * (log_q - log_p)).sum(-1)
    got = topk_kl(logits, ids, values, "reverse")
    torch.testing.assert_close(got[0].double(), exact_reverse[0], atol=1e-5, rtol=0)


def test_a_teacher_log_prob_of_minus_inf_stays_finite(ws1):
    logits, ids, values = _inputs(seed=4)
    values[0, 0, -1] = float("-inf")  # a token the teacher gives no mass
    got = topk_kl(logits.requires_grad_(), ids, values, "reverse")
    got.sum().backward()
    assert torch.isfinite(got).all() and torch.isfinite(logits.grad).all()
    assert got[0, 0] > 1.0  # the student's mass on it costs about q * 100 nats


def test_the_layout_and_the_kl_type_are_checked(ws1):
    logits, ids, values = _inputs()
    with pytest.raises(ValueError, match=r"teacher_ids_BTK \(3, 5, 4\) must be \[b, s - 1, K\]"):
        topk_kl(logits, ids[:, 1:], values, "forward")
    with pytest.raises(ValueError, match="kl_type='js'"):
        topk_kl(logits, ids, values, "js")


def _tp2_worker(rank, world_size, init_method, tmp_dir) -> None:
    init_distributed(
        ParallelConfig(tensor_parallel=world_size),
        rank=rank,
        world_size=world_size,
        init_method=init_method,
        device="cpu",
    )
    data = torch.load(os.path.join(tmp_dir, "inputs.pt"))
    shard = VOCAB // world_size
    local = data["logits"][..., rank * shard : (rank + 1) * shard].clone().requires_grad_()
    out = topk_kl(local, data["ids"], data["values"], "mixed", 0.3)
    (out * data["weights"]).sum().backward()
    torch.save({"out": out.detach(), "grad": local.grad}, os.path.join(tmp_dir, f"r{rank}.pt"))


@pytest.mark.slow  # two spawned ranks each import megatron-core
@pytest.mark.distributed
def test_tp2_vocab_shards_give_the_full_vocabulary_values(tmp_path, ws1):
    logits, ids, values = _inputs(seed=5)
    weights = torch.randn(BATCH, SEQ - 1, generator=torch.Generator().manual_seed(6))
    torch.save(
        {"logits": logits, "ids": ids, "values": values, "weights": weights},
        tmp_path / "inputs.pt",
    )
    spawn_ranks(_tp2_worker, tmp_path, 2)
    full = logits.clone().requires_grad_()
    want = topk_kl(full, ids, values, "mixed", 0.3)
    (want * weights).sum().backward()
    shard = VOCAB // 2
    for rank in range(2):
        got = torch.load(tmp_path / f"r{rank}.pt")
        torch.testing.assert_close(got["out"], want.detach(), atol=2e-6, rtol=0)
        torch.testing.assert_close(
            got["grad"], full.grad[..., rank * shard : (rank + 1) * shard], atol=2e-6, rtol=0
        )


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher of another size than the student (3 layers, 96 wide) with its vocabulary."""
    folder = tmp_path_factory.mktemp("teacher")
    return real.write_tiny_checkpoint(
        folder, seed=4, num_hidden_layers=3, hidden_size=96, intermediate_size=192
    )


def _sample(prompt, response) -> TrainSample:
    return TrainSample(
        prompt_ids=torch.tensor(prompt),
        response_ids=torch.tensor(response),
        rollout_logprobs=-torch.rand(len(response)),
        advantage=1.0,
        reward=1.0,
        in_loss=True,
    )


def test_the_teachers_top_k_are_a_direct_forwards_and_land_at_the_predicted_positions(teacher_dir):
    config = TeacherConfig(loss_teacher=str(teacher_dir), teacher_topk=5)
    teacher = Teacher(config, vocab_size=16)
    model = InProcessEngine.from_pretrained(teacher_dir).model
    samples = [_sample([1, 5, 9], [3, 7, 2]), _sample([2], [4, 4, 8, 11])]
    teacher.annotate(samples)
    for s in samples:
        ids = torch.cat([s.prompt_ids, s.response_ids])[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        first = s.prompt_ids.numel() - 1
        values, top = logp[first:].topk(5, dim=-1)
        torch.testing.assert_close(s.teacher_topk[0], values, atol=1e-5, rtol=0)
        assert torch.equal(s.teacher_topk[1], top.to(torch.int32))
        want = logp[first:].gather(-1, s.response_ids[:, None]).squeeze(-1)
        torch.testing.assert_close(s.teacher_logprobs, want, atol=1e-5, rtol=0)
    mb = merge_micro_batches([make_micro_batch(samples[:1], 0), make_micro_batch(samples[1:], 0)])
    assert mb.teacher_topk_ids_BTK.shape == (2, 5, 5)
    assert torch.equal(mb.teacher_topk_ids_BTK[0, 2:5], samples[0].teacher_topk[1].long())
    assert torch.equal(mb.teacher_topk_logprobs_BTK[1, 0:4], samples[1].teacher_topk[0])
    assert (mb.teacher_topk_ids_BTK[0, :2] == -1).all()  # prompt positions
    assert (mb.teacher_topk_ids_BTK[1, 4:] == -1).all()  # merge padding
    scored_without_top_k = _sample([1], [2])
    scored_without_top_k.teacher_logprobs = torch.zeros(1)
    with pytest.raises(ValueError, match=r"samples \[1\] have no teacher top-K"):
        make_micro_batch([samples[0], scored_without_top_k], 0)


def test_top_k_refusals_name_the_flag(teacher_dir):
    folder = str(teacher_dir)
    with pytest.raises(ValueError, match=r"--teacher-topk=4: .*pass --loss-teacher too"):
        TeacherConfig(teacher_topk=4)
    with pytest.raises(ValueError, match=r"--teacher-kl-type='reverse': .*pass --teacher-topk K"):
        TeacherConfig(loss_teacher=folder, teacher_kl_type="reverse")
    with pytest.raises(ValueError, match=r"--teacher-mixed-kl-weight=0.2: .*mixed"):
        TeacherConfig(loss_teacher=folder, teacher_topk=4, teacher_mixed_kl_weight=0.2)
    with pytest.raises(ValueError, match=r"--teacher-mixed-kl-weight=2: .*\[0, 1\]"):
        TeacherConfig(
            loss_teacher=folder, teacher_topk=4, teacher_kl_type="mixed", teacher_mixed_kl_weight=2
        )
    with pytest.raises(ValueError, match="--teacher-topk 17: the vocabulary has 16 tokens"):
        Teacher(TeacherConfig(loss_teacher=folder, teacher_topk=17), vocab_size=16)
    config = TeacherConfig(loss_teacher=folder, teacher_topk=4)
    assert (config.kl_type, config.mixed_kl_weight) == ("forward", 0.5)
    # the top-K KL is a loss term: a sequence-level advantage stays as it is
    TrainConfig(teacher=config, objective=ObjectiveConfig(loss="gspo"))
    with pytest.raises(ValueError, match="one advantage per sequence"):
        TrainConfig(
            teacher=TeacherConfig(loss_teacher=folder), objective=ObjectiveConfig(loss="gspo")
        )
