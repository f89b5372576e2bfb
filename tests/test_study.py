"""docs/RESULTS.md is rendered from the evaluation JSON alone: every row, Δ and p-value comes
from it, and the study's target (+1.0 over the control with p < 0.05) is checked from it."""
from __future__ import annotations

from training.study import gret_account, render, target_line


def system(name: str, delta: float | None = None, p: float | None = None, **arch) -> dict:
    split = {"bleu": 40.0 + (delta or 0.0), "chrf": 60.0, "sentences_per_s": 10.0}
    if delta is not None:
        split["significance"] = {"bleu": {"delta": delta, "p_value": p}, "chrf": {"delta": 0.0, "p_value": 0.5}}
    flags = {"capsule": False, "aggregate": False, "gate": False, "multiview": None, "pe_k": 1, "pos_tags": False,
             "graph": None} | arch
    return {"name": name, "parameters": 7_580_000, "arch": flags, "steps": 800, "init_from": {"steps": 1850},
            "splits": {"test_2016_flickr": split},
            "speed": {"split": "test_2016_flickr", "sentences": 200, "sentences_per_s_by_round": [9.0, 10.0, 11.0],
                      "vs_control": 1.0 if delta is None else 0.95}}


def payload(*systems) -> dict:
    return {"name": "study", "command": "python -m training.study evaluate ...", "task": "translate",
            "dataset": "multi30k", "direction": "de-en", "control": "control",
            "settings": {"beam": 4, "threads": 2, "bootstrap_samples": 1000, "commit": "abc123"},
            "systems": [system("control"), *systems]}


def test_the_target_is_met_only_by_a_gain_of_one_point_that_is_significant():
    small = system("small-gain", 0.6, 0.01, capsule=True)
    noisy = system("noisy-gain", 1.4, 0.20, capsule=True, gate=True)
    assert "**not met** by any system; largest Δ on test_2016_flickr +1.40 (`noisy-gain`" in \
        target_line(payload(small, noisy), "bleu")
    real = system("real-gain", 1.1, 0.004, capsule=True, aggregate=True, gate=True)
    assert target_line(payload(small, real), "bleu").startswith(
        "Target (Δbleu ≥ +1.0 with p < 0.05 against the control on test_2016_flickr, and no loss on the other "
        "splits): met; largest Δ on test_2016_flickr +1.10 (`real-gain`")


def on_2017(s: dict, delta: float, p: float) -> dict:
    """`s` with a second test split, test_2017_flickr, at Δ `delta` (p)."""
    second = {"bleu": 35.0 + delta, "chrf": 56.0, "sentences_per_s": 10.0,
              "significance": {"bleu": {"delta": delta, "p_value": p}, "chrf": {"delta": 0.0, "p_value": 0.5}}}
    return s | {"splits": s["splits"] | {"test_2017_flickr": second}}


def test_the_target_is_judged_on_the_first_split_and_a_loss_on_another_split_fails_it():
    only_2017 = on_2017(system("gain-on-2017", 0.3, 0.2, capsule=True), 1.6, 0.001)
    assert "**not met**" in target_line(payload(only_2017), "bleu")  # a gain on the second split alone is not it
    loses_2017 = on_2017(system("loses-2017", 1.2, 0.01, capsule=True), -0.4, 0.8)
    assert "**not met**" in target_line(payload(loses_2017), "bleu")
    assert ": met;" in target_line(payload(on_2017(system("both", 1.2, 0.01, capsule=True), 0.1, 0.4)), "bleu")


def test_a_second_seed_of_the_control_is_the_noise_yardstick_and_never_meets_the_target():
    seed = on_2017(system("control-seed2", 0.08, 0.43), 1.13, 0.022) | {"init_from": {"steps": 1850}}
    lines = render(payload(seed))
    assert "" == target_line(payload(seed), "bleu")  # the only other system is no system
    [line] = [x for x in lines if x.startswith("Seed:")]
    assert "`control-seed2` is the control's own recipe with another seed" in line
    assert "test_2016_flickr +0.08 (p 0.430); test_2017_flickr +1.13 (p 0.022)" in line


def test_each_system_is_one_row_in_json_order_with_its_delta_p_value_and_parent_steps():
    lines = render(payload(system("gret", 0.35, 0.202, capsule=True, aggregate=True, gate=True)))
    rows = [line for line in lines if line.startswith("| `")]
    assert [r.split("|")[1].strip() for r in rows] == ["`control`", "`gret`"]
    assert "| 1850+800 |" in rows[1] and "| +0.35 (0.202) |" in rows[1] and "| ✓ | ✓ | ✓ |" in rows[1]
    assert "| — |" in rows[0]  # the control has no Δ against itself
    assert rows[1].endswith("| 0.95 |") and "median over 3 rounds" in "\n".join(lines)  # speed: turns, not one pass


def test_the_gret_account_lists_only_gret_systems_of_every_study_and_judges_them_together():
    warm = system("gret-warm", 0.46, 0.129, capsule=True, aggregate=True)
    scratch = system("gret-scratch", 1.2, 0.03, capsule=True, aggregate=True, gate=True) | {"init_from": None}
    lines = gret_account([payload(warm, system("mvpe", 0.9, 0.07, pe_k=280)), payload(scratch)])
    rows = [line for line in lines if line.startswith("| multi30k")]
    assert [r.split("|")[2].strip() for r in rows] == ["`gret-warm`", "`gret-scratch`"]  # no control, no mvPE
    assert "continued from the 1850-step baseline" in rows[0] and "from scratch" in rows[1]
    assert "test_2016_flickr +0.46 (p 0.129)" in rows[0] and "capsule + aggregate + gate" in rows[1]
    assert "**Not met**: `gret-scratch` gains +1.20 on test_2016_flickr (p 0.030), but the probe has not judged it" \
        in "\n".join(lines)
    assert gret_account([payload(system("mvpe", 0.9, 0.07, pe_k=280))]) == []  # no GRET system, no section


def probed(name: str, mean_cost: float, p: float) -> dict:
    """training.gret_probe's entry for one system: the mean s^M costs `mean_cost` (p)."""
    return {"name": name, "uses_global_state": mean_cost >= 0.5 and p < 0.05,
            "ablations": {"mean": {"vs_trained": {"delta": mean_cost, "p_value": p}}}}


def test_the_gret_target_is_met_only_by_a_gain_from_a_system_that_reads_its_sentences_global_state():
    bias = system("gret-bias", 1.2, 0.01, capsule=True, aggregate=True)  # gains, but the mean s^M does as well
    reader = system("gret-reader", 0.1, 0.4, capsule=True, aggregate=True, gate=True)  # reads s^M, gains nothing
    probes = {"gret-bias": probed("gret-bias", 0.3, 0.2), "gret-reader": probed("gret-reader", 1.6, 0.001)}
    text = "\n".join(gret_account([payload(bias, reader)], probes))
    assert "| no: +0.30, p 0.200 |" in text and "| **yes**: +1.60, p 0.001 |" in text
    assert ("**Not met**: `gret-bias` gains +1.20 on test_2016_flickr (p 0.010), but the probe finds it does not "
            "read its sentence's s^M (the mean s^M costs +0.30, p 0.200)") in text
    both = system("gret-both", 1.1, 0.02, capsule=True, aggregate=True)
    text = "\n".join(gret_account([payload(bias, both)], probes | {"gret-both": probed("gret-both", 0.8, 0.01)}))
    assert "Met: `gret-both` gains +1.10 on test_2016_flickr (p 0.020) and reads s^M (**yes**: +0.80, p 0.010)." in text
