"""The checkpoint stall inside the Hugging Face ``Trainer`` and the Lightning loop: crashproof's
asynchronous save against the framework's own checkpointing, same model, same interval.

The goal: the time a crashproof save blocks the training loop is <= 0.2x the time the
framework's own checkpointing blocks it. For each loop, three variants train the same model from
the same seed for the same steps, interleaved (the order rotates from round to round, so a drift
of the machine's speed affects every variant alike):

* **none**: no checkpoints at all (the wall time's reference);
* **the framework's own**: the ``Trainer`` with ``save_strategy="steps", save_steps=EVERY``;
  Lightning's ``ModelCheckpoint(every_n_train_steps=EVERY, save_top_k=-1)``;
* **crashproof**: its callback for that loop with ``every=cp.EverySteps(EVERY)`` (asynchronous
  saves, the default), ``keep=cp.KeepLast(2)`` (the Trainer: ``save_total_limit=2``).

What is timed as the blocking part of one save (``time.perf_counter`` around the call, on the
training thread, in the steps that saved):

* the Trainer's own: ``trainer._save_checkpoint`` (the model through safetensors, the optimizer,
  scheduler and RNG through ``torch.save``, the trainer state as JSON, the rotation of old
  checkpoints: all synchronous, none fsynced);
* Lightning's own: ``ModelCheckpoint.on_train_batch_end`` (its ``trainer.save_checkpoint``, a
  ``torch.save`` of the whole checkpoint dict, is the "inner" column);
* crashproof in the Trainer: the callback's step-end hook (``TrainRun.after_step_end``, and
  ``TrainRun.save_final`` if the last step was not saved yet), which captures the Trainer's state
  and calls the manager's ``maybe_save``;
* crashproof in Lightning: the callback's ``on_train_batch_end`` (and ``on_train_end``);

and, for crashproof, the manager's own figure (``manager.stats.last_blocking_s``: the snapshot
of the state into staging buffers, and any wait for the save before) is the "inner" column. The
hooks are wrapped from outside (instance attributes, or the private ``TrainRun`` class): nothing
in crashproof or the frameworks is changed. The train() wall time (``trainer.train()`` /
``trainer.fit()``, which for crashproof includes ``close()``: the last save's background write
committed) shows what the saves cost beyond their blocking part.

For scale, the same state (model + AdamW after a step) is also copied into preallocated buffers
(``copy_``: the floor of a snapshot), written raw with ``os.write`` + fsync from one buffer, and
``torch.save``-d + fsynced.

The model is a GPT-2 built from its config (nothing downloaded), trained on random tokens on the
CPU; sequences are short so that a step is cheap and the checkpoint, not the compute, is the
subject. About 6 minutes at the defaults on a loaded 2-vCPU VM::

    .venv/bin/python benchmarks/integrations.py --markdown
    .venv/bin/python benchmarks/integrations.py --quick      # a smoke run, about a minute
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

import crashproof as cp
from save_speed import DEFAULT_DIR, MB, byte_views, log, raw_write, torch_save

HF, LIGHTNING = "HF Trainer", "Lightning"
NONE, OWN, CRASHPROOF = "none", "own", "crashproof"
VARIANTS = (NONE, OWN, CRASHPROOF)
GOAL = 0.2


@dataclass(frozen=True)
class Config:
    n_embd: int
    n_layer: int
    vocab: int
    seq: int
    batch: int
    steps: int
    every: int

    def describe(self) -> str:
        return (
            f"GPT-2 (n_embd={self.n_embd}, n_layer={self.n_layer}, vocab={self.vocab}), batch "
            f"{self.batch} x {self.seq} tokens, {self.steps} optimizer steps, a save every "
            f"{self.every} steps"
        )


@dataclass
class Run:
    """One training run of one variant."""

    wall_s: float
    blocking_s: list[float] = field(default_factory=list)
    """Per save: the hook's time on the training thread."""
    inner_s: list[float] = field(default_factory=list)
    """Per save: the inner figure (the framework's save call; crashproof's last_blocking_s)."""
    waited_s: list[float] = field(default_factory=list)
    """Per save, crashproof only: of the blocking time, the wait for the save before it to be
    written (``stats.waited_busy_s``: one staging buffer, ``on_busy="wait"``)."""
    close_s: float = 0.0
    """crashproof only: the manager's ``close()`` at the end of train()/fit(), which waits for
    the last save's background write (part of ``wall_s``)."""


