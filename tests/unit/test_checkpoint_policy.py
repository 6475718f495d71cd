"""Who opts in, under which label and scope; bad labels fail loudly."""

from typing import Any

import pytest
from cedana_shim.checkpoint.policy import (
    LABEL_MAX,
    Mode,
    parse_duration,
    policy_for,
    validate_label,
)
from cedana_shim.errors import InvalidArgument
from hypothesis import given
from hypothesis import strategies as st


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
    assert repr(label) in str(info.value)
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


def test_a_huge_restore_value_is_not_echoed_whole() -> None:
    with pytest.raises(InvalidArgument) as caught:
        policy_for(spec(["CEDANA_RESTORE=" + "9" * 100_000]), "c1", "default")
    assert len(str(caught.value)) < 400


def test_image_digest_only_from_a_pinned_reference() -> None:
    digest = "sha256:" + "ab" * 32
    pinned = spec(["CEDANA_ENABLE=1"], **{"io.kubernetes.cri.image-name": f"reg/app@{digest}"})
    assert policy_for(pinned, "c1", "k8s.io").image_digest == digest
    tagged = spec(["CEDANA_ENABLE=1"], **{"io.kubernetes.cri.image-name": "reg/app:1"})
    assert policy_for(tagged, "c1", "k8s.io").image_digest == ""
