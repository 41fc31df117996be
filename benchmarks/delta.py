"""How much smaller is a delta checkpoint, and can its encoding keep up with the disk?

Three trainings, each saved as a full checkpoint (the base) and then as deltas some steps later,
through ``CheckpointManager(delta=Delta(...))`` itself (sizes are the committed files on disk):

1. **dense**: a small transformer (``TinyLM``) trained with AdamW on random tokens; deltas 1, 10
   and 100 steps after the base. Target: deltas >= 1.3x smaller than the full checkpoint.
2. **frozen**: the same model fine-tuned with ~95% of its parameters frozen; a delta 10 steps
   after the base. Target: >= 8x smaller.
3. **embedding**: a large embedding table (sparse gradients, SparseAdam) under a small dense head,
   each step touching a few hundred rows (Check-N-Run's setting); a delta 10 steps after the base.
   Target: >= 5x smaller.

Compared in the same run with zstd (levels 1 and 3) of the full checkpoint's tensor bytes, and,
for speed, with the disk's own write + fsync of the same bytes. Encode and decode throughput are
over the state's logical bytes, medians of ``--repeats`` runs.

    .venv/bin/python benchmarks/delta.py --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import zstandard
from torch import nn

import crashproof as cp
from crashproof.checkpoint.format import DeltaEntry
from crashproof.checkpoint.format._hashing import digest
from crashproof.checkpoint.format._shard_file import tensor_bytes
from crashproof.checkpoint.save._delta import (
    DeltaBase,
    _same_bytes,
    _xor_planes,
    apply_delta,
    encode_delta,
)
from crashproof.checkpoint.save._writer import take_snapshot
from save_speed import Shape, TinyLM

MB = 1e6


class Scenario:
    """A model, its optimizer and a training step."""

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 step: Callable[[], None], note: str) -> None:  # fmt: skip
        self.name, self.model, self.optimizer, self.step, self.note = (
            name, model, optimizer, step, note,
        )  # fmt: skip
        self.state = cp.TrainState(model=model, optimizer=optimizer)


def _lm_step(model: nn.Module, optimizer: torch.optim.Optimizer, vocab: int) -> Callable[[], None]:
    tokens = torch.Generator().manual_seed(0)

    def step() -> None:
        batch = torch.randint(vocab, (4, 65), generator=tokens)
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def dense(shape: Shape) -> Scenario:
    torch.manual_seed(0)
    model = TinyLM(shape)
    with torch.no_grad():
        nn.init.normal_(model.embed.weight, std=0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return Scenario("dense", model, optimizer, _lm_step(model, optimizer, shape.vocab),
                    f"TinyLM({shape}), AdamW lr 3e-4")  # fmt: skip


def frozen(shape: Shape, trainable: float = 0.05) -> Scenario:
    torch.manual_seed(0)
    model = TinyLM(shape)
    with torch.no_grad():
        nn.init.normal_(model.embed.weight, std=0.02)
    params = list(model.named_parameters())
    total = sum(p.numel() for _, p in params)
    model.requires_grad_(False)
    unfrozen = 0
    for _, p in reversed(params):  # the top of the network, as fine-tuning does
        if p is model.embed.weight or unfrozen >= trainable * total:
            continue
        p.requires_grad_(True)
        unfrozen += p.numel()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return Scenario("frozen", model, optimizer, _lm_step(model, optimizer, shape.vocab),
                    f"TinyLM({shape}), {100 * unfrozen / total:.1f}% of the parameters trained")  # fmt: skip


class EmbeddingModel(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.table = nn.Embedding(rows, dim, sparse=True)
        self.head = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))


def embedding(rows: int, dim: int, lookups: int) -> Scenario:
    torch.manual_seed(0)
    model = EmbeddingModel(rows, dim)
    sparse = torch.optim.SparseAdam(list(model.table.parameters()), lr=1e-3)
    dense_opt = torch.optim.Adam(model.head.parameters(), lr=1e-3)
    ids = torch.Generator().manual_seed(0)

    class Both(torch.optim.Optimizer):
        """SparseAdam for the table and Adam for the head, saved as one optimizer state."""

        def __init__(self) -> None:
            super().__init__([{"params": list(model.parameters())}], {})
            self.param_groups = sparse.param_groups + dense_opt.param_groups
            self.state = sparse.state | dense_opt.state  # type: ignore[assignment]

        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            sparse.step()
            dense_opt.step()
            self.state = sparse.state | dense_opt.state  # type: ignore[assignment]

    optimizer = Both()

    def step() -> None:
        batch = torch.randint(rows, (lookups,), generator=ids)
        model.head(model.table(batch)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Scenario("embedding", model, optimizer, step,
                    f"Embedding({rows}, {dim}, sparse) + MLP head, SparseAdam/Adam, {lookups} lookups per step")  # fmt: skip


def flat(scenario: Scenario, step: int) -> list[tuple[str, torch.Tensor]]:
    """The state's tensors as the writer sees them (CPU, contiguous, named), copied."""
    snapshot = take_snapshot(step, scenario.state.capture(), staging=None)
    return [(name, t.clone()) for name, t in snapshot.tensors]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and bytes(tensor_bytes(a)) == bytes(tensor_bytes(b))
    )


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def disk_write_s(tensors: list[tuple[str, torch.Tensor]], work: Path) -> float:
    """Seconds to write the tensors' bytes to one file and fsync it: the disk's own speed."""
    path = work / "raw.bin"
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _, t in tensors:
            os.write(fd, tensor_bytes(t))
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - started
    path.unlink()
    return elapsed


