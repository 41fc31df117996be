import torch
from pathlib import Path
from safetensors.torch import load_file
from tests.integrations.launch import finish, start
from tests.supervisor.test_memory_peers import TRAIN


def test_crash3(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    t = [a for a in TRAIN if a != "100000"]
    t[t.index("--every") + 1 : t.index("--every") + 1] = ["5"]
    clean = start(
        "train_tiny.py",
        tmp_path / "clean",
        "--run-dir",
        str(tmp_path / "clean"),
        *t,
        "--dump",
        str(tmp_path / "a.st"),
        options=["--nproc-per-node", "3"],
    )
    crash = start(
        "train_tiny.py",
        tmp_path / "crash",
        "--run-dir",
        str(tmp_path / "crash"),
        *t,
        "--dump",
        str(tmp_path / "b.st"),
        "--crash-at",
        "37",
        options=["--nproc-per-node", "3", "--no-memory"],
    )
    assert finish(clean)[0] == 0
    code, ev, out = finish(crash)
    assert code == 0, out[-2000:]
    a, b = load_file(tmp_path / "a.st"), load_file(tmp_path / "b.st")
    print("DIFF", [k for k in a if not torch.equal(a[k], b[k])])
