"""The schedule: drawn from a seed (the same seed, the same faults) or written out as specs."""

from __future__ import annotations

import itertools
import statistics

import pytest

from crashproof.chaos import KINDS, draw_schedule, parse_fault


def _draw(seed: int, **kw: object) -> list[dict[str, object]]:
    args: dict[str, object] = {
        "mtbf_s": 10.0, "duration_s": 300.0, "kinds": list(KINDS), "world_size": 4,
    }  # fmt: skip
    args.update(kw)
    return [f.to_json() for f in draw_schedule(seed=seed, **args)]  # type: ignore[arg-type]


def test_the_same_seed_draws_the_same_schedule_and_another_seed_another() -> None:
    first = _draw(7)
    assert first == _draw(7)
    assert first != _draw(8)
    assert len(first) > 10  # 300 s at one fault per 10 s on average


def test_a_drawn_schedule_stays_within_its_duration_kinds_and_ranks() -> None:
    faults = _draw(3, kinds=["kill", "storage"], world_size=2, duration_s=120.0)
    times = [float(str(f["at_s"])) for f in faults]
    assert times == sorted(times) and all(0 < t < 120 for t in times)
    assert {f["kind"] for f in faults} == {"kill", "storage"}
    assert {f["rank"] for f in faults} == {0, 1}
    assert [f["id"] for f in faults] == [f"f{i + 1}" for i in range(len(faults))]
    storage = [f["params"] for f in faults if f["kind"] == "storage"]
    assert all(p["error"] in ("enospc", "eio", "hang") for p in storage)  # type: ignore[index]


def test_inter_arrival_times_are_exponential_with_the_mean_asked_for() -> None:
    faults = draw_schedule(seed=1, mtbf_s=5.0, duration_s=20_000.0, kinds=["kill"], world_size=1)
    times = [0.0, *(f.at_s or 0.0 for f in faults)]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) > 3000
    assert statistics.mean(gaps) == pytest.approx(5.0, rel=0.06)
    # exponential: the median is ln 2 times the mean
    assert statistics.median(gaps) == pytest.approx(5.0 * 0.693, rel=0.1)


def test_fault_specs_give_a_time_or_a_step_a_rank_and_the_kind_s_parameters() -> None:
    kill = parse_fault("at=30s,rank=1,kind=kill", index=0, seed=0, world_size=2)
    assert (kill.id, kill.kind, kill.rank, kill.at_s, kill.at_step) == ("f1", "kill", 1, 30.0, None)
    nan = parse_fault("at=step:120,rank=0,kind=nan", index=1, seed=0, world_size=2)
    assert (nan.id, nan.at_s, nan.at_step, nan.trigger) == ("f2", None, 120, "step:120")
    assert parse_fault("at=1.5m,rank=0,kind=hang", index=0, seed=0, world_size=1).at_s == 90.0
    storage = parse_fault(
        "at=10,rank=0,kind=storage,error=hang,hang_s=3,files=2", index=0, seed=0, world_size=1
    )
    assert dict(storage.params) == {"error": "hang", "files": 2, "hang_s": 3.0}
    slow = parse_fault(
        "at=5s,rank=0,kind=straggler,stop=0.5,for_s=4", index=0, seed=0, world_size=1
    )
    assert dict(slow.params) == {"stop": 0.5, "period_s": 0.5, "for_s": 4.0}


def test_what_a_spec_leaves_out_is_drawn_from_the_seed_the_same_way_every_time() -> None:
    specs = ["at=1s,kind=corrupt", "at=2s,kind=storage", "at=3s,kind=kill"]

    def parse(seed: int) -> list[dict[str, object]]:
        return [
            parse_fault(s, index=i, seed=seed, world_size=8).to_json() for i, s in enumerate(specs)
        ]

    assert parse(5) == parse(5)
    drawn = [parse(seed) for seed in range(20)]
    assert len({str(d) for d in drawn}) > 1  # the seed matters
    for faults in drawn:
        assert faults[0]["params"]["mode"] in ("flip", "truncate")  # type: ignore[index]
        assert faults[1]["params"]["error"] in ("enospc", "eio", "hang")  # type: ignore[index]
        assert all(0 <= f["rank"] < 8 for f in faults)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("at=30s,kind=explode", "unknown kind"),
        ("rank=1,kind=kill", "kind= and at= are needed"),
        ("at=30s,rank=2,kind=kill", "the run has 2 rank(s)"),
        ("at=soon,kind=kill", "not a duration"),
        ("at=step:x,kind=kill", "not a whole number"),
        ("at=3s,kind=kill,mode=flip", "kill takes no mode"),
        ("at=3s,kind=storage,error=full", "error=enospc|eio|hang"),
        ("at=3s,kind=straggler,stop=1.5", "0 < stop < 1"),
        ("at=3s,kind=kill,kind=hang", "given twice"),
        ("at=3s kind=kill", "key=value"),
    ],
)
def test_a_bad_spec_is_refused_with_a_message_that_says_why(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_fault(spec, index=0, seed=0, world_size=2)
    assert message in str(info.value)
