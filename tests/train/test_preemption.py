"""Stop signals set a flag that every rank agrees on; the old handlers come back on exit."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import pytest
import torch.distributed as dist

from megatron_rl.train.preemption import PreemptionHandler


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_flag_instead_of_killing_the_process(sig):
    with PreemptionHandler() as handler:
        assert not handler.requested and not handler.agreed()
        os.kill(os.getpid(), sig)
        assert handler.requested
        assert handler.agreed()


def test_previous_handlers_are_restored_on_exit():
    calls = []

    def previous(signum, frame):
        calls.append(signum)

    old_term = signal.signal(signal.SIGTERM, previous)
    old_usr1 = signal.getsignal(signal.SIGUSR1)
    try:
        with PreemptionHandler():
            assert signal.getsignal(signal.SIGTERM) is not previous
        assert signal.getsignal(signal.SIGTERM) is previous
        assert signal.getsignal(signal.SIGUSR1) == old_usr1
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old_term)


def test_request_without_signal_and_outside_main_thread():
    result = {}

    def body():
        with PreemptionHandler() as handler:
            result["before"] = handler.requested
            handler.request()
            result["after"] = handler.agreed()

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert result == {"before": False, "after": True}


def _agree_worker(rank, world_size, init_method, tmp_dir):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        handler = PreemptionHandler()
        first = handler.agreed()
        if rank == 1:
            handler.request()
        second = handler.agreed()
        with open(os.path.join(tmp_dir, f"agreed{rank}.txt"), "w") as out:
            out.write(f"{first} {second} {handler.requested}")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_stop_requested_on_one_rank_is_agreed_by_all(tmp_path):
    # fork: the workers only run gloo collectives on 1-element tensors, and start in ms.
    context = multiprocessing.get_context("fork")
    init_method = f"file://{tmp_path}/rendezvous"
    workers = [
        context.Process(target=_agree_worker, args=(rank, 2, init_method, str(tmp_path)))
        for rank in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert [w.exitcode for w in workers] == [0, 0]
    for rank in range(2):
        assert (tmp_path / f"agreed{rank}.txt").read_text() == "False True True"


def _sigterm_the_cli_once_it_logs(flags: list[str], marker: str, env: dict, settle_s: float = 0.0):
    """Run ``python -m megatron_rl.train`` with ``flags``; once its log shows ``marker`` (and
    ``settle_s`` later) send SIGTERM. Returns (exit code, seconds from the signal to the exit,
    the log after the marker). A child that never logs the marker fails, not hangs."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    child = subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.train", "--device", "cpu", *flags],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    deadline = threading.Timer(120, child.kill)
    deadline.start()
    try:
        lines = []
        for line in child.stderr:
            lines.append(line)
            if marker in line:
                break
        assert any(marker in line for line in lines), "".join(lines)
        time.sleep(settle_s)
        sent = time.monotonic()
        child.send_signal(signal.SIGTERM)
        rest = child.communicate(timeout=60)[1]
        return child.returncode, time.monotonic() - sent, rest
    finally:
        deadline.cancel()
        child.kill()


@pytest.mark.slow
def test_the_cli_waiting_for_servers_that_never_come_up_stops_within_seconds_of_sigterm(tmp_path):
    """SLURM preemption, a launcher's trap and ``timeout`` stop a run with SIGTERM; a trainer
    still waiting for its SGLang servers to load must not sit out --sglang-startup-timeout. Its
    log says what it waits for from the first failed probe. (Port 9, discard: nothing answers.)"""
    flags = [
        "--rollout-engine", "sglang", "--sglang-url", "http://127.0.0.1:9",
        "--sglang-startup-timeout", "600", "--run-dir", str(tmp_path / "run"), "--train-iters", "1",
    ]  # fmt: skip
    _, waited, rest = _sigterm_the_cli_once_it_logs(flags, "waiting for SGLang servers", env={})
    assert waited < 10, waited
    assert "stop signal while waiting for SGLang servers" in rest, rest[-2000:]


@pytest.mark.slow
def test_the_cli_waiting_at_the_rendezvous_for_a_rank_that_never_comes_exits_on_sigterm(tmp_path):
    """Rank 0 of 2 under torchrun's environment, rank 1 never started: it waits in C inside
    ``init_process_group``, where Python's handler cannot run. SIGTERM ends it ~5 s later (the
    grace) with 143, not at the store's 30-minute timeout; its log said what it waits for
    first. MASTER_PORT=0: rank 0 hosts the store on a port the OS picks (no shared port)."""
    env = {
        "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
    }  # fmt: skip
    flags = ["--run-dir", str(tmp_path / "run"), "--train-iters", "1"]
    code, waited, rest = _sigterm_the_cli_once_it_logs(flags, "joining 2 ranks", env, settle_s=1)
    assert code == 143, rest[-2000:]
    assert waited < 15, waited
    expected = "SIGTERM while waiting for the rendezvous of 2 ranks (rank 0): still waiting"
    assert expected in rest, rest[-2000:]
