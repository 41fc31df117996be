"""Promise: nothing non-finite is committed, anywhere in the optimizer, and metadata is plain JSON.

With ``check_finite=True`` (the default) every floating tensor and every float of the optimizer's
state and param groups is checked, at any nesting depth: LBFGS keeps tensors in lists
(``old_dirs``, ``old_stps``, ``ro``) and its loss as a Python float, a learning rate can be NaN
or a tensor. A save holding NaN or inf there raises :class:`NonFiniteStateError` and commits
nothing. ``save(..., metadata=)`` that is not plain JSON (NaN, a NumPy scalar, a tensor) is
refused at the call, naming the key, before anything is written.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from crashproof import CheckpointManager, ConfigError, NonFiniteStateError, TrainState
from crashproof.checkpoint.format._user_metadata import checked_metadata

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny tensors: a second OpenMP thread only spins against the other test processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _lbfgs() -> tuple[nn.Module, torch.optim.LBFGS]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=4, max_iter=3)
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        return loss

    for _ in range(2):
        optimizer.step(closure)  # type: ignore[arg-type]
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    assert state["old_dirs"] and state["ro"] and isinstance(state["prev_loss"], float)
    return model, optimizer


def _adamw() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _lbfgs_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return optimizer.state[optimizer.param_groups[0]["params"][0]]


def _poison_tensor_in_list(key: str, value: float) -> Callable[[torch.optim.Optimizer], str]:
    def poison(optimizer: torch.optim.Optimizer) -> str:
        tensors = _lbfgs_state(optimizer)[key]
        tensors[-1].view(-1)[0] = value
        return f"optimizer/state/0/{key}/{len(tensors) - 1}"

    return poison


def _poison_float(key: str, value: float) -> Callable[[torch.optim.Optimizer], str]:
    def poison(optimizer: torch.optim.Optimizer) -> str:
        _lbfgs_state(optimizer)[key] = value
        return f"optimizer/state/0/{key}"

    return poison


def _poison_group(
    key: str, value: Any, name: str | None = None
) -> Callable[[torch.optim.Optimizer], str]:
    def poison(optimizer: torch.optim.Optimizer) -> str:
        optimizer.param_groups[0][key] = value
        return f"optimizer/param_groups/0/{name or key}"

    return poison


def _poison_nested(optimizer: torch.optim.Optimizer) -> str:
    """A custom optimizer's state: a dict in a list in a dict, four levels down."""
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    state["history"] = [{"ema": torch.zeros(2)}, {"ema": torch.tensor([1.0, INF])}]
    return "optimizer/state/0/history/1/ema"


LBFGS_CASES = [
    pytest.param(_poison_tensor_in_list("old_dirs", NAN), id="lbfgs-old_dirs-nan"),
    pytest.param(_poison_tensor_in_list("old_stps", INF), id="lbfgs-old_stps-inf"),
    pytest.param(_poison_tensor_in_list("ro", -INF), id="lbfgs-ro-neg-inf"),
    pytest.param(_poison_float("prev_loss", NAN), id="lbfgs-prev_loss-nan"),
    pytest.param(_poison_float("t", INF), id="lbfgs-t-inf"),
    pytest.param(_poison_group("lr", NAN), id="lr-nan"),
    pytest.param(_poison_group("lr", torch.tensor(INF)), id="lr-tensor-inf"),
    pytest.param(_poison_group("tolerance_change", np.float64(NAN)), id="group-numpy-nan"),
    pytest.param(_poison_nested, id="nested-four-deep"),
]


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("poison", LBFGS_CASES)
def test_nan_or_inf_anywhere_in_the_optimizer_is_refused_and_nothing_is_committed(
    tmp_path: Path, poison: Callable[[torch.optim.Optimizer], str], async_save: bool
) -> None:
    model, optimizer = _lbfgs()
    state = TrainState(model=model, optimizer=optimizer)
    with CheckpointManager(tmp_path, async_save=async_save, handle_signals=False) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        name = poison(optimizer)
        with pytest.raises(NonFiniteStateError, match=name.replace(".", r"\.")):
            ckpt.save(2, state)
            ckpt.wait()
        assert [info.step for info in ckpt.list()] == [1]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "step_0000000001"
    ]


def test_a_nan_learning_rate_in_adamw_is_refused(tmp_path: Path) -> None:
    model, optimizer = _adamw()
    optimizer.param_groups[0]["lr"] = NAN
    with CheckpointManager(tmp_path, handle_signals=False) as ckpt:
        with pytest.raises(NonFiniteStateError, match=r"optimizer/param_groups/0/lr.*nan"):
            ckpt.save(1, TrainState(model=model, optimizer=optimizer))
            ckpt.wait()
        assert ckpt.list() == []


def test_nan_in_a_beta_tuple_is_refused(tmp_path: Path) -> None:
    model, optimizer = _adamw()
    optimizer.param_groups[0]["betas"] = (0.9, NAN)
    with (
        CheckpointManager(tmp_path, handle_signals=False) as ckpt,
        pytest.raises(NonFiniteStateError, match=r"optimizer/param_groups/0/betas/1"),
    ):
        ckpt.save(1, TrainState(model=model, optimizer=optimizer))
        ckpt.wait()