# -- the model and the data ----------------------------------------------------------------------


def gpt2(config: Config) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model_config = GPT2Config(
        vocab_size=config.vocab, n_positions=max(config.seq, 16), n_embd=config.n_embd,
        n_layer=config.n_layer, n_head=max(1, config.n_embd // 64), bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(model_config)


def tokens(config: Config) -> torch.Tensor:
    """One epoch of exactly ``steps`` batches of random tokens."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(
        0, config.vocab, (config.steps * config.batch, config.seq), generator=generator
    )


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def timed(call: Callable[..., Any], record: Callable[[float, Any], None]) -> Callable[..., Any]:
    """``call``, reporting its seconds (and result) to ``record``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = call(*args, **kwargs)
        record(time.perf_counter() - started, result)
        return result

    return wrapper


# -- the Hugging Face Trainer --------------------------------------------------------------------


def hf_run(config: Config, variant: str, work: Path) -> Run:
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from crashproof.integrations import _trainer_run
    from crashproof.integrations.transformers import CrashproofCallback

    out = work / "hf-out"
    root = work / "hf-root"
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=config.batch,
        max_steps=config.steps,
        learning_rate=1e-4,
        logging_strategy="no",
        save_strategy="steps" if variant == OWN else "no",
        save_steps=config.every,
        save_total_limit=2,
        report_to=[],
        use_cpu=True,
        seed=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callbacks = []
    if variant == CRASHPROOF:
        callbacks.append(
            CrashproofCallback(root, every=cp.EverySteps(config.every), keep=cp.KeepLast(2))
        )
    trainer = Trainer(
        model=gpt2(config), args=args, train_dataset=TokenDataset(tokens(config)),
        callbacks=callbacks,
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # its summary of train() on stdout
    run = Run(wall_s=0.0)
    originals: list[tuple[str, Any]] = []
    if variant == OWN:

        def own(seconds: float, _: Any) -> None:
            run.blocking_s.append(seconds)
            run.inner_s.append(seconds)

        trainer._save_checkpoint = timed(trainer._save_checkpoint, own)
    elif variant == CRASHPROOF:
        # The callback's hooks run on a TrainRun made inside train(): timed on its class.
        for name in ("after_step_end", "save_final"):
            original = getattr(_trainer_run.TrainRun, name)
            originals.append((name, original))
            setattr(_trainer_run.TrainRun, name, _timed_hook(original, run))
        close = _trainer_run.TrainRun.close
        originals.append(("close", close))

        def closed(seconds: float, _: Any) -> None:
            run.close_s += seconds

        _trainer_run.TrainRun.close = timed(close, closed)  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        trainer.train()
        run.wall_s = time.perf_counter() - started
    finally:
        for name, original in originals:
            setattr(_trainer_run.TrainRun, name, original)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    return run


def _timed_hook(original: Callable[..., Any], run: Run) -> Callable[..., Any]:
    """A TrainRun method timed, counting the calls in which the manager started a save."""

    def hook(self: Any) -> Any:
        stats = self.manager.stats
        before, waited = stats.saves_started, stats.waited_busy_s
        started = time.perf_counter()
        result = original(self)
        seconds = time.perf_counter() - started
        if stats.saves_started > before:
            run.blocking_s.append(seconds)
            run.inner_s.append(stats.last_blocking_s)
            run.waited_s.append(stats.waited_busy_s - waited)
        return result

    return hook


# -- Lightning -----------------------------------------------------------------------------------


def lightning_run(config: Config, variant: str, work: Path) -> Run:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from crashproof.integrations.lightning import CrashproofCallback

    class GPT2Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt2(config)

        def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            loss: torch.Tensor = self.model(input_ids=ids, labels=ids).loss
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    ckpt_dir = work / "lit-ckpt"
    root = work / "lit-root"
    run = Run(wall_s=0.0)
    callbacks: list[Any] = []
    if variant == OWN:
        own = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=config.every, save_top_k=-1)
        callbacks.append(own)
    elif variant == CRASHPROOF:
        crashproof = CrashproofCallback(
            root, every=cp.EverySteps(config.every), keep=cp.KeepLast(2)
        )
        callbacks.append(crashproof)
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens(config)), batch_size=config.batch
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=config.steps, callbacks=callbacks,
        enable_checkpointing=variant == OWN, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        default_root_dir=str(work / "lit-default"),
    )  # fmt: skip
    if variant == OWN:
        inner: list[float] = []
        trainer.save_checkpoint = timed(  # type: ignore[method-assign]
            trainer.save_checkpoint, lambda seconds, _: inner.append(seconds)
        )
        for name in ("on_train_batch_end", "on_train_epoch_end", "on_validation_end"):
            setattr(own, name, _timed_lightning_own(getattr(own, name), run, inner))
    elif variant == CRASHPROOF:

        def closed(seconds: float, _: Any) -> None:
            run.close_s += seconds  # (a second call, from teardown, finds it closed: ~0 s)

        crashproof._close = timed(crashproof._close, closed)  # type: ignore[method-assign]
        for name in ("on_train_batch_end", "on_train_end"):
            setattr(
                crashproof,
                name,
                _timed_lightning_crashproof(getattr(crashproof, name), crashproof, run),
            )
    try:
        started = time.perf_counter()
        trainer.fit(GPT2Module(), loader)
        run.wall_s = time.perf_counter() - started
    finally:
        for path in (ckpt_dir, root, work / "lit-default"):
            shutil.rmtree(path, ignore_errors=True)
    return run


