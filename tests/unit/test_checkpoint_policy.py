"""Who opts in, under which label and scope; bad labels fail loudly."""

from typing import Any

import pytest
from cedana_shim.checkpoint.policy import (
    ECHO_MAX,
    LABEL_MAX,
    Mode,
    echoed,
    parse_duration,
    policy_for,
    validate_label,
)
from cedana_shim.errors import InvalidArgument
from hypothesis import given, settings
from hypothesis import strategies as st
from support.examples import examples


def spec(env: list[str] | None = None, **annotations: str) -> dict[str, Any]:
    return {"process": {"env": env or ["PATH=/bin"]}, "annotations": annotations}


def test_unlabelled_container_is_off() -> None:
    assert policy_for(spec(), "c1", "default").mode is Mode.OFF


def test_env_label_means_checkpoint_on_stop_and_restore() -> None:
    p = policy_for(spec(["CEDANA_CHECKPOINT=train-1"]), "c1", "default")
    assert (p.mode, p.label, p.scope, p.interval) == (Mode.AUTO, "train-1", "default", None)


def test_kubernetes_namespace_is_the_scope() -> None:
    s = spec(
        ["CEDANA_CHECKPOINT=x"],
        **{
            "io.kubernetes.cri.sandbox-namespace": "team-a",
            "io.kubernetes.cri.container-name": "trainer",
            "io.kubernetes.cri.sandbox-name": "pod-1",
        },
    )
    p = policy_for(s, "c1", "k8s.io")
    assert (p.scope, p.container, p.pod) == ("team-a", "trainer", "pod-1")


def test_annotation_label_and_interval() -> None:
    s = spec(**{"cedana.ai/checkpoint": "lbl", "cedana.ai/checkpoint-interval": "10m"})
    p = policy_for(s, "c1", "default")
    assert (p.mode, p.label, p.interval) == (Mode.AUTO, "lbl", 600.0)


def test_enable_without_label_is_manual_under_the_container_name() -> None:
    p = policy_for(spec(["CEDANA_ENABLE=1"]), "ctr-7", "default")
    assert (p.mode, p.label) == (Mode.MANUAL, "ctr-7")


def test_pause_container_never_takes_part() -> None:
    s = spec(["CEDANA_CHECKPOINT=x"], **{"io.kubernetes.cri.container-type": "sandbox"})
    assert policy_for(s, "c1", "k8s.io").mode is Mode.OFF


