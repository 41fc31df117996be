"""The traps of real training loops, each caught instead of silently changing the data: a peek
at a tracked loader, a ``set_epoch`` that drops the position, a ``ResumableSampler`` nothing
advances; and the epoch and the batch within it, public for epoch loops."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import crashproof as cp


def _loader(n: int = 40, batch: int = 4) -> DataLoader[tuple[torch.Tensor, ...]]:
    data = TensorDataset(torch.arange(n, dtype=torch.float32))
    return DataLoader(data, batch_size=batch, sampler=cp.ResumableSampler(n, seed=1))


def test_a_peek_at_a_tracked_loader_is_named_with_its_line() -> None:
    loader = _loader()
    state = cp.TrainState(data=loader)
    next(iter(loader))  # the tutorial's way of learning the batch size
    with pytest.warns(UserWarning, match="second iterator") as caught:
        for _ in loader:  # the epoch's loop: its first batch is the peek's next one
            break
    assert caught[0].filename == __file__  # the warning points at the loop's own line
    assert state.batch_in_epoch == 2


def test_epochs_iterated_to_their_end_and_restarted_loops_do_not_warn() -> None:
    loader = _loader()
    state = cp.TrainState(data=loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for epoch in range(3):
            loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            batches = sum(1 for _ in loader)
            assert batches == 10
        assert state.epoch == 3 and state.batch_in_epoch == 0


def test_set_epoch_that_would_drop_the_position_warns_and_the_same_epoch_keeps_it() -> None:
    loader = _loader()
    state = cp.TrainState(data=loader)
    it = iter(loader)
    for _ in range(3):
        next(it)
    tree = state.capture()
    # a resumed run: the checkpoint's epoch and batch are public
    resumed_loader = _loader()
    resumed = cp.TrainState(data=resumed_loader)
    resumed.restore(tree)
    assert (resumed.epoch, resumed.batch_in_epoch) == (0, 3)
    sampler = resumed_loader.sampler
    assert isinstance(sampler, cp.ResumableSampler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler.set_epoch(resumed.epoch)  # the epoch the checkpoint holds: kept
    assert resumed.batch_in_epoch == 3
    with pytest.warns(UserWarning, match=r"set_epoch\(1\) while at epoch 0, position 12 of 40"):
        sampler.set_epoch(1)
    assert (resumed.epoch, resumed.batch_in_epoch) == (1, 0)
    with pytest.warns(UserWarning, match="resume the epoch loop from sampler.epoch"):
        sampler.set_epoch(0)  # back to an earlier epoch: its data again


def test_a_sampler_given_alone_that_never_moves_is_reported_once(tmp_path: Path) -> None:
    sampler = cp.ResumableSampler(100, seed=3)
    state = cp.TrainState(data=sampler)
    state.capture()
    with pytest.warns(UserWarning, match="has not moved since the last save"):
        state.capture()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state.capture()  # once is enough
    # reported by the loop: no warning
    moving = cp.ResumableSampler(100, seed=3)
    state = cp.TrainState(data=moving)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            state.capture()
            moving.record_received(10)
    assert state.epoch == 0 and moving.position == 30


def _let_the_handler_run() -> None:
    """Sleep a moment in small steps: a signal's Python handler runs in the main thread at its
    next check, which a busy loop of a few bytecodes may finish before on a loaded machine
    (the kernel may deliver the signal to another thread, scheduled later)."""
    import time

    for _ in range(200):
        time.sleep(0.0025)


def test_ctrl_c_checkpoints_by_default_and_raises_keyboard_interrupt_when_asked(
    tmp_path: Path,
) -> None:
    import signal

    # A script starts with Python's own SIGINT handler; a pytest-xdist worker ignores SIGINT, and
    # an earlier test's manager left open may have left its handler: start as a script does.
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_in_a_script(tmp_path)
    finally:
        signal.signal(signal.SIGINT, found)


def _ctrl_c_in_a_script(tmp_path: Path) -> None:
    import os
    import signal

    state = cp.TrainState(model=torch.nn.Linear(2, 2))
    with cp.CheckpointManager(tmp_path / "a", async_save=False, on_interrupt="raise") as ckpt:
        with pytest.raises(KeyboardInterrupt):  # the script's own `except KeyboardInterrupt`
            os.kill(os.getpid(), signal.SIGINT)
            _let_the_handler_run()
        ckpt.maybe_save(1, state)  # no stop was requested
    with cp.CheckpointManager(tmp_path / "b", async_save=False) as ckpt:
        os.kill(os.getpid(), signal.SIGINT)  # recorded: a stop at the next step
        _let_the_handler_run()
        with pytest.raises(cp.PreemptedExit):
            ckpt.maybe_save(1, state)
    assert (tmp_path / "b" / "step_0000000001").is_dir()
    with pytest.raises(cp.ConfigError, match="on_interrupt='ignore'"):
        cp.CheckpointManager(tmp_path / "c", on_interrupt="ignore")  # type: ignore[arg-type]


def test_the_epoch_loop_example_resumes_mid_epoch_bit_for_bit(tmp_path: Path) -> None:
    from tests.conftest import EXAMPLES, run_python

    script = str(EXAMPLES / "train_epochs.py")
    run_python([script, "--dir", str(tmp_path / "straight"), "--epochs", "3"])
    crashed = str(tmp_path / "crashed")
    for crash_at in ("23", "101"):  # mid-epoch (64 batches an epoch), in the first and second
        proc = run_python([script, "--dir", crashed, "--epochs", "3", "--crash-at", crash_at],
                          check=False)  # fmt: skip
        assert proc.returncode == 3, proc.stderr
    proc = run_python([script, "--dir", crashed, "--epochs", "3"])
    assert "crashproof: resumed from checkpoint step" in proc.stderr  # said, by default
    expected = torch.load(tmp_path / "straight" / "final.pt")
    final = torch.load(tmp_path / "crashed" / "final.pt")
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_a_value_is_shared_by_the_loop_and_its_checkpoints(tmp_path: Path) -> None:
    lstm = torch.nn.LSTM(3, 4)
    hidden = cp.Value((torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)))  # carried batch to batch
    lr = cp.Value(20.0)
    state = cp.TrainState(model=lstm, extra={"lr": lr, "hidden": hidden})
    with cp.CheckpointManager(tmp_path, async_save=False) as ckpt:
        _, hidden.value = lstm(torch.randn(5, 2, 3), hidden.value)
        lr.value /= 4.0  # the loop's anneal: the checkpoint sees it, no copy to update
        ckpt.save(1, state)
        saved = tuple(t.clone() for t in hidden.value)
        lr.value, hidden.value = 1.0, (torch.ones(1, 2, 4), torch.ones(1, 2, 4))
        assert ckpt.restore(state) == 1
    assert lr.value == 5.0 and isinstance(hidden.value, tuple)
    assert all(torch.equal(a, b) for a, b in zip(hidden.value, saved, strict=True))


def test_an_index_loop_with_an_annealed_lr_and_a_carried_hidden_state_resumes_exactly(
    tmp_path: Path,
) -> None:
    """word_language_model's loop shape (examples/train_words.py), killed mid-epoch and across an
    epoch's anneal, ends bit for bit where an uninterrupted run ends."""
    from tests.conftest import EXAMPLES, run_python

    script, epochs = str(EXAMPLES / "train_words.py"), ["--epochs", "2"]  # one anneal between
    straight = run_python([script, "--dir", str(tmp_path / "straight"), *epochs])
    crashed = str(tmp_path / "crashed")
    for crash_at in ("50", "130"):  # 100 batches an epoch: in the first, then in the second
        proc = run_python([script, "--dir", crashed, *epochs, "--crash-at", crash_at], check=False)
        assert proc.returncode == 3, proc.stderr
    resumed = run_python([script, "--dir", crashed, *epochs])
    assert resumed.stdout.splitlines()[-1] == straight.stdout.splitlines()[-1]  # lr, loss
    expected = torch.load(tmp_path / "straight" / "final.pt")
    final = torch.load(tmp_path / "crashed" / "final.pt")
    assert all(torch.equal(final[k], expected[k]) for k in expected)