def _timed_lightning_own(
    original: Callable[..., Any], run: Run, inner: list[float]
) -> Callable[..., Any]:
    def hook(*args: Any, **kwargs: Any) -> Any:
        before = len(inner)
        started = time.perf_counter()
        result = original(*args, **kwargs)
        if len(inner) > before:
            run.blocking_s.append(time.perf_counter() - started)
            run.inner_s.append(sum(inner[before:]))
        return result

    return hook


def _timed_lightning_crashproof(
    original: Callable[..., Any], callback: Any, run: Run
) -> Callable[..., Any]:
    def hook(*args: Any, **kwargs: Any) -> Any:
        stats = callback.manager.stats
        before, waited = stats.saves_started, stats.waited_busy_s
        started = time.perf_counter()
        result = original(*args, **kwargs)
        if stats.saves_started > before:
            run.blocking_s.append(time.perf_counter() - started)
            run.inner_s.append(stats.last_blocking_s)
            run.waited_s.append(stats.waited_busy_s - waited)
        return result

    return hook


# -- the context: the same bytes copied, written raw, torch.save-d ---------------------------------


def context(config: Config, work: Path, repeats: int) -> dict[str, Any]:
    model = gpt2(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = tokens(config)[: config.batch]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    tensors = [t for t in model.state_dict().values()]
    for values in optimizer.state.values():
        tensors += [v for v in values.values() if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    targets = [torch.empty_like(t) for t in tensors]
    for source, target in zip(tensors, targets, strict=True):  # the pages touched: as staging
        target.copy_(source)  # buffers are after a manager's first save
    times: dict[str, list[float]] = {"copy_": [], "raw": [], "torch.save": []}
    for i in range(repeats):
        started = time.perf_counter()
        for source, target in zip(tensors, targets, strict=True):
            target.copy_(source)
        times["copy_"].append(time.perf_counter() - started)
        path = work / f"raw-{i}"
        written, flushed = raw_write(path, byte_views([buffer]))
        times["raw"].append(written + flushed)
        path.unlink()
        path = work / f"torch-{i}.pt"
        started = time.perf_counter()
        torch_save(path, model, optimizer)
        times["torch.save"].append(time.perf_counter() - started)
        path.unlink()
    return {"state_bytes": nbytes, "tensors": len(tensors),
            **{k: statistics.median(v) for k, v in times.items()}}  # fmt: skip


# -- the measurement -----------------------------------------------------------------------------


def rotated(variants: Sequence[str], i: int) -> list[str]:
    i %= len(variants)
    return [*variants[i:], *variants[:i]]


def measure(args: argparse.Namespace, config: Config, work: Path) -> dict[str, Any]:
    loops: dict[str, Callable[[Config, str, Path], Run]] = {
        HF: hf_run,
        LIGHTNING: lightning_run,
    }
    out: dict[str, Any] = {"config": asdict(config), "describe": config.describe(), "loops": {}}
    for loop in args.loops:
        runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
        # First-use costs (imports, first calls) are the same for a small model: not counted.
        warm = replace(config, n_embd=64, n_layer=1, vocab=256, steps=config.every)
        for _ in range(args.warmup):
            for variant in VARIANTS:
                loops[loop](warm, variant, work)
            log(f"{loop} warm-up round done")
        for i in range(args.repeats):
            for variant in rotated(VARIANTS, i):
                run = loops[loop](config, variant, work)
                runs[variant].append(run)
                log(
                    f"{loop} round {i + 1}/{args.repeats} {variant}: train {run.wall_s:.2f} s, "
                    f"{len(run.blocking_s)} saves blocking "
                    f"{', '.join(f'{s * 1000:.0f}' for s in run.blocking_s) or '-'} ms"
                )
        out["loops"][loop] = {v: [asdict(r) for r in rs] for v, rs in runs.items()}
    log("context: the same state copied, written raw, torch.save-d")
    out["context"] = context(config, work, args.repeats)
    return out


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    blocking = [s for r in runs for s in r["blocking_s"]]
    inner = [s for r in runs for s in r["inner_s"]]
    firsts = [r["blocking_s"][0] for r in runs if r["blocking_s"]]
    later = [s for r in runs for s in r["blocking_s"][1:]]
    return {
        "saves_per_run": statistics.median(len(r["blocking_s"]) for r in runs),
        "blocking_median_s": statistics.median(blocking) if blocking else None,
        "blocking_max_s": max(blocking) if blocking else None,
        "inner_median_s": statistics.median(inner) if inner else None,
        "wall_median_s": statistics.median(r["wall_s"] for r in runs),
        "first_median_s": statistics.median(firsts) if firsts else None,
        "later_median_s": statistics.median(later) if later else None,
        "saves": len(blocking),
        "waited": sum(1 for r in runs for w in r.get("waited_s", []) if w > 0),
        "waited_s": sum(w for r in runs for w in r.get("waited_s", [])),
        "close_median_s": statistics.median(r.get("close_s", 0.0) for r in runs),
    }


def paired_ratio(crashproof: list[dict[str, Any]], own: list[dict[str, Any]]) -> float | None:
    """The median over rounds of (crashproof's median blocking / the framework's) in a round."""
    ratios = [
        statistics.median(c["blocking_s"]) / statistics.median(o["blocking_s"])
        for c, o in zip(crashproof, own, strict=True)
        if c["blocking_s"] and o["blocking_s"]
    ]
    return statistics.median(ratios) if ratios else None


LABELS = {
    (HF, OWN): 'the Trainer\'s own (`save_strategy="steps"`)',
    (HF, CRASHPROOF): "crashproof `CrashproofCallback`",
    (LIGHTNING, OWN): "Lightning's own (`ModelCheckpoint`)",
    (LIGHTNING, CRASHPROOF): "crashproof `CrashproofCallback`",
    (HF, NONE): "none",
    (LIGHTNING, NONE): "none",
}


def ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f}" if seconds < 0.1 else f"{seconds * 1000:.0f}"


def verdicts(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = {}
    for loop, runs in out["loops"].items():
        own, crashproof = summary(runs[OWN]), summary(runs[CRASHPROOF])
        ratio = None
        if own["blocking_median_s"] and crashproof["blocking_median_s"] is not None:
            ratio = crashproof["blocking_median_s"] / own["blocking_median_s"]
        found[loop] = {
            "ratio": ratio,
            "paired": paired_ratio(runs[CRASHPROOF], runs[OWN]),
            "met": ratio is not None and ratio <= GOAL,
        }
    return found


def markdown(out: dict[str, Any]) -> str:
    ctx = out["context"]
    judged = verdicts(out)
    lines = [
        f"{out['describe']}; {ctx['state_bytes'] / MB:.1f} MB of model + AdamW state "
        f"({ctx['tensors']} tensors); {out['repeats']} rounds, variants interleaved.",
        "",
        "| loop | checkpointing | saves per run | blocking per save, median ms | max ms | "
        "inner, median ms | ratio (paired) | train() wall s | wall vs none |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for loop, runs in out["loops"].items():
        none_wall = summary(runs[NONE])["wall_median_s"]
        for variant in VARIANTS:
            s = summary(runs[variant])
            if variant == NONE:
                ratio, versus = "-", "-"
            else:
                versus = f"{(s['wall_median_s'] / none_wall - 1) * 100:+.0f}%"
                if variant == OWN:
                    ratio = "1.00x"
                else:
                    r, p = judged[loop]["ratio"], judged[loop]["paired"]
                    ratio = (
                        "-"
                        if r is None
                        else f"**{r:.2f}x**" + (f" ({p:.2f}x)" if p is not None else "")
                    )
            lines.append(
                f"| {loop} | {LABELS[loop, variant]} | {s['saves_per_run']:g} | "
                f"{ms(s['blocking_median_s'])} | {ms(s['blocking_max_s'])} | "
                f"{ms(s['inner_median_s'])} | {ratio} | {s['wall_median_s']:.2f} | {versus} |"
            )
    lines += [
        "",
        f"The same state: `copy_` into preallocated buffers {ctx['copy_'] * 1000:.0f} ms, a raw "
        f"`os.write` + fsync of its bytes {ctx['raw'] * 1000:.0f} ms "
        f"({ctx['state_bytes'] / ctx['raw'] / 1e9:.2f} GB/s), `torch.save` + fsync "
        f"{ctx['torch.save'] * 1000:.0f} ms (medians of {out['repeats']}).",
        "",
    ]
    for loop, runs in out["loops"].items():
        own, crashproof = summary(runs[OWN]), summary(runs[CRASHPROOF])
        if not crashproof["saves"]:
            continue
        lines.append(
            f"- {loop}, first save of a run against the later ones, medians: the framework's own "
            f"{ms(own['first_median_s'])} / {ms(own['later_median_s'])} ms, crashproof "
            f"{ms(crashproof['first_median_s'])} / {ms(crashproof['later_median_s'])} ms; "
            f"crashproof saves that waited for the previous one's write: {crashproof['waited']} "
            f"of {crashproof['saves']} ({crashproof['waited_s'] * 1000:.0f} ms in all); its "
            f"`close()` at the end of the run, waiting for the last save's write, "
            f"{ms(crashproof['close_median_s'])} ms (in the wall time)."
        )
    for loop, v in judged.items():
        if v["ratio"] is None:
            lines.append(f"- {loop}: no ratio (a variant saved nothing).")
            continue
        lines.append(
            f"- {loop}: crashproof blocks **{v['ratio']:.2f}x** the time of the framework's own "
            f"checkpointing (goal <= {GOAL}x): **{'met' if v['met'] else 'not met'}**."
        )
    return "\n".join(lines)


# -- the command line ----------------------------------------------------------------------------


QUICK = {"n_embd": 128, "n_layer": 2, "vocab": 2048, "seq": 16, "batch": 1, "steps": 10,
         "every": 5, "repeats": 1}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per optimizer step")
    p.add_argument("--steps", type=int, default=15, help="optimizer steps per run")
    p.add_argument("--every", type=int, default=5, help="steps between saves")
    p.add_argument("--repeats", type=int, default=3, help="rounds (every variant once each)")
    p.add_argument("--warmup", type=int, default=1,
                   help="uncounted rounds first, each run one save interval long")  # fmt: skip
    p.add_argument("--loops", nargs="+", choices=[HF, LIGHTNING], default=[HF, LIGHTNING],
                   metavar="LOOP", help=f"{HF!r} and/or {LIGHTNING!r} (default both)")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="a small model, 10 steps, 1 round: a smoke run of about a minute; sizes "
                   "given explicitly still apply")  # fmt: skip
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="scratch dir on the disk to test")
    p.add_argument("--json", type=Path, help="also write every run's figures here")
    p.add_argument("--markdown", action="store_true", help="(the table is markdown anyway)")
    args = p.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or sys.argv[1:])}
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
    if args.every < 1 or args.steps < args.every or args.repeats < 1 or args.warmup < 0:
        p.error("need --every >= 1, --steps >= --every, --repeats >= 1 and --warmup >= 0")
    return args


def quiet() -> None:
    """The frameworks' banners and advice, not the benchmark's output."""
    warnings.filterwarnings("ignore")
    with contextlib.suppress(ImportError):
        import lightning.pytorch  # noqa: F401 - it sets its loggers' levels when imported
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet()
    config = Config(args.n_embd, args.n_layer, args.vocab, args.seq, args.batch, args.steps,
                    args.every)  # fmt: skip
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="integrations-", dir=args.dir))
    started = time.perf_counter()
    try:
        out = measure(args, config, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out.update(repeats=args.repeats, verdicts=verdicts(out), loadavg=list(os.getloadavg()),
               elapsed_s=time.perf_counter() - started, torch=torch.__version__,
               torch_threads=torch.get_num_threads())  # fmt: skip
    log(f"done in {out['elapsed_s']:.0f} s, load average {out['loadavg']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
