"""Settings: defaults.yaml < --config files < flags, with clear errors."""
import pytest
from ling_watchdog.config import ConfigError, load_config


def test_defaults_hold_the_shipped_limits():
    cfg = load_config()
    assert (cfg.max_util_long_context, cfg.max_batched_tokens_long_context, cfg.max_relaunches) == (0.72, 8192, 3)
    assert cfg.small_smem_bytes == 101_376 and cfg.url is None


def test_a_file_overrides_defaults_and_flags_override_the_file(tmp_path):
    f = tmp_path / "w.yaml"
    f.write_text("load_stall_s: 240\nfail_threshold: 5\n")
    cfg = load_config([f], {"fail_threshold": 2, "load_silent_s": None})
    assert (cfg.load_stall_s, cfg.fail_threshold, cfg.load_silent_s) == (240.0, 2, 600.0)


@pytest.mark.parametrize("override, message", [
    ({"laod_stall_s": 1}, "unknown setting 'laod_stall_s'; did you mean 'load_stall_s'?"),
    ({"max_util_long_context": 1.2}, "max_util_long_context=1.2 must be a fraction in (0, 1]"),
    ({"fail_threshold": 0}, "fail_threshold=0 must be >= 1"),
    ({"log_backups": 2.5}, "log_backups=2.5 is not an integer"),
    ({"kill_grace_s": -1}, "kill_grace_s=-1.0 is negative"),
    ({"memory_model": "gpu"}, "memory_model='gpu' is not one of"),
    ({"force": "maybe"}, "force='maybe' is not true/false"),
    ({"spec_break_even": 0.8}, "spec_break_even=0.8 is a mean accepted length, bonus token included: use a value >= 1"),
])
def test_bad_settings_are_refused_with_the_value_and_the_rule(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        load_config(overrides=override)


def test_a_config_file_that_is_not_a_mapping_is_refused(tmp_path):
    f = tmp_path / "w.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config([f])
