"""The prefill bench's per-layer-type model (mimo_fn.bench.prefill_check) on the CPU: the layer
counts of the released pattern, the prediction's arithmetic, the split's medians over rounds, and
the memory math that says how many real layers the --check-layers run can hold (the run itself
needs a GPU)."""

import pytest

import mimo_fn as mf
from mimo_fn.bench import prefill_check
from mimo_fn.memory_plan import GiB

H100_FREE = int(79.1 * GiB)  # what torch.cuda.mem_get_info reports free on an idle 80 GB H100


@pytest.mark.parametrize("layers,counts", [(6, (1, 4)), (12, (2, 9)), (48, (8, 39))])
def test_layer_counts_of_the_released_pattern(layers, counts):
    assert prefill_check.layer_counts(mf.ModelConfig.flash(num_layers=layers)) == counts


def test_a_pattern_the_model_does_not_time_is_refused():
    swa_first = mf.ModelConfig.tiny(layer_types=("sliding_attention", "sliding_attention", "sliding_attention",
                                                 "full_attention"))
    with pytest.raises(ValueError, match="expected layer 0 dense with full attention"):
        prefill_check.layer_counts(swa_first)
    assert prefill_check.layer_counts(mf.ModelConfig.tiny()) == (1, 2)


def test_prediction_gives_back_the_slice_it_was_split_from():
    """extrapolate's split (layer 0; layers 0 and 5; all six) predicts the six layers it timed."""
    t_dense, t_two_full, t_six = 0.21, 0.43, 0.77
    times = {"t_dense_s": t_dense, "t_full_moe_s": t_two_full - t_dense, "t_swa_moe_s": (t_six - t_two_full) / 4}
    assert prefill_check.predict_s(times, mf.ModelConfig.flash(num_layers=6)) == pytest.approx(t_six)
    t12 = t_dense + 2 * (t_two_full - t_dense) + 9 * (t_six - t_two_full) / 4
    assert prefill_check.predict_s(times, mf.ModelConfig.flash(num_layers=12)) == pytest.approx(t12)
    assert prefill_check.formula(times, mf.ModelConfig.flash(num_layers=12)).startswith("T12 = 0.210 + 2*0.2200 + 9*")


@pytest.mark.parametrize("chunk", [16384, 32768])
def test_twelve_layers_fit_an_80gb_card_with_mxfp4_experts_only(chunk):
    isl = 65536
    assert prefill_check.plan(12, "mxfp4", isl, chunk, H100_FREE).fits
    assert not prefill_check.plan(12, "fp8", isl, chunk, H100_FREE).fits
    assert not prefill_check.plan(12, "bf16", isl, chunk, H100_FREE).fits
    assert 12 <= prefill_check.most_layers("mxfp4", isl, chunk, H100_FREE) < 24
    assert 6 <= prefill_check.most_layers("fp8", isl, chunk, H100_FREE) < 12


def test_the_split_takes_each_sub_models_median_over_rounds(monkeypatch):
    """layer_type_times(rounds=3): each sub-model run once untimed (its 9.9 s never counts), then the
    three timed in turn each round, the median of each split into layer types; each round's own split
    gives a 48-layer time of its own."""
    from mimo_fn.bench import prefill

    cfg = mf.ModelConfig.tiny()  # layers: full dense, SWA MoE x2, full MoE
    samples = {1: iter([9.9, 0.20, 0.26, 0.21]), 2: iter([9.9, 0.40, 0.41, 0.52]), 4: iter([9.9, 0.80, 0.70, 0.90])}
    order = []

    def timed(sub_cfg, params, seq_lens, chunk, mesh=None):
        order.append(sub_cfg.num_layers)
        return next(samples[sub_cfg.num_layers]), None, None

    monkeypatch.setattr(prefill, "timed_prefill", timed)
    times = prefill.layer_type_times(cfg, mf.init_params(cfg, seed=0), 40, 16, rounds=3)
    assert order == [1, 2, 4] * 4
    n_full, n_swa = prefill_check.layer_counts(cfg)  # (1, 2)
    assert times["t_dense_s"] == pytest.approx(0.21) and times["t_full_moe_s"] == pytest.approx(0.41 - 0.21)
    assert times["t_swa_moe_s"] == pytest.approx((0.80 - 0.41 - (n_full - 1) * 0.20) / n_swa)
    flash = mf.ModelConfig.flash()
    first = {"t_dense_s": 0.20, "t_full_moe_s": 0.20, "t_swa_moe_s": (0.80 - 0.40) / 2}
    assert times["t48_rounds_s"][0] == pytest.approx(prefill_check.predict_s(first, flash))
    assert len(times["t48_rounds_s"]) == 3
    samples = {1: iter([9.9, 0.2]), 2: iter([9.9, 0.4]), 4: iter([9.9, 0.8])}
    assert "t48_rounds_s" not in prefill.layer_type_times(cfg, mf.init_params(cfg, seed=0), 40, 16)  # one round