def measure(
    scenario: Scenario, gaps: list[int], warmup: int, repeats: int, work: Path
) -> dict[str, Any]:
    for _ in range(warmup):  # optimizer moments that have seen some training
        scenario.step()
    root = work / scenario.name
    shutil.rmtree(root, ignore_errors=True)
    delta = cp.Delta(full_every=max(gaps) + 10)
    result: dict[str, Any] = {"scenario": scenario.name, "note": scenario.note, "deltas": []}
    with cp.CheckpointManager(
        root, delta=delta, every=cp.EverySteps(10**9), handle_signals=False
    ) as ckpt:
        ckpt.save(0, scenario.state)
        ckpt.wait()
        base_tensors = flat(scenario, 0)
        state_bytes = sum(t.numel() * t.element_size() for _, t in base_tensors)
        full_bytes = dir_bytes(root / "step_0000000000")
        result.update(state_bytes=state_bytes, full_bytes=full_bytes)
        raw = b"".join(bytes(tensor_bytes(t)) for _, t in base_tensors)
        for level in (1, 3):
            started = time.perf_counter()
            size = len(zstandard.ZstdCompressor(level=level).compress(raw))
            result[f"zstd{level}_ratio"] = full_bytes / size
            result[f"zstd{level}_gbps"] = state_bytes / (time.perf_counter() - started) / 1e9
        del raw
        base = DeltaBase(
            0, dict(base_tensors), {n: digest(tensor_bytes(t)) for n, t in base_tensors}
        )
        done = 0
        for gap in sorted(gaps):
            while done < gap:
                scenario.step()
                done += 1
            ckpt.save(gap, scenario.state)
            ckpt.wait()
            delta_bytes = dir_bytes(root / f"step_{gap:010d}")
            now = flat(scenario, gap)
            encode_s, decode_s = [], []
            for _ in range(repeats):
                started = time.perf_counter()
                stored, entries = encode_delta(now, base, delta)
                encode_s.append(time.perf_counter() - started)
                targets = {n: t.clone() for n, t in base_tensors}
                started = time.perf_counter()
                for entry in entries:
                    name = now[entry.index][0]
                    apply_delta(entry, stored[entry.index][1], targets[name], name)
                decode_s.append(time.perf_counter() - started)
            encoded = {entry.index for entry in entries}
            for i, (name, tensor) in enumerate(stored):
                if i not in encoded:  # stored as is
                    targets[name] = tensor
            rebuilt = all(_same_bits(targets[name], tensor) for name, tensor in now)
            disk_s = statistics.median(disk_write_s(now, work) for _ in range(repeats))
            kinds = {e.encoding for e in entries}
            result["deltas"].append({
                "gap": gap, "delta_bytes": delta_bytes, "ratio": full_bytes / delta_bytes,
                "encode_gbps": state_bytes / statistics.median(encode_s) / 1e9,
                "decode_gbps": state_bytes / statistics.median(decode_s) / 1e9,
                "disk_gbps": state_bytes / disk_s / 1e9,
                "same": sum(e.encoding == "same" for e in entries), "xor": sum(e.encoding == "xor-zstd" for e in entries),
                "raw": len(now) - len(entries), "rebuilt_exactly": rebuilt, "encodings": sorted(kinds),
            })  # fmt: skip
            print(f"  {scenario.name} +{gap}: {full_bytes / MB:.1f} MB -> {delta_bytes / MB:.2f} MB "
                  f"({full_bytes / delta_bytes:.2f}x)", file=sys.stderr, flush=True)  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)
    return result


