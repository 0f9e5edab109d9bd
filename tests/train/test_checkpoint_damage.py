"""One rule for every kind of damage to the checkpoint a load takes, in both formats: a named
error (step folder, file, what is wrong, every step folder found, the flags that go on) that
modifies nothing, never a quiet load of an older step; ``--load-fallback`` loads the previous
step instead. Damage found without reading tensors also stops `resolve_load`, before the model
is built.

The model, its process group and a pristine checkpoint root per format (steps 1 and 2) are made
once for the module; each test damages a copy.
"""

from __future__ import annotations

import os
import shutil

import pytest
from train_state_testing import build_tiny, same_tensors, train_steps, weights

from megatron_rl.train.checkpoint.folders import CheckpointDamaged
from megatron_rl.train.checkpoint.load import load_training_state
from megatron_rl.train.checkpoint.save import save_training_state

STEP2 = "step_00000002"
WAYS_ON = r".*--load-fallback.*--load-ignore-existing"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(vocab size, model, optimizer) in a world-size-1 gloo group kept for the module."""
    from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed

    rdzv = tmp_path_factory.mktemp("rdzv") / "file"
    init_distributed(ParallelConfig(seed=5), init_method=f"file://{rdzv}", device="cpu")
    config, model, optimizer = build_tiny(seed=0)
    yield config.vocab_size, model, optimizer
    destroy_distributed()


@pytest.fixture(scope="module")
def pristine(tiny, tmp_path_factory) -> dict:
    """{fmt: (root with steps 1 and 2, the model's weights at step 1)}."""
    vocab, model, optimizer = tiny
    roots = {}
    for fmt in ("torch", "torch_dist"):
        root = tmp_path_factory.mktemp(fmt) / "ckpt"
        state = {"model": model, "optimizer": optimizer, "fmt": fmt}
        train_steps(model, optimizer, vocab, 1)
        save_training_state(str(root), 1, rl_state={"step": 1}, **state)
        step1 = weights(model)
        train_steps(model, optimizer, vocab, 1)
        save_training_state(str(root), 2, rl_state={"step": 2}, **state)
        roots[fmt] = (root, step1)
    return roots


def _data_file(step_dir) -> str:
    """The largest tensor file of a step folder: the model shard, or a ``*.distcp`` file."""
    names = [n for n in os.listdir(step_dir) if n.endswith((".distcp", ".pt"))]
    return max(names, key=lambda n: os.path.getsize(os.path.join(step_dir, n)))


def _flip_a_byte(step_dir) -> str:
    name = _data_file(step_dir)
    path = step_dir / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    return rf"{name} is corrupted: its sha256 \w+\.\.\. differs"


def _truncate_a_shard(step_dir) -> str:
    name = _data_file(step_dir)
    path = step_dir / name
    size = path.stat().st_size
    os.truncate(path, size // 2)
    return rf"{name} is truncated \({size // 2} bytes; {size} recorded at save\)"


def _break_the_manifest(step_dir) -> str:
    path = step_dir / "checkpoint.json"
    path.write_text(path.read_text()[:40])  # e.g. a disk that filled up while it was rewritten
    return r"checkpoint\.json is not valid JSON"


def _lose_the_manifest(step_dir) -> str:
    (step_dir / "checkpoint.json").unlink()
    return r"checkpoint\.json is missing"


def _lose_the_dcp_metadata(step_dir) -> str:
    (step_dir / ".metadata").unlink()
    return r"\.metadata is missing \(\d+ bytes recorded at save\)"


DAMAGE = {
    "flipped_byte": _flip_a_byte,
    "truncated_shard": _truncate_a_shard,
    "broken_manifest": _break_the_manifest,
    "lost_manifest": _lose_the_manifest,
    "missing_dcp_metadata": _lose_the_dcp_metadata,
}
CASES = [
    pytest.param(fmt, kind, id=f"{fmt}-{kind}")
    for fmt in ("torch", "torch_dist")
    for kind in DAMAGE
    if fmt == "torch_dist" or kind != "missing_dcp_metadata"
]


def _damaged_copy(pristine, tmp_path, fmt: str, kind: str):
    """(root whose step 2 has ``kind`` of damage, regex of its description, step-1 weights)."""
    source, step1 = pristine[fmt]
    root = tmp_path / "ckpt"
    shutil.copytree(source, root)
    return root, DAMAGE[kind](root / STEP2), step1


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "kind"), CASES)
def test_damage_to_the_latest_step_is_a_named_error_that_modifies_nothing(
    tiny, pristine, tmp_path, fmt, kind
):
    _, model, optimizer = tiny
    root, what, _ = _damaged_copy(pristine, tmp_path, fmt, kind)
    before = weights(model)
    with pytest.raises(CheckpointDamaged) as raised:
        load_training_state(str(root), model=model, optimizer=optimizer)
    message = str(raised.value)
    assert message.startswith(f"cannot load the checkpoint in {root}: {STEP2}: "), message
    expected = rf"{STEP2}: {what}.*{STEP2} \(named by latest\): {what}.*step_00000001: complete"
    assert raised.match(expected + WAYS_ON)
    assert same_tensors(weights(model), before)


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "kind"), CASES)
def test_damage_to_the_latest_step_with_load_fallback_loads_the_previous_step(
    tiny, pristine, tmp_path, fmt, kind
):
    _, model, optimizer = tiny
    root, _, step1 = _damaged_copy(pristine, tmp_path, fmt, kind)
    state = load_training_state(str(root), model=model, optimizer=optimizer, fallback=True)
    assert state == {"step": 1}
    assert same_tensors(weights(model), step1)


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "kind"), [c for c in CASES if "flipped_byte" not in c.id])
def test_damage_seen_without_reading_tensors_stops_resolve_load_before_the_model_is_built(
    pristine, tmp_path, fmt, kind
):
    from megatron_rl.train.config import TrainConfig
    from megatron_rl.train.run import resolve_load

    root, what, _ = _damaged_copy(pristine, tmp_path, fmt, kind)
    config = TrainConfig.from_flags(save=str(root), load=str(root))
    with pytest.raises(CheckpointDamaged, match=rf"{STEP2}: {what}{WAYS_ON}"):
        resolve_load(config)
    assert resolve_load(config.with_flags(load_fallback=True)) == (str(root), None)


def test_a_damaged_step_asked_for_by_its_folder_is_a_named_error_too(pristine, tmp_path):
    from megatron_rl.train.config import TrainConfig
    from megatron_rl.train.run import resolve_load

    root, what, _ = _damaged_copy(pristine, tmp_path, "torch", "truncated_shard")
    config = TrainConfig.from_flags(load=str(root / STEP2))
    with pytest.raises(CheckpointDamaged, match=rf"{STEP2}: {what}{WAYS_ON}"):
        resolve_load(config)


def test_latest_naming_a_step_without_a_folder_is_a_named_error(tiny, pristine, tmp_path):
    _, model, optimizer = tiny
    root, _, _ = _damaged_copy(pristine, tmp_path, "torch", "lost_manifest")
    shutil.rmtree(root / STEP2)
    with pytest.raises(
        CheckpointDamaged, match=r"step_00000002: the folder is missing.*latest names step 2"
    ):
        load_training_state(str(root), model=model, optimizer=optimizer)
    state = load_training_state(str(root), model=model, optimizer=optimizer, fallback=True)
    assert state == {"step": 1}
