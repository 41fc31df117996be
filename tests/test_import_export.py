"""``crashproof import`` and ``crashproof export --format hf`` against real files made here: a
training loop's ``torch.save`` dict, a bare state dict, a Lightning-style checkpoint, a tiny GPT-2
``save_pretrained`` directory and a Trainer ``checkpoint-N`` directory; and hostile ones (a
pickle whose ``__reduce__`` would run code, truncated files, a directory holding nothing known).

The round trip is checked bit for bit: import, restore into a live model (and optimizer,
scheduler), export as a save_pretrained directory, ``from_pretrained``. The command runs
in-process (each process imports torch) but once, through the console script.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import crashproof
from crashproof.cli import main

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download
transformers = pytest.importorskip("transformers")

TINY = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 100, "n_positions": 64}


@pytest.fixture(autouse=True)
def _keep_sigpipe() -> Iterator[None]:
    """``main`` resets SIGPIPE to the default; give pytest its handler back."""
    saved = signal.getsignal(signal.SIGPIPE)
    yield
    signal.signal(signal.SIGPIPE, saved)


def run(*args: str | Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def small() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    """A model trained two steps with AdamW and a StepLR: every part has state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    torch.manual_seed(1)  # other weights than small()'s
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit-identical state dicts (nested: an optimizer's too)."""
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif isinstance(x, dict):
            if not (isinstance(y, dict) and same(x, y)):
                return False
        elif x != y:
            return False
    return True


def restore(root: Path, **parts: Any) -> int:
    with crashproof.CheckpointManager(str(root), read_only=True) as manager:
        return manager.restore(crashproof.TrainState(**parts))


def steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step_*"))


# -- torch.save files ----------------------------------------------------------------------------


def test_a_training_loops_dict_restores_bit_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, opt, sched = small()
    src = tmp_path / "loop.pt"
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(),
         "scheduler": sched.state_dict(), "epoch": 3, "global_step": 17},
        src,
    )  # fmt: skip
    root = tmp_path / "root"
    code, out, err = run("import", src, root, capsys=capsys)
    assert code == 0, err
    assert "as step 17 ('global_step'" in out and "model (4 tensors" in out
    m2, o2, s2 = fresh()
    extra = {"epoch": 0}
    assert restore(root, model=m2, optimizer=o2, scheduler=s2, extra=extra) == 17
    assert same(m2.state_dict(), model.state_dict())
    assert same(o2.state_dict(), opt.state_dict())
    assert s2.state_dict() == sched.state_dict()
    assert extra == {"epoch": 3}
    assert run("verify", root, capsys=capsys)[0] == 0
    code, out, _ = run("inspect", root, "--json", capsys=capsys)
    imported = json.loads(out)["manifest"]["metadata"]["imported_from"]
    assert imported["source"] == str(src) and imported["step_from"].startswith("'global_step'")


def test_a_bare_state_dict_at_a_given_step_and_never_over_a_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, _, _ = small()
    src = tmp_path / "weights.pth"
    torch.save(model.state_dict(), src)
    root = tmp_path / "root"
    code, out, err = run("import", src, root, "--step", "5", "--json", capsys=capsys)
    assert code == 0, err
    done = json.loads(out)
    assert (done["step"], done["step_from"], done["parts"]) == (5, "--step", ["model"])
    before = (root / "step_0000000005" / "manifest.json").read_bytes()
    code, _, err = run("import", src, root, "--step", "5", capsys=capsys)
    assert code == 2 and "holds a checkpoint of step 5 already" in err
    assert (root / "step_0000000005" / "manifest.json").read_bytes() == before
    code, out, _ = run("import", src, root, capsys=capsys)  # no step recorded: 0
    assert code == 0 and "as step 0 (the source records no step)" in out
    assert "root holds later steps (5)" in out
    code, _, err = run("import", src, root, "--step", "-3", capsys=capsys)
    assert code == 2 and "--step" in err
    m2, _, _ = fresh()
    assert restore(root, model=m2) == 5 and same(m2.state_dict(), model.state_dict())
    assert steps(root) == [0, 5]


