"""On-policy distillation's pieces: the per-token advantage against its formula, the in-process
teacher's scores against a direct forward, the samples annotated, the refusals."""

from __future__ import annotations

import pytest
import torch
from real_sglang import servers as real
from rollout.rollout_testing import direct_logprobs

from megatron_rl.rollout import InProcessEngine
from megatron_rl.train.batch import TrainSample, make_micro_batch, merge_micro_batches
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.objective import ObjectiveConfig
from megatron_rl.train.rollouts.config import RolloutConfig
from megatron_rl.train.teacher import Teacher, TeacherConfig, distillation_advantages


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher of another size than the student (3 layers, 96 wide) with its vocabulary."""
    folder = tmp_path_factory.mktemp("teacher")
    return real.write_tiny_checkpoint(
        folder, seed=4, num_hidden_layers=3, hidden_size=96, intermediate_size=192
    )


def test_the_advantage_is_w_a_minus_lambda_times_the_sampled_reverse_kl():
    advantages = torch.tensor([1.0, -0.5])
    student = torch.tensor([[-1.0, -2.0, -0.1], [-0.3, -0.2, -5.0]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -2.5, -0.1], [-1.3, -0.2, float("nan")]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    out = distillation_advantages(advantages, student, teacher, mask, kl_coef=0.5, task_weight=2)
    want = torch.tensor([[2 - 0.5 * (-0.5), 2 - 0.5 * 0.5, 0.0], [-1 - 0.5 * 1.0, -1 - 0.0, 0.0]])
    torch.testing.assert_close(out, want)
    assert not out.requires_grad  # an advantage carries no gradient
    mask[1, 2] = True
    with pytest.raises(ValueError, match=r"non-finite student or teacher log-prob .*\[1, 2\]"):
        distillation_advantages(advantages, student, teacher, mask, kl_coef=1, task_weight=1)


def test_pure_distillation_ignores_the_task():
    out = distillation_advantages(
        torch.tensor([3.0]),
        torch.tensor([[-1.0]]),
        torch.tensor([[-1.0]]),
        torch.tensor([[True]]),
        kl_coef=1.0,
        task_weight=0.0,
    )
    assert out.item() == 0.0


def _sample(prompt, response, in_loss=True) -> TrainSample:
    return TrainSample(
        prompt_ids=torch.tensor(prompt),
        response_ids=torch.tensor(response),
        rollout_logprobs=-torch.rand(len(response)),
        advantage=1.0,
        reward=1.0,
        in_loss=in_loss,
    )


def test_the_teacher_scores_every_response_token_as_a_direct_forward(teacher_dir):
    teacher = Teacher(TeacherConfig(loss_teacher=str(teacher_dir)), vocab_size=16)
    reference = InProcessEngine.from_pretrained(teacher_dir).model
    samples = [_sample([1, 5, 9], [3, 7, 2]), _sample([2], [4, 4, 8, 11]), _sample([6], [1], False)]
    metrics = teacher.annotate(samples)
    for s in samples:
        want = direct_logprobs(reference, s.prompt_ids.tolist(), s.response_ids.tolist())
        torch.testing.assert_close(s.teacher_logprobs, want, atol=1e-5, rtol=0)
    trained = samples[:2]  # the third is out of the loss
    logprobs = torch.cat([s.teacher_logprobs for s in trained])
    gaps = torch.cat([s.rollout_logprobs - s.teacher_logprobs for s in trained])
    assert metrics["teacher/logprob"] == pytest.approx(float(logprobs.mean()), abs=1e-6)
    assert metrics["teacher/reverse_kl_k1"] == pytest.approx(float(gaps.mean()), abs=1e-6)
    mb = merge_micro_batches([make_micro_batch(samples[:2], 0), make_micro_batch(samples[2:], 0)])
    assert mb.teacher_logprobs_BT[0, 2:5].tolist() == samples[0].teacher_logprobs.tolist()
    assert mb.teacher_logprobs_BT[1, 0:4].tolist() == samples[1].teacher_logprobs.tolist()
    assert mb.teacher_logprobs_BT[0, :2].abs().max() == 0  # prompt positions
    with pytest.raises(ValueError, match=r"samples \[1\] have no teacher log-probs"):
        make_micro_batch([samples[0], _sample([1], [2])], 0)


def test_scoring_does_not_move_the_runs_random_stream(teacher_dir):
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    Teacher(TeacherConfig(loss_teacher=str(teacher_dir)), vocab_size=16)
    assert torch.equal(torch.rand(3), want)


def test_refusals_name_the_flag_and_the_fix(teacher_dir, tmp_path):
    with pytest.raises(ValueError, match="neither an HF folder"):
        TeacherConfig(loss_teacher=str(tmp_path))
    with pytest.raises(ValueError, match="sglang:http://HOST:PORT"):
        TeacherConfig(loss_teacher="sglang:localhost:3000")
    with pytest.raises(ValueError, match="teacher_kl_coef"):
        TeacherConfig(loss_teacher=str(teacher_dir), teacher_kl_coef=-1)
    with pytest.raises(ValueError, match="pass --loss-teacher too"):
        TeacherConfig(teacher_task_weight=0.0)
    assert TeacherConfig(loss_teacher=str(teacher_dir)).kl_coef == 1.0
    with pytest.raises(ValueError, match="its vocabulary has 16 tokens, the student's 32"):
        Teacher(TeacherConfig(loss_teacher=str(teacher_dir)), vocab_size=32)
    teacher = TeacherConfig(loss_teacher=str(teacher_dir))
    for section, match in [
        ({"rollout": RolloutConfig(temperature=0.7)}, "--temperature"),
        ({"objective": ObjectiveConfig(loss="gspo")}, "one advantage per sequence"),
        ({"objective": ObjectiveConfig(opsm_delta=1e-4)}, "--opsm-delta"),
    ]:
        with pytest.raises(ValueError, match=match):
            TrainConfig(teacher=teacher, **section)
    TrainConfig(teacher=teacher, objective=ObjectiveConfig(loss="gspo_token"))
