"""The soak in small (tools/soak/soak.py --requests 500): random arrivals, bursts, cancellations of all
three kinds, a KV pool that forces preemption, injected faults; nothing lost, duplicated, leaked,
untyped or different from depth 1."""
import sys

import pytest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "soak"))

from soak import engine_config, format_report, soak  # noqa: E402


async def test_soak_500_requests_with_faults():
    report = await soak(500, rounds=2, seed=3, log=lambda *_: None, armed={"forward": 1, "sample": 1})
    print(format_report(report))
    assert report.ok, format_report(report)
    assert report.lost == report.duplicated == report.leaked_pages == 0 and not report.untyped
    assert report.compared > 200 and not report.mismatches
    assert report.preemptions > 0 and report.failed_steps > 0  # the faults and the small pool did happen
    assert report.outcomes["cancelled"] > 0 and report.outcomes["abort"] > 0


def test_the_soak_compares_batch_invariant_engines_with_caching_on():
    # a seeded row one ulp from its top-p boundary samples another token in another batch on the
    # fast CPU path: only invariant engines make "equal to depth 1" exact (docs/prefix-caching.md)
    assert engine_config(2).batch_invariant and engine_config(1).batch_invariant
    assert engine_config(2, prefix_caching=True).prefix_caching


async def test_soak_with_skills_mixed_in(monkeypatch):
    """--skills (issue 31): point/detect calls among the requests, some cancelled (task or stream);
    each finished one's dict equals depth 1's, and a cancelled one is not taken for a duplicate."""
    import soak as soak_module

    monkeypatch.setattr(soak_module, "SKILLS", ["point", "detect"])
    monkeypatch.setattr(soak_module, "SKILL_RATE", 0.5)
    report = await soak(160, rounds=1, seed=5, log=lambda *_: None, rates={})
    assert report.ok, format_report(report)
    assert report.skills > 40 and report.skills_compared > 30 and not report.mismatches
    assert report.lost == report.duplicated == report.leaked_pages == 0
    assert report.outcomes["ok-skill"] == report.skills_compared and report.outcomes["cancelled"] > 0


async def test_soak_with_moondream_region_skills(monkeypatch):
    """--skills-model moondream: point/detect on the region heads (values carried on the device)
    beside one-picture queries, with faults, cancellations and preemption; dicts equal depth 1's."""
    import soak as soak_module

    for name in ("MODEL", "VOCAB", "IMAGES", "ONE_IMAGE", "SKILLS"):  # restored after the test
        monkeypatch.setattr(soak_module, name, list(getattr(soak_module, name)))
    soak_module.use_moondream(seed=2)
    soak_module.SKILLS[:] = ["point", "detect"]
    monkeypatch.setattr(soak_module, "SKILL_RATE", 0.4)
    report = await soak(160, rounds=1, seed=2, log=lambda *_: None, armed={"forward": 1})
    assert report.ok, format_report(report)
    assert report.skills > 40 and report.skills_compared > 25 and not report.mismatches
    assert report.lost == report.duplicated == report.leaked_pages == report.leaked_encoder_entries == 0
    assert report.encoder_hits > 0 and report.failed_steps > 0


def test_a_whole_class_of_requests_failing_fails_the_soak():
    """issue 37, item 7: on the tiny Idefics3 every regex and choice request failed to compile and
    the soak counted those as expected typed errors; a class with no success now fails it."""
    from soak import Planned, Report, _count

    from slipstream import SamplingParams
    from slipstream.errors import GrammarCompileError, StepFailedError

    regex = [Planned(f"g{i}", [5], SamplingParams(regex="[a-z]+"), 0.0) for i in range(12)]
    plain = [Planned(f"p{i}", [5], SamplingParams(), 0.0) for i in range(12)]
    results = {p.rid: GrammarCompileError("llguidance cannot use this tokenizer") for p in regex}
    results |= {p.rid: StepFailedError("injected") for p in plain[:6]}  # failures beside successes: fine
    results |= {p.rid: "ok-stream" for p in plain[6:]}
    report = Report()
    _count(regex + plain, results, report)
    assert not report.ok and list(report.failed_classes) == ["regex"]
    assert "regex: 0 of 12 succeeded" in format_report(report)


async def test_the_soak_watches_memory_on_the_default_path():
    """issue 37, item 6: the soaks ran batch-invariant only, where the oneDNN primitives never grew.
    On the default path the memory rule holds; a difference from depth 1 is reported, not failed."""
    report = await soak(200, rounds=2, seed=11, log=lambda *_: None, rates={}, batch_invariant=False)
    assert not report.exact and len(report.rss_mb) == 2 and report.rss_growth_mb <= 64
    assert report.lost == report.duplicated == report.leaked_pages == 0 and not report.untyped
    assert report.ok, format_report(report)
    report.mismatches.append("a near-tie")
    assert report.ok  # (batch-invariant engines would fail it)