def test_finite_lbfgs_state_is_saved_and_restored_bit_for_bit(tmp_path: Path) -> None:
    """(The control: the poisoned cases fail only because of the poison.)"""
    model, optimizer = _lbfgs()
    with CheckpointManager(tmp_path, async_save=False, handle_signals=False) as ckpt:
        ckpt.save(1, TrainState(model=model, optimizer=optimizer))
    target_model, target = _lbfgs()
    with torch.no_grad():
        target_model.weight.add_(1.0)
    with CheckpointManager(tmp_path, handle_signals=False) as ckpt:
        assert ckpt.restore(TrainState(model=target_model, optimizer=target)) == 1
    saved, restored = _lbfgs_state(optimizer), _lbfgs_state(target)
    for key in ("old_dirs", "old_stps", "ro"):
        assert all(torch.equal(a, b) for a, b in zip(saved[key], restored[key], strict=True))
    assert restored["prev_loss"] == saved["prev_loss"]


def test_the_check_can_be_turned_off_for_optimizer_floats_too(tmp_path: Path) -> None:
    model, optimizer = _lbfgs()
    _lbfgs_state(optimizer)["prev_loss"] = NAN
    optimizer.param_groups[0]["lr"] = INF
    with CheckpointManager(tmp_path, check_finite=False, handle_signals=False) as ckpt:
        ckpt.save(1, TrainState(model=model, optimizer=optimizer))
        assert ckpt.wait() is not None


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
)
def test_nan_in_a_float8_parameter_is_refused(tmp_path: Path, dtype: torch.dtype) -> None:
    model = nn.Linear(4, 4)
    model.weight.data = model.weight.data.to(dtype)
    state = TrainState(model=model)
    with CheckpointManager(tmp_path, handle_signals=False) as ckpt:
        ckpt.save(1, state)  # finite (448 and 57344, the formats' largest, included)
        assert ckpt.wait() is not None
        model.weight.data.view(-1)[5] = NAN
        ckpt.save(2, state)
        with pytest.raises(NonFiniteStateError, match=r"'model/weight' holds 1 NaN"):
            ckpt.wait()