def test_a_lightning_checkpoint_maps_its_parts_and_strips_a_prefix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, opt, sched = small()
    src = tmp_path / "epoch=2-step=40.ckpt"
    torch.save(
        {
            "epoch": 2, "global_step": 40, "pytorch-lightning_version": "2.6.6",
            "state_dict": {f"net.{k}": v for k, v in model.state_dict().items()},
            "optimizer_states": [opt.state_dict()], "lr_schedulers": [sched.state_dict()],
            "hyper_parameters": {"lr": 0.1, "hidden": 8},
            "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 2}}}},
        },
        src,
    )  # fmt: skip
    root = tmp_path / "root"
    code, out, err = run("import", src, root, "--strip-prefix", "net.", capsys=capsys)
    assert code == 0, err
    assert "Lightning checkpoint" in out and "as step 40" in out
    assert "extras: epoch, hyper_parameters, loops, pytorch-lightning_version" in out
    m2, o2, s2 = fresh()
    hparams: dict[str, Any] = {"hyper_parameters": {}}
    restore(root, model=m2, optimizer=o2, scheduler=s2, extra=hparams)
    assert same(m2.state_dict(), model.state_dict()) and same(o2.state_dict(), opt.state_dict())
    assert hparams["hyper_parameters"] == {"lr": 0.1, "hidden": 8}
    code, _, err = run("import", src, tmp_path / "r2", "--strip-prefix", "model.", capsys=capsys)
    assert code == 2 and "no tensor name" in err and "net.0.bias" in err


