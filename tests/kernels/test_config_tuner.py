"""ConfigTuner (the per-key autotuner of gluon_sage) on CPU: timing, choice, memory and disk cache, capture."""

import json

import pytest

from qattn_fx import config
from qattn_fx.kernels._config_tuner import ConfigTuner, default_cache_path

MS = {"a": 3.0, "b": 1.0, "c": 2.0}


def make(tmp_path, capturing=False, cache=True, rounds=1):
    runs = []

    def timer(run):
        run()
        return MS[runs[-1]]

    tuner = ConfigTuner("k", ["a", "b", "c"], default=lambda key: "c", cache_path=tmp_path / "t.json" if cache
                        else None, timer=timer, capturing=lambda: capturing, device_tag=lambda: "GPU X|triton 9",
                        rounds=rounds)
    return tuner, runs


def test_times_every_candidate_then_remembers_the_fastest(tmp_path):
    tuner, runs = make(tmp_path)
    assert tuner.choose((128, 4096), runs.append) == "b"
    assert tuner.last_source() == "tuned"
    assert runs == ["a", "b", "c"]
    assert tuner.timings() == {"k|GPU X|triton 9|(128, 4096)": MS}
    runs.clear()
    assert tuner.choose((128, 4096), runs.append) == "b" and runs == [] and tuner.last_source() == "cache"
    assert tuner.choose((64, 4096), runs.append) == "b" and runs == ["a", "b", "c"]  # another key: tuned again


def test_rounds_interleave_the_candidates_and_keep_the_median():
    """Three rounds by default; one slow outlier (clock drift) does not decide: the median over rounds does."""
    times = iter([3.0, 9.0, 2.0,  # round 1: b caught a slow moment
                  3.0, 1.0, 2.0,
                  3.1, 1.1, 2.1])
    runs = []
    tuner = ConfigTuner("k", ["a", "b", "c"], default=lambda key: "c", cache_path=None,
                        timer=lambda run: (run(), next(times))[1], capturing=lambda: False,
                        device_tag=lambda: "GPU X|triton 9")
    assert tuner.rounds == 3
    assert tuner.choose((1,), runs.append) == "b"
    assert runs == ["a", "b", "c"] * 3
    assert tuner.timings() == {"k|GPU X|triton 9|(1,)": {"a": 3.0, "b": 1.1, "c": 2.0}}
    with pytest.raises(ValueError, match=r"k: rounds=0 is invalid; valid: an int >= 1"):
        ConfigTuner("k", ["a"], default=lambda key: "a", rounds=0)


def test_choices_persist_on_disk_per_device_and_kernel(tmp_path):
    tuner, runs = make(tmp_path)
    tuner.choose((128,), runs.append)
    data = json.loads((tmp_path / "t.json").read_text())
    assert data == {"k|GPU X|triton 9|(128,)": "b"}
    again, runs2 = make(tmp_path)
    assert again.choose((128,), runs2.append) == "b" and runs2 == [] and again.last_source() == "cache"
    other_gpu = ConfigTuner("k", ["a", "b"], default=lambda key: "a", cache_path=tmp_path / "t.json",
                            timer=lambda run: 1.0, capturing=lambda: True, device_tag=lambda: "GPU Y|triton 9")
    assert other_gpu.choose((128,), lambda c: None) == "a" and other_gpu.last_source() == "default"


def test_cached_choice_no_longer_a_candidate_is_ignored(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"k|GPU X|triton 9|(1,)": "gone"}))
    tuner, runs = make(tmp_path)
    assert tuner.choose((1,), runs.append) == "b" and tuner.last_source() == "tuned"


def test_graph_capture_uses_the_default_without_timing(tmp_path):
    tuner, runs = make(tmp_path, capturing=True)
    assert tuner.choose((1,), runs.append) == "c" and runs == [] and tuner.last_source() == "default"
    assert not (tmp_path / "t.json").exists()


def test_tuning_can_be_switched_off_and_bad_values_are_named(tmp_path, monkeypatch):
    tuner, runs = make(tmp_path)
    with config.patch(autotune=False):
        assert tuner.choose((1,), runs.append) == "c" and runs == []
    with config.patch(autotune="yes"), pytest.raises(
            ValueError, match=r"qattn_fx.config.autotune \(\$QATTN_AUTOTUNE\) = 'yes' is invalid; valid: 0, 1"):
        tuner.choose((1,), runs.append)


def test_unreadable_cache_file_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "t.json").write_text("{not json")
    tuner, runs = make(tmp_path)
    with pytest.raises(ValueError, match=r"tuning cache .*t\.json is unreadable .*delete it or point "
                                         r"\$QATTN_TUNING_CACHE \(qattn_fx.config.tuning_cache\) elsewhere"):
        tuner.choose((1,), runs.append)


def test_memory_only_and_cache_path_from_the_environment(tmp_path, monkeypatch):
    tuner, runs = make(tmp_path, cache=False)
    assert tuner.choose((1,), runs.append) == "b" and list(tmp_path.iterdir()) == []
    with config.patch(tuning_cache=""):
        assert default_cache_path() is None
    with config.patch(tuning_cache=str(tmp_path / "x.json")):
        assert default_cache_path() == tmp_path / "x.json"
    with pytest.raises(ValueError, match="needs at least one candidate"):
        ConfigTuner("k", [], default=lambda key: "a")


def test_candidates_of_different_numerics_are_refused():
    """A tuner whose candidates would give different outputs would make results depend on timing and the cache."""
    numerics = {"a": (128, 1), "b": (128, 1), "c": (64, 1)}.__getitem__
    assert ConfigTuner("k", ["a", "b"], default=lambda key: "a", numerics=numerics).candidates == ["a", "b"]
    with pytest.raises(ValueError, match=r"k: the tuner's candidates must give identical outputs, but their numerics "
                                         r"differ: \{'a': \(128, 1\), 'c': \(64, 1\)\}"):
        ConfigTuner("k", ["a", "c"], default=lambda key: "a", numerics=numerics)