def test_the_largest_finite_float8_values_are_not_refused(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    model.weight.data = torch.tensor([[448.0, -448.0], [0.0, -0.0]]).to(torch.float8_e4m3fn)
    model.bias.data = torch.tensor([57344.0, -57344.0]).to(torch.float8_e5m2)
    with CheckpointManager(tmp_path, handle_signals=False) as ckpt:
        ckpt.save(1, TrainState(model=model))
        assert ckpt.wait() is not None


# -- metadata: plain JSON, refused at the call ------------------------------------------------

BAD_METADATA = [
    pytest.param({"val_loss": NAN}, "'val_loss'", id="nan"),
    pytest.param({"val_loss": -INF}, "'val_loss'", id="neg-inf"),
    pytest.param({"val_loss": np.float32(0.5)}, "'val_loss'", id="numpy-float32"),
    pytest.param({"val_loss": np.float64(0.5)}, "'val_loss'", id="numpy-float64-a-float-subclass"),
    pytest.param({"tokens": np.int64(5)}, "'tokens'", id="numpy-int"),
    pytest.param({"val_loss": torch.tensor(0.5)}, "'val_loss'", id="tensor"),
    pytest.param({"shape": (1, 2)}, "'shape'", id="tuple"),
    pytest.param({"history": [1.0, 2.0, NAN]}, r"'history'\]\[2\]", id="nan-in-a-list"),
    pytest.param({"eval": {"acc": np.float16(1)}}, r"'eval'\]\['acc'\]", id="numpy-in-a-dict"),
    pytest.param({"by_epoch": {1: 0.5}}, "'by_epoch'", id="int-key"),
    pytest.param({"when": object()}, "'when'", id="object"),
    pytest.param({"data": b"raw"}, "'data'", id="bytes"),
]


@pytest.mark.parametrize(("metadata", "key"), BAD_METADATA)
def test_metadata_that_is_not_plain_json_is_refused_at_the_call(
    metadata: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConfigError, match=key):
        checked_metadata(metadata, step=3)


@pytest.mark.parametrize(("metadata", "key"), BAD_METADATA[:6])
def test_save_refuses_such_metadata_before_writing_anything(
    tmp_path: Path, metadata: dict[str, Any], key: str
) -> None:
    state = TrainState(model=nn.Linear(2, 2))
    with CheckpointManager(tmp_path, handle_signals=False) as ckpt:
        with pytest.raises(ConfigError, match=key):
            ckpt.save(1, state, metadata=metadata)  # at the call: no wait() needed
        assert ckpt.stats.saves_started == 0
        ckpt.save(2, state, metadata={"val_loss": 0.5})  # the manager goes on working
        ckpt.wait()
        assert [info.step for info in ckpt.list()] == [2]


def test_plain_json_metadata_is_kept_as_a_copy() -> None:
    metadata = {"val_loss": 0.25, "n": 3, "ok": True, "tag": None, "hist": [1, {"a": "b"}]}
    copied = checked_metadata(metadata)
    assert copied == metadata
    metadata["hist"].append(2)  # type: ignore[attr-defined]
    assert copied["hist"] == [1, {"a": "b"}]  # a save in flight keeps what was passed
    assert checked_metadata(None) == {}
    assert not math.isnan(copied["val_loss"])


# -- metadata the JSON writer or a reader could not handle: refused at the call too -----------


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


UNWRITABLE_METADATA = [
    pytest.param({"tokens": 10**5000}, "'tokens'.*5001 digits", id="int-over-4300-digits"),
    pytest.param({"tokens": -(10**4300)}, "'tokens'.*4301 digits", id="negative-int-4301-digits"),
    pytest.param({"hist": [1, 2**20000]}, r"'hist'\]\[1\]", id="huge-int-in-a-list"),
    pytest.param({"deep": _nested(40)}, "nested deeper", id="nested-40-deep"),
    pytest.param({"blob": "x" * (1 << 20)}, "over 1048576 bytes", id="one-string-over-1-mib"),
    pytest.param({"n": list(range(300_000))}, "over 1048576 bytes", id="many-small-values"),
    pytest.param({"s": "\u00e9" * 200_000}, "over 1048576 bytes", id="escapes-over-1-mib"),
    pytest.param({"k" * (1 << 20): 1}, "over 1048576 bytes", id="a-key-over-1-mib"),
]


@pytest.mark.parametrize(("metadata", "match"), UNWRITABLE_METADATA)
def test_metadata_the_json_writer_cannot_write_is_refused_at_the_call(
    metadata: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        checked_metadata(metadata, step=3)


def test_a_huge_int_in_metadata_fails_the_save_call_not_the_background_write(
    tmp_path: Path,
) -> None:
    """The review's r10: it passed the call and failed later as CheckpointWriteError."""
    state = TrainState(model=nn.Linear(2, 2))
    with CheckpointManager(tmp_path, async_save=True, handle_signals=False) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        with pytest.raises(ConfigError, match=r"'tokens'.*refuse more than 4300"):
            ckpt.save(2, state, metadata={"tokens": 10**5000})
        assert ckpt.stats.saves_started == 1
        ckpt.save(3, state, metadata={"tokens": 10**4300 - 1})  # the largest that reads back
        assert ckpt.wait() is not None
        assert sorted(info.step for info in ckpt.list()) == [1, 3]
    manifest = json.loads((tmp_path / "step_0000000003" / "manifest.json").read_bytes())
    assert manifest["metadata"]["tokens"] == 10**4300 - 1


def test_the_int_bound_follows_a_lower_limit_set_in_this_process() -> None:
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(1000)
    try:
        with pytest.raises(ConfigError, match="refuse more than 1000"):
            checked_metadata({"n": 10**1000})
        checked_metadata({"n": 10**1000 - 1})
    finally:
        sys.set_int_max_str_digits(before)
    sys.set_int_max_str_digits(0)  # no limit here: readers elsewhere still have the default
    try:
        with pytest.raises(ConfigError, match="refuse more than 4300"):
            checked_metadata({"n": 10**4300})
    finally:
        sys.set_int_max_str_digits(before)


def test_metadata_at_the_bounds_is_kept() -> None:
    big = {"blob": "x" * ((1 << 20) - 11)}  # {"blob":"..."} is 1 MiB exactly
    assert len(json.dumps(big, separators=(",", ":"))) == 1 << 20
    assert checked_metadata(big) == big
    deep = _nested(32)
    assert checked_metadata(deep) == deep


class _Renamed(nn.Module):
    """A compatibility layer: its state dict names the parameter ``w``, or holds a copy of it."""

    def __init__(self, *, copy: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.register_buffer("mask", torch.full((3,), -INF))  # infinities by design: allowed

        def rename(module: nn.Module, sd: dict[str, Any], prefix: str, local: Any) -> None:
            weight = sd.pop(prefix + "weight")
            sd[prefix + "w"] = weight.double() if copy else weight

        def back(sd: dict[str, Any], prefix: str, *args: Any) -> None:
            sd[prefix + "weight"] = sd.pop(prefix + "w").float()

        self._register_state_dict_hook(rename)
        self._register_load_state_dict_pre_hook(back)


@pytest.mark.parametrize("copy", [False, True], ids=["renamed", "renamed-copy"])
def test_a_parameter_saved_under_another_name_is_still_checked(tmp_path: Path, copy: bool) -> None:
    """What is committed is checked, not what named_parameters() calls it."""
    model = _Renamed(copy=copy)
    with CheckpointManager(tmp_path, async_save=False, handle_signals=False) as manager:
        manager.save(1, TrainState(model=model))  # the -inf buffer is no reason to refuse
        with torch.no_grad():
            model.weight[1] = NAN
        with pytest.raises(NonFiniteStateError, match="model/w"):
            manager.save(2, TrainState(model=model))

    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_0000000001"]