class RunsCode:
    """What a hostile pickle holds: unpickling it would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused_without_running_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "ran"
    model, _, _ = small()
    root = tmp_path / "root"
    torch.save(model.state_dict(), tmp_path / "ok.pt")
    assert run("import", tmp_path / "ok.pt", root, "--step", "1", capsys=capsys)[0] == 0
    # torch.save's zip format, and a plain pickle (torch.load's legacy path)
    torch.save({"model": model.state_dict(), "x": RunsCode(marker)}, tmp_path / "evil.pt")
    (tmp_path / "raw.bin").write_bytes(pickle.dumps({"w": RunsCode(marker)}))
    for name in ("evil.pt", "raw.bin"):
        code, out, err = run("import", tmp_path / name, root, "--step", "2", capsys=capsys)
        assert code == 2, err
        assert name in err and "--trust-pickle" in err and out == ""
        if name == "evil.pt":  # torch names what the pickle would call
            assert "(it calls posix.system)" in err
    assert not marker.exists()
    assert steps(root) == [1]
    assert run("verify", root, capsys=capsys)[0] == 0
    # A whole pickled module: only with --trust-pickle, after a warning.
    torch.save(model, tmp_path / "whole.pt")
    code, _, err = run("import", tmp_path / "whole.pt", root, "--step", "3", capsys=capsys)
    assert code == 2 and "(it calls torch.nn.modules" in err
    code, out, err = run(
        "import", tmp_path / "whole.pt", root, "--step", "3", "--trust-pickle", capsys=capsys
    )
    assert code == 0 and "executes code stored in the file" in err
    assert steps(root) == [1, 3]


def test_damaged_and_unknown_sources_are_refused_naming_the_file(
    tmp_path: Path, hf_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    cut = tmp_path / "cut"
    shutil.copytree(hf_dir, cut)
    weights = cut / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    torch.save({"w": torch.ones(3)}, tmp_path / "w.pt")
    (tmp_path / "short.pt").write_bytes((tmp_path / "w.pt").read_bytes()[:200])
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "notes.txt").write_text("hi")
    (tmp_path / "list.pt").write_bytes(b"")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    escaping = tmp_path / "escaping"
    escaping.mkdir()
    (escaping / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../cut/model.safetensors"}})
    )
    cases = [
        (cut, 1, f"{weights}: not a readable safetensors file"),
        (weights, 1, "not a readable safetensors file"),
        (tmp_path / "short.pt", 1, "short.pt: not a readable torch.save file"),
        (tmp_path / "nothing", 2, "no known checkpoint layout (it holds notes.txt)"),
        (tmp_path / "missing.pt", 2, "missing.pt: no such file or directory"),
        (tmp_path / "list.pt", 2, "holds a list, not a state dict"),
        (escaping, 1, "'weight_map' must map each tensor name to a shard file in the same"),
    ]
    for src, expected, words in cases:
        code, out, err = run("import", src, root, capsys=capsys)
        assert (code, out) == (expected, ""), (src, err)
        assert words in err and "\n" not in err.strip(), err
    assert not root.exists()


def test_a_root_a_running_writer_holds_or_a_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, _, _ = small()
    torch.save(model.state_dict(), tmp_path / "w.pt")
    root = tmp_path / "root"
    with crashproof.CheckpointManager(str(root), async_save=False, handle_signals=False) as ckpt:
        ckpt.save(1, crashproof.TrainState(model=model))
        code, _, err = run("import", tmp_path / "w.pt", root, "--step", "2", capsys=capsys)
    assert code == 74 and "is locked by pid" in err
    assert steps(root) == [1]
    (tmp_path / "a-file").write_text("")
    code, _, err = run("import", tmp_path / "w.pt", tmp_path / "a-file", capsys=capsys)
    assert code == 2 and "a-file: exists and is not a directory" in err


# -- Hugging Face --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2() -> Any:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY)).eval()


@pytest.fixture
def hf_dir(tmp_path: Path, gpt2: Any) -> Path:
    out = tmp_path / "tiny-gpt2"
    gpt2.save_pretrained(out)
    return out


def test_save_pretrained_round_trip_is_bit_identical(
    tmp_path: Path, hf_dir: Path, gpt2: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    code, out, err = run("import", hf_dir, root, "--json", capsys=capsys)
    assert code == 0, err
    done = json.loads(out)
    assert done["extras"] == ["hf_config", "hf_generation_config"] and done["step"] == 0
    # save_pretrained leaves the tied lm_head.weight out; the import filled it back in
    live = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY))
    config: dict[str, Any] = {"hf_config": {}}
    restore(root, model=live, extra=config)
    assert same(live.state_dict(), gpt2.state_dict())
    assert config["hf_config"]["n_embd"] == 32
    out_dir = tmp_path / "exported"
    code, out, err = run(
        "export", root, "--format", "hf", "-o", out_dir, "--max-shard-size", "40KB", capsys=capsys
    )
    assert code == 0, err
    names = sorted(os.listdir(out_dir))
    assert "model.safetensors.index.json" in names and "config.json" in names
    assert any(n.startswith("model-00001-of-") for n in names)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    assert type(loaded) is type(gpt2) and same(loaded.state_dict(), gpt2.state_dict())
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again on load
    code, _, err = run("export", root, "--format", "hf", "-o", out_dir, capsys=capsys)
    assert code == 2 and "give --force" in err
    code, _, err = run("export", root, "--format", "hf", "-o", out_dir, "--force", capsys=capsys)
    assert code == 0 and sorted(os.listdir(out_dir))[-3:] == [
        "config.json", "generation_config.json", "model.safetensors",
    ]  # fmt: skip
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "keep.txt").write_text("mine")
    code, _, err = run("export", root, "--format", "hf", "-o", tmp_path / "theirs", capsys=capsys)
    assert code == 2 and "not written by crashproof export" in err


def test_a_trainer_checkpoint_brings_its_step_and_optimizer(
    tmp_path: Path, hf_dir: Path, gpt2: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "checkpoint-12"
    shutil.copytree(hf_dir, src)
    opt = torch.optim.AdamW(gpt2.parameters(), lr=1e-3)
    gpt2(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    opt.zero_grad()
    torch.save(opt.state_dict(), src / "optimizer.pt")
    (src / "trainer_state.json").write_text(json.dumps({"global_step": 12, "epoch": 1.5}))
    marker = tmp_path / "ran"
    (src / "training_args.bin").write_bytes(pickle.dumps(RunsCode(marker)))
    root = tmp_path / "root"
    code, out, err = run("import", src, root, capsys=capsys)
    assert code == 0, err
    assert "Trainer checkpoint, as step 12 ('global_step' of trainer_state.json)" in out
    assert "left out: training_args.bin" in out and not marker.exists()
    live = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY))
    live_opt = torch.optim.AdamW(live.parameters(), lr=1e-3)
    epoch = {"epoch": 0.0}
    assert restore(root, model=live, optimizer=live_opt, extra=epoch) == 12
    assert same(live_opt.state_dict(), opt.state_dict()) and epoch == {"epoch": 1.5}


def test_a_train_states_hf_config_extra_is_exported(
    tmp_path: Path, gpt2: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    config = json.loads(gpt2.config.to_json_string())
    state = crashproof.TrainState(model=gpt2, extra={"hf_config": config})
    with crashproof.CheckpointManager(str(root), async_save=False, handle_signals=False) as ckpt:
        ckpt.save(7, state)
    code, out, err = run("export", root, "--format", "hf", "-o", tmp_path / "hf", capsys=capsys)
    assert code == 0 and "of step 7" in out and "config.json" in out, err
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert same(loaded.state_dict(), gpt2.state_dict())
    del state.extra["hf_config"]
    with crashproof.CheckpointManager(str(root), async_save=False, handle_signals=False) as ckpt:
        ckpt.save(8, state)
    code, out, err = run("export", root, "--format", "hf", "-o", tmp_path / "bare", capsys=capsys)
    assert code == 0 and "has no config.json" in err
    assert sorted(os.listdir(tmp_path / "bare")) == [".crashproof-export.json", "model.safetensors"]


def test_the_console_script_imports(tmp_path: Path) -> None:
    model, _, _ = small()
    torch.save(model.state_dict(), tmp_path / "w.bin")
    script = Path(sys.executable).parent / "crashproof"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "crashproof.cli"]
    result = subprocess.run(
        [*command, "import", str(tmp_path / "w.bin"), str(tmp_path / "root"), "--step", "9"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"imported {tmp_path / 'w.bin'}, a torch.save file")
    m2, _, _ = fresh()
    assert restore(tmp_path / "root", model=m2) == 9 and same(m2.state_dict(), model.state_dict())