def _float32_bytes(tensors: list[tuple[str, torch.Tensor]]) -> np.ndarray[Any, Any]:
    """The bytes of every float32 tensor of a state, one after another."""
    return np.concatenate(
        [t.reshape(-1).view(torch.uint8).numpy() for _, t in tensors if t.dtype == torch.float32]
    )


def stages(scenario: Scenario, warmup: int, gap: int, repeats: int) -> dict[str, Any]:
    """Where the encoding's time goes, on real state: the float32 tensors of ``scenario`` (the
    dense training) ``gap`` steps after a base taken after ``warmup`` steps, as one array. GB/s
    over the state's bytes on one thread, each byte plane's share, and the alternatives."""
    for _ in range(warmup):
        scenario.step()
    base = flat(scenario, 0)
    for _ in range(gap):
        scenario.step()
    a, b = _float32_bytes(flat(scenario, gap)), _float32_bytes(base)
    compressor = zstandard.ZstdCompressor(level=1)

    def seconds(work: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    def rate(work: Callable[[], object]) -> float:
        return a.size / seconds(work) / 1e9

    xor = np.bitwise_xor(a, b)
    blob = _xor_planes(a, b, 4, compressor)
    a_copy = a.copy()  # a tensor left as it was: equal to its base in every byte
    # decode: apply_delta on a fresh copy of the base each time (made before the clock)
    entry = DeltaEntry(0, "xor-zstd", "float32", (a.size // 4,), digest(memoryview(a)))
    stored = torch.from_numpy(blob)
    bases = iter([torch.from_numpy(b.copy().view(np.float32)) for _ in range(repeats + 1)])
    rates = {
        "encode: XOR each byte plane into place, zstd-1 where compressible": rate(lambda: _xor_planes(a, b, 4, compressor)),
        "of which: the XOR of the whole state alone": rate(lambda: np.bitwise_xor(a, b)),
        "compare with the base, byte for byte (a tensor left as it was)": rate(lambda: _same_bytes(a, a_copy)),
        "checksum": rate(lambda: digest(memoryview(a))),
        "decode: unpack each plane and XOR it into the base, checksum": rate(lambda: apply_delta(entry, stored, next(bases), "bench")),
    }  # fmt: skip
    rates.update(_blosc2_rates(xor, rate))
    planes = []
    columns = xor.reshape(-1, 4)
    for k in range(4):
        plane = np.ascontiguousarray(columns[:, k])
        packed = len(compressor.compress(plane.data))
        planes.append({
            "plane": k, "ratio": plane.size / packed,
            "zstd1_gbps": plane.size / seconds(lambda plane=plane: compressor.compress(plane.data)) / 1e9,
        })  # fmt: skip
    return {"state_mb": a.size / MB, "encode_ratio": a.size / blob.size, "rates": rates,
            "planes": planes}  # fmt: skip


def _blosc2_rates(
    xor: np.ndarray[Any, Any], rate: Callable[[Callable[[], object]], float]
) -> dict[str, float]:
    """The native alternatives to crashproof's byte planes, on the same XOR: python-blosc2
    (shuffle or bitshuffle, then zstd-1 or LZ4, in one C pass, one and two threads) and
    numcodecs (its shuffle filter, then its zstd-1). ``pip install -e '.[bench]'``."""
    rates = {}
    try:
        import blosc2
    except ImportError:
        rates["(blosc2 not installed: pip install -e '.[bench]' to compare)"] = 0.0
    else:
        for codec, level, shuffle, threads in (
            (blosc2.Codec.ZSTD, 1, blosc2.Filter.SHUFFLE, 1),
            (blosc2.Codec.ZSTD, 1, blosc2.Filter.BITSHUFFLE, 1),
            (blosc2.Codec.ZSTD, 1, blosc2.Filter.SHUFFLE, 2),
            (blosc2.Codec.LZ4, 9, blosc2.Filter.SHUFFLE, 2),
        ):
            params = {"codec": codec, "clevel": level, "filters": [shuffle], "typesize": 4,
                      "nthreads": threads}  # fmt: skip
            size = len(blosc2.compress2(xor, **params))
            label = (f"alternative: blosc2 {shuffle.name.lower()} + {codec.name.lower()}-{level}, "
                     f"{threads} thread{'s' if threads > 1 else ''} (ratio {xor.size / size:.2f}x)")  # fmt: skip
            rates[label] = rate(lambda params=params: blosc2.compress2(xor, **params))
    try:
        from numcodecs import Shuffle, Zstd
    except ImportError:
        rates["(numcodecs not installed: pip install -e '.[bench]' to compare)"] = 0.0
    else:
        shuffle, zstd = Shuffle(elementsize=4), Zstd(level=1)
        size = len(zstd.encode(shuffle.encode(xor)))
        label = f"alternative: numcodecs shuffle + zstd-1 (ratio {xor.size / size:.2f}x)"
        rates[label] = rate(lambda: zstd.encode(shuffle.encode(xor)))
    return rates


TARGETS = {"dense": 1.3, "frozen": 8.0, "embedding": 5.0}


def markdown(
    results: list[dict[str, Any]], stage_rates: dict[str, Any], args: argparse.Namespace
) -> str:
    lines = [
        "| training | delta after | full MB | delta MB | full / delta | zstd-1 of full | zstd-3 of full "
        "| encode GB/s | decode GB/s | disk write GB/s | same / xor / as is | rebuilt exactly | target |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in results:
        for d in r["deltas"]:
            target = TARGETS[r["scenario"]]
            verdict = f">= {target}x: {'yes' if d['ratio'] >= target else '**no**'}"
            lines.append(
                f"| {r['scenario']} | {d['gap']} steps | {r['full_bytes'] / MB:.1f} | {d['delta_bytes'] / MB:.2f} "
                f"| **{d['ratio']:.2f}x** | {r['zstd1_ratio']:.2f}x | {r['zstd3_ratio']:.2f}x "
                f"| {d['encode_gbps']:.2f} | {d['decode_gbps']:.2f} | {d['disk_gbps']:.2f} "
                f"| {d['same']} / {d['xor']} / {d['raw']} | {'yes' if d['rebuilt_exactly'] else '**no**'} | {verdict} |"
            )  # fmt: skip
    rows = "\n".join(
        f"| {name} | {gbps:.2f} |" if gbps else f"| {name} | |"
        for name, gbps in stage_rates["rates"].items()
    )
    lines += ["", f"Stages, one thread, on the dense training's {stage_rates['state_mb']:.1f} MB of "
              f"float32 state 10 steps after its base (encoded {stage_rates['encode_ratio']:.2f}x "
              "smaller), GB/s over the state's bytes:", "",
              "| stage | GB/s |", "|---|---:|", rows, "",
              "Each byte plane of the same XOR (plane 3: sign and high exponent bits), zstd-1 on "
              "one thread, GB/s over the plane's bytes:", "",
              "| plane | zstd-1 ratio | zstd-1 GB/s |", "|---:|---:|---:|"]  # fmt: skip
    lines += [
        f"| {p['plane']} | {p['ratio']:.2f}x | {p['zstd1_gbps']:.2f} |"
        for p in stage_rates["planes"]
    ]
    notes = "\n".join(
        f"- **{r['scenario']}**: {r['note']}; state {r['state_bytes'] / MB:.1f} MB."
        for r in results
    )
    return "\n".join(lines) + "\n\n" + notes + f"\n\nMedians of {args.repeats} runs for the speeds."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=20, help="training before the base")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rows", type=int, default=200_000, help="embedding rows")
    p.add_argument("--dim", type=int, default=64, help="embedding width")
    p.add_argument("--lookups", type=int, default=256, help="embedding rows looked up per step")
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    work = Path(args.work or tempfile.mkdtemp(prefix="crashproof-delta-"))
    work.mkdir(parents=True, exist_ok=True)
    shape = Shape(vocab=args.vocab, d_model=args.d_model, layers=args.layers)
    results = [
        measure(dense(shape), [1, 10, 100], args.warmup_steps, args.repeats, work),
        measure(frozen(shape), [10], args.warmup_steps, args.repeats, work),
        measure(
            embedding(args.rows, args.dim, args.lookups),
            [10],
            args.warmup_steps,
            args.repeats,
            work,
        ),
    ]
    stage_rates = stages(dense(shape), args.warmup_steps, 10, args.repeats)
    if args.json:
        print(json.dumps({"scenarios": results, "stages_gbps": stage_rates}, indent=2))
    if args.markdown or not args.json:
        print(markdown(results, stage_rates, args))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
