"""``python -m bench.precision_training`` at a small size: a 2-layer GPT-2 in
bfloat16 loses a good part of its AdamW updates to rounding when the
parameter is the only copy, and keeps them (and float32's loss) with
gpuflat's master weights or Kahan sums.

The figures the thresholds come from (40 steps of the "tiny" size, NumPy
backend): float32 loses 0.001 % of its updates, plain bfloat16 32 % (torch's
and gpuflat's alike), master weights 0.001 %, Kahan sums 0.05 %; the mean
distance of each step's loss to float32's is 0.0014 for plain bfloat16 and
0.0002 for both remedies.
"""
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench import precision_training  # noqa: E402

STEPS = 40
PLAIN = ("torch bfloat16", "gpuflat bfloat16")
REMEDIES = ("gpuflat bfloat16 + master_weights", "gpuflat bfloat16 + kahan_sum")
STOCHASTIC = "gpuflat bfloat16 + bf16_stochastic_round"


@pytest.fixture(scope="module", params=["numpy", "host"])
def results(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"precision-{request.param}")
    rc = precision_training.main(["--size", "tiny", "--steps", str(STEPS), "--backend", request.param,
                                  "--out", str(out)])
    assert rc == 0
    return out, json.loads((out / "precision_training.json").read_text())


def test_every_run_learns_and_the_outputs_are_written(results):
    out, r = results
    assert r["settings"]["steps"] == STEPS
    for name, s in r["summary"].items():
        assert len(r["curves"][name]["loss"]) == len(r["curves"][name]["lost_fraction"]) == STEPS
        # ln(32) = 3.47 at the start; 3.32 after 40 steps in every run.
        assert s["final_loss"] < s["first_loss"] - 0.05, name
    table = (out / "precision_training.md").read_text()
    for name in r["summary"]:
        assert f"| {name} |" in table
    assert (out / "precision_training.png").stat().st_size > 10_000


def test_plain_bfloat16_loses_a_large_part_of_its_updates(results):
    summary = results[1]["summary"]
    # 32 % measured over 40 steps (55 % over the bench's 300, 68 % at its end:
    # AdamW's update shrinks below lr as its moments settle, and more of it
    # falls under half a bfloat16 ulp of the weight). 20 % leaves margin.
    for name in PLAIN:
        assert summary[name]["mean_lost_fraction"] > 0.20, name
    # Both plain runs round the same update the same way, near enough.
    assert abs(summary[PLAIN[0]]["mean_lost_fraction"] - summary[PLAIN[1]]["mean_lost_fraction"]) < 0.03
    # float32 itself loses next to none: the count measures rounding, not the update's size.
    assert summary["torch float32"]["mean_lost_fraction"] < 1e-3


def test_master_weights_and_kahan_sums_lose_almost_none(results):
    summary = results[1]["summary"]
    # 0.001 % and 0.05 % measured: a tenth of a percent is a 2x margin over Kahan's.
    for name in REMEDIES:
        assert summary[name]["mean_lost_fraction"] < 1e-3, name


def test_the_remedies_track_float32_closer_than_plain_bfloat16(results):
    summary = results[1]["summary"]
    # Measured 7x closer, step by step; 3x leaves margin. The final loss's
    # gap (0.0004 against 0.0035) is noisier over 4 steps, so held to 2x.
    for remedy in REMEDIES:
        for plain in PLAIN:
            r, p = summary[remedy], summary[plain]
            assert r["mean_abs_diff_to_float32"] * 3 < p["mean_abs_diff_to_float32"], (remedy, plain)
            assert abs(r["gap_to_float32"]) * 2 < p["gap_to_float32"], (remedy, plain)


def test_stochastic_rounding_tracks_float32_closer_than_plain_bfloat16(results):
    # Rounded at random, a weight moves as often as plain rounding leaves it
    # (its lost fraction is no measure), but in expectation by its update: its
    # loss follows float32's as the remedies' do (measured 0.0003 per step
    # against plain's 0.0014 over 40 steps; 0.0008 against 0.11 over 300).
    summary = results[1]["summary"]
    for plain in PLAIN:
        assert summary[STOCHASTIC]["mean_abs_diff_to_float32"] * 3 < summary[plain]["mean_abs_diff_to_float32"]