@pytest.mark.parametrize(
    "label, rule",
    [
        ("", "empty"),
        ("a" * (LABEL_MAX + 1), "over"),
        ("a/b", "path separator"),
        ("..", "'..'"),
        ("a..b", "'..'"),
        ("bad\nlabel", "control"),
        ("sp ace", "outside"),
    ],
)
def test_invalid_labels_name_the_label_and_the_rule(label: str, rule: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        policy_for(spec([f"CEDANA_CHECKPOINT={label}"]), "c1", "default")
    assert rule in str(info.value)
    assert echoed(label) in str(info.value)
    assert "CEDANA_CHECKPOINT" in str(info.value)


@given(st.text(alphabet="abcXYZ019._-", min_size=1, max_size=LABEL_MAX))
def test_valid_labels_pass_unchanged(label: str) -> None:
    if ".." in label:
        return
    assert validate_label(label, "test") == label


@pytest.mark.parametrize(
    "text, seconds", [("90s", 90), ("10m", 600), ("1h30m", 5400), ("45", 45), ("1.5m", 90)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text, "test") == seconds


@pytest.mark.parametrize("text", ["", "10x", "m10", "5s", "1h 2m", "-10m"])
def test_bad_or_too_short_durations(text: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_duration(text, "test")


@pytest.mark.parametrize(
    "text", ["nan", "NaN", "inf", "-inf", "infinity", "1e400", "1e9", "1e5m", "99999999h", "-20"]
)
def test_non_finite_or_absurd_intervals_are_refused(text: str) -> None:
    # float() takes nan/inf/1e400, and nan compares false to the minimum: it once
    # bypassed the 10 s floor (97 back-to-back checkpoints in 20 s).
    with pytest.raises(InvalidArgument, match="interval"):
        parse_duration(text, "env CEDANA_CHECKPOINT_INTERVAL")


def test_nan_interval_fails_the_container_creation() -> None:
    with pytest.raises(InvalidArgument, match="CEDANA_CHECKPOINT_INTERVAL"):
        policy_for(spec(["CEDANA_CHECKPOINT=x", "CEDANA_CHECKPOINT_INTERVAL=nan"]), "c1", "d")


@given(st.text(max_size=30))
def test_any_accepted_interval_is_finite_and_in_range(text: str) -> None:
    try:
        seconds = parse_duration(text, "test")
    except InvalidArgument:
        return
    assert 10.0 <= seconds <= 30 * 86400


# Other scripts' digits and spaces: str.isdigit(), \d, float() and str.strip() take
# them all, so Arabic-Indic "10m" once meant ten minutes.
@pytest.mark.parametrize(
    "text",
    ["\u0661\u0660m", "\uff11\uff10m", "\u0967\u0966", "1\u0660s", "10m\u00a0", "\u300010m"],
    ids=["arabic-indic", "fullwidth", "devanagari-seconds", "mixed", "nbsp", "ideographic-space"],
)
def test_an_interval_is_ascii_digits_only(text: str) -> None:
    with pytest.raises(InvalidArgument, match=r"is not a duration; write .*\(digits 0-9\)"):
        policy_for(spec(["CEDANA_CHECKPOINT=x", f"CEDANA_CHECKPOINT_INTERVAL={text}"]), "c1", "d")
    with pytest.raises(InvalidArgument, match="not a duration"):
        parse_duration(text, "node config checkpoint_interval")


@settings(max_examples=examples(200))
@given(
    st.text(
        st.characters(categories=("Nd", "Zs")) | st.sampled_from("0123456789.mhs \t"),
        max_size=12,
    )
)
def test_an_accepted_interval_is_written_in_ascii(text: str) -> None:
    try:
        parse_duration(text, "test")
    except InvalidArgument:
        return
    assert text.isascii()


@pytest.mark.parametrize(
    "env, mode",
    [
        ("CEDANA_ENABLE= On\t", Mode.MANUAL),
        ("CEDANA_ENABLE=\uff11", Mode.OFF),  # a fullwidth 1
        ("CEDANA_ENABLE=on\u3000", Mode.OFF),
        ("CEDANA_ENABLE=\u0661", Mode.OFF),
    ],
)
def test_enable_takes_ascii_words_only(env: str, mode: Mode) -> None:
    assert policy_for(spec([env]), "c1", "d").mode is mode


def test_a_fallback_takes_ascii_words_only() -> None:
    env = [f"CEDANA_RESTORE={CHECKPOINT_ID}", "CEDANA_RESTORE_FALLBACK= COLD\n"]
    assert policy_for(spec(env), "c1", "d").restore_fallback == "cold"
    env[1] = "CEDANA_RESTORE_FALLBACK=cold\u3000"
    with pytest.raises(InvalidArgument, match="restore fallback") as caught:
        policy_for(spec(env), "c1", "d")
    assert repr("cold\u3000") in str(caught.value)


def test_env_and_annotation_labels_that_differ_are_refused() -> None:
    s = spec(["CEDANA_CHECKPOINT=from-env"], **{"cedana.ai/checkpoint": "from-annotation"})
    with pytest.raises(InvalidArgument) as info:
        policy_for(s, "c1", "default")
    message = str(info.value)
    assert "from-env" in message and "from-annotation" in message and "conflicting" in message


def test_env_and_annotation_intervals_that_differ_are_refused() -> None:
    s = spec(
        ["CEDANA_CHECKPOINT=x", "CEDANA_CHECKPOINT_INTERVAL=10m"],
        **{"cedana.ai/checkpoint-interval": "15m"},
    )
    with pytest.raises(InvalidArgument, match="conflicting"):
        policy_for(s, "c1", "default")


def test_env_and_annotation_agreeing_are_fine() -> None:
    s = spec(["CEDANA_CHECKPOINT=same"], **{"cedana.ai/checkpoint": "same"})
    assert policy_for(s, "c1", "default").label == "same"


# -- restore by hand ------------------------------------------------------------------

CHECKPOINT_ID = "20261129T183000Z-3f9a1c2b"


def test_restore_by_env_with_a_label_keeps_the_label_and_auto_mode() -> None:
    p = policy_for(spec(["CEDANA_CHECKPOINT=lbl", f"CEDANA_RESTORE={CHECKPOINT_ID}"]), "c1", "d")
    assert (p.mode, p.label, p.restore, p.restore_fallback) == (
        Mode.AUTO, "lbl", CHECKPOINT_ID, "fail",
    )  # fmt: skip
    assert p.restores


def test_restore_alone_opts_in_by_hand_under_the_container_name() -> None:
    p = policy_for(spec(**{"cedana.ai/restore": "20261129"}), "ctr-7", "default")
    assert (p.mode, p.label, p.restore) == (Mode.MANUAL, "ctr-7", "20261129")
    assert p.restores
    assert not policy_for(spec(["CEDANA_ENABLE=1"]), "c1", "d").restores


def test_an_empty_restore_asks_for_nothing() -> None:
    p = policy_for(spec(["CEDANA_ENABLE=1", "CEDANA_RESTORE="]), "c1", "d")
    assert (p.mode, p.restore, p.restores) == (Mode.MANUAL, "", False)


def test_fallback_cold_from_env_or_annotation() -> None:
    env = [f"CEDANA_RESTORE={CHECKPOINT_ID}", "CEDANA_RESTORE_FALLBACK=Cold"]
    assert policy_for(spec(env), "c1", "d").restore_fallback == "cold"
    s = spec([f"CEDANA_RESTORE={CHECKPOINT_ID}"], **{"cedana.ai/restore-fallback": "cold"})
    assert policy_for(s, "c1", "d").restore_fallback == "cold"
    with pytest.raises(InvalidArgument, match=r"restore fallback 'warm'.*use 'cold'"):
        policy_for(
            spec([f"CEDANA_RESTORE={CHECKPOINT_ID}", "CEDANA_RESTORE_FALLBACK=warm"]), "c", "d"
        )


def test_restore_env_and_annotation_that_disagree_are_refused() -> None:
    s = spec([f"CEDANA_RESTORE={CHECKPOINT_ID}"], **{"cedana.ai/restore": "2026"})
    with pytest.raises(InvalidArgument, match="conflicting settings"):
        policy_for(s, "c1", "default")


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        ("../20261129", "path separator"),
        ("a\\b", "path separator"),
        ("2026..11", "'..'"),
        ("2026\n1129", "control characters"),
        ("2026\x7f", "control characters"),
        ("x" * 26, "over 25"),
        ("2026 1129", "outside"),
        ("2026;rm", "outside"),
    ],
)
def test_hostile_restore_values_are_refused_with_the_rule(value: str, rule: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        policy_for(spec([f"CEDANA_RESTORE={value}"]), "c1", "default")
    message = str(caught.value)
    assert rule in message and "(from env CEDANA_RESTORE)" in message


def test_image_digest_only_from_a_pinned_reference() -> None:
    digest = "sha256:" + "ab" * 32
    pinned = spec(["CEDANA_ENABLE=1"], **{"io.kubernetes.cri.image-name": f"reg/app@{digest}"})
    assert policy_for(pinned, "c1", "k8s.io").image_digest == digest
    tagged = spec(["CEDANA_ENABLE=1"], **{"io.kubernetes.cri.image-name": "reg/app:1"})
    assert policy_for(tagged, "c1", "k8s.io").image_digest == ""


HUGE = "9" * 100_000
# Every error that quotes a user's value, with a 100 KB value.
HUGE_VALUES = {
    "label": [f"CEDANA_CHECKPOINT={HUGE}"],
    "label-characters": [f"CEDANA_CHECKPOINT=a b{HUGE}"],
    "interval": [f"CEDANA_CHECKPOINT_INTERVAL={HUGE}m"],
    "interval-range": ["CEDANA_CHECKPOINT_INTERVAL=" + "1h" * 50_000],
    "restore": [f"CEDANA_RESTORE={HUGE}"],
    "fallback": [f"CEDANA_RESTORE={CHECKPOINT_ID}", f"CEDANA_RESTORE_FALLBACK={HUGE}"],
}


@pytest.mark.parametrize("env", HUGE_VALUES.values(), ids=HUGE_VALUES.keys())
def test_a_huge_value_is_echoed_by_its_start_and_length(env: list[str]) -> None:
    with pytest.raises(InvalidArgument) as caught:
        policy_for(spec(env), "c1", "default")
    message = str(caught.value)
    value = env[-1].partition("=")[2]
    assert echoed(value) in message
    assert len(message) < 400, message


def test_conflicting_huge_values_are_both_capped() -> None:
    s = spec([f"CEDANA_CHECKPOINT=a{HUGE}"], **{"cedana.ai/checkpoint": f"b{HUGE}"})
    with pytest.raises(InvalidArgument, match="conflicting") as caught:
        policy_for(s, "c1", "default")
    assert str(caught.value).count(f"... ({len(HUGE) + 1} characters)") == 2
    assert len(str(caught.value)) < 400


@given(st.text(max_size=2 * ECHO_MAX))
def test_echoed_is_the_value_whole_or_its_start_and_length(value: str) -> None:
    shown = echoed(value)
    if len(value) <= ECHO_MAX:
        assert shown == repr(value)
    else:
        assert shown == f"{value[:ECHO_MAX]!r}... ({len(value)} characters)"
