"""Stateful and streaming data killed and resumed: a Hugging Face map-style ``Dataset`` over
``ResumableSampler``, a Hugging Face streaming ``IterableDataset`` and a plain torch
``IterableDataset`` keeping each worker's position, both through torchdata's
``StatefulDataLoader`` with two worker processes. A run SIGKILLed after a step and run again
trains on the same samples, step by step, and ends with the same weights, bit for bit, as a run
never stopped (:mod:`tests.state.streaming_trainer`). Then what a Hugging Face streaming dataset's
own state does not bring back: read in the main process it would replay its saved position at
every later epoch (crashproof drops it), shuffled with a buffer it cannot resume exactly (said at
construction)."""

from __future__ import annotations

import json
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import crashproof as cp
from tests.conftest import run_python
from tests.state.streaming_trainer import EVERY, SOURCES, N

datasets = pytest.importorskip("datasets")
stateful = pytest.importorskip("torchdata.stateful_dataloader")
pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")  # torchdata, torch 2.13

TRAINER = Path(__file__).with_name("streaming_trainer.py")


def _records(out: Path, source: str) -> dict[int, list[int]]:
    """The sample ids of each step (a resumed run's later record of a step is the one that counts)."""
    records: dict[int, list[int]] = {}
    for line in (out / f"{source}.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record["ids"]
    return records


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """One run of every source, never stopped: one process (the runs are independent), shared
    by the test workers of a session."""
    from filelock import FileLock  # (a requirement of datasets)

    shared = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):  # a pytest-xdist worker: the session's directory
        shared = shared.parent
    out = shared / "streaming_uninterrupted"
    with FileLock(f"{out}.lock"):
        if not (out / "done").exists():
            out.mkdir(exist_ok=True)
            run_python([str(TRAINER), str(out), str(out), ",".join(SOURCES)])
            (out / "done").touch()
    return out


@pytest.mark.parametrize(
    ("source", "kill_after"),
    [
        ("hf-map", 18),  # in the second epoch
        ("hf-stream", 10),  # mid-epoch
        ("hf-stream", 16),  # the epoch's last batch received, its end not yet seen
        ("iterable", 14),
    ],
)
def test_a_killed_run_resumes_bit_identical(
    uninterrupted: Path, tmp_path: Path, source: str, kill_after: int
) -> None:
    args = [str(TRAINER), str(tmp_path), str(tmp_path), source]
    killed = run_python([*args, "--kill-after", str(kill_after)], check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = run_python(args)
    saved = kill_after - kill_after % EVERY
    assert f"{source}: resumed at step {saved}" in resumed.stdout, resumed.stdout

    expected = _records(uninterrupted, source)
    assert sorted(i for step in range(1, 17) for i in expected[step]) == list(range(N))
    assert _records(tmp_path, source) == expected
    weights = torch.load(tmp_path / f"{source}.pt")
    reference = torch.load(uninterrupted / f"{source}.pt")
    assert [k for k in reference if not torch.equal(reference[k], weights[k])] == []


def _stream(*, shuffled: bool = False) -> Any:
    rows = datasets.Dataset.from_dict({"id": list(range(N))})
    stream = rows.to_iterable_dataset(num_shards=4)
    if shuffled:
        stream = stream.shuffle(seed=3, buffer_size=8)
    return stream.with_format("torch")


def _epochs(loader: Any, epochs: int) -> list[list[int]]:
    return [batch["id"].tolist() for _ in range(epochs) for batch in loader]


@pytest.mark.parametrize("taken", [3, 16, 17])  # mid-epoch, all received, the end seen
def test_a_streaming_dataset_read_in_the_main_process_starts_later_epochs_at_their_start(
    taken: int,
) -> None:
    """``datasets`` keeps a loaded position and applies it again at each later epoch (each would
    restart at the saved position, or be empty): crashproof drops it once the resumed epoch
    has started."""
    expected = _epochs(stateful.StatefulDataLoader(_stream(), batch_size=4), 3)
    loader = stateful.StatefulDataLoader(_stream(), batch_size=4)
    received: list[list[int]] = []
    batches = iter(loader)
    while len(received) < min(taken, 16):
        received.append(next(batches)["id"].tolist())
    if taken > 16:
        with pytest.raises(StopIteration):
            next(batches)
    tree = cp.TrainState(data=loader).capture()
    assert tree["data"]["_iterator_finished"] is (taken > 16)

    resumed = stateful.StatefulDataLoader(_stream(), batch_size=4)
    cp.TrainState(data=resumed).restore(tree)
    assert received + _epochs(resumed, 2 if taken > 16 else 3) == expected


def test_a_buffer_shuffled_streaming_dataset_is_said_to_resume_inexactly() -> None:
    with pytest.warns(UserWarning, match=r"shuffled with a buffer \(.shuffle\(buffer_size=8\)\)"):
        cp.TrainState(data=stateful.StatefulDataLoader(_stream(shuffled=True), batch_size=4))
    with pytest.warns(UserWarning, match="may see others twice"):
        cp.TrainState(data=_stream(shuffled=True))
    unshuffled = stateful.StatefulDataLoader(_stream(), batch_size=4)
    shuffled_first = datasets.Dataset.from_dict({"id": list(range(N))}).shuffle(seed=3)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        cp.TrainState(data=unshuffled)
        cp.TrainState(data=shuffled_first.to_iterable_dataset(num_shards=4))
    assert [str(w.message) for w in said if "TrainState" in str(w.message)] == []


def test_what_a_buffer_shuffled_streaming_dataset_loses_on_resume() -> None:
    """Why the warning: the resumed run skips the samples its buffer held, sees others twice and
    draws another order (datasets does not save the buffer)."""
    loader = stateful.StatefulDataLoader(_stream(shuffled=True), batch_size=4)
    expected = _epochs(loader, 1)
    loader = stateful.StatefulDataLoader(_stream(shuffled=True), batch_size=4)
    batches = iter(loader)
    received = [next(batches)["id"].tolist() for _ in range(5)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = cp.TrainState(data=loader)
        tree = state.capture()
        resumed = stateful.StatefulDataLoader(_stream(shuffled=True), batch_size=4)
        cp.TrainState(data=resumed).restore(tree)
    rest = _epochs(resumed, 1)
    assert received == expected[:5]
    assert rest != expected[5:]
    seen = [i for batch in received + rest for i in batch]
    assert len(set(seen)) < N  # skipped
    assert len(set(seen)) < len(seen)  # repeated
