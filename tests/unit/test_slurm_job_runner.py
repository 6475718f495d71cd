"""The runner's side of the contract with the SPANK plugin: its command line, the
scope of the job's labels, and how it fails when it cannot protect a job."""

from __future__ import annotations

import os
import pwd
import string
import subprocess
import sys

import pytest
from cedana_shim.errors import InvalidArgument
from cedana_shim.slurm import task_link
from cedana_shim.slurm.runner import EXIT_RUNNER_FAILED, job_scope, parse_request, scope_name
from hypothesis import given
from hypothesis import strategies as st

ARGV = ["--job-id", "42", "--step-id", "batch", "--uid", "1000", "--gid", "100"]
RUNNER = "import sys; from cedana_shim.cli.slurm_task import main; sys.exit(main())"


def test_parse_request_takes_the_plugins_argv_and_the_jobs_environment() -> None:
    request, config = parse_request(
        [
            *(*ARGV, "--gids", "100,27", "--cwd", "/home/ada", "--config", "/etc/c.toml"),
            *("--", "/home/ada/job.sh", "--x", "--", "y"),
        ],
        {"CEDANA_SLURM": "1", "CEDANA_CHECKPOINT": "v", "HOME": "/home/ada"},
    )
    assert (request.job_id, request.step_id, request.uid, request.gid) == ("42", "batch", 1000, 100)
    assert request.gids == (100, 27)
    assert request.cwd == "/home/ada"
    assert request.argv == ("/home/ada/job.sh", "--x", "--", "y")
    assert dict(request.env) == {"CEDANA_CHECKPOINT": "v", "HOME": "/home/ada"}
    assert request.name == "42.batch"
    assert request.container_id == "slurm-42.batch"
    assert config == "/etc/c.toml"
    request, config = parse_request([*ARGV, "--cwd", "/", "--", "a.sh"], {})
    assert (request.gids, config) == ((), "")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*ARGV, "--cwd", "/", "--"], "no job command"),
        (["--job-id", "4/2", *ARGV[2:], "--cwd", "/", "--", "x"], "is not a number"),
        (["--job-id", "42", "--step-id", "../b", *ARGV[4:], "--cwd", "/", "--", "x"], "step id"),
        ([*ARGV, "--gids", "a,b", "--cwd", "/", "--", "x"], "not a list of numbers"),
        ([*ARGV, "--cwd", "/", "--config", "c.toml", "--", "x"], "not an absolute path"),
    ],
)
def test_parse_request_refuses_a_bad_command_line(argv: list[str], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parse_request(argv, {})


def test_scope_is_the_cluster_and_the_user_of_the_uid() -> None:
    me = pwd.getpwuid(os.getuid()).pw_name
    assert job_scope("hpc1", os.getuid()) == f"slurm-hpc1-{me}"
    unknown = 2_000_000_000
    with pytest.raises(KeyError):
        pwd.getpwuid(unknown)
    assert job_scope("hpc1", unknown) == f"slurm-hpc1-uid{unknown}"
    with pytest.raises(InvalidArgument, match="SLURM_CLUSTER_NAME"):
        job_scope("", os.getuid())
    with pytest.raises(InvalidArgument, match="cluster name"):
        job_scope("a/b", os.getuid())


NAMES = st.text(alphabet=string.ascii_letters + string.digits + "._-", min_size=1, max_size=64)


def test_the_reviews_colliding_pairs_get_scopes_of_their_own() -> None:
    assert scope_name("hpc", "lab-x") == "slurm-hpc-lab-x"  # as before: no '-' in "hpc"
    assert scope_name("hpc-lab", "x") == "slurm--7-hpc-lab-x"


@given(NAMES, NAMES, NAMES, NAMES)
def test_distinct_clusters_and_users_never_share_a_scope(
    c1: str, u1: str, c2: str, u2: str
) -> None:
    if (c1, u1) != (c2, u2):
        assert scope_name(c1, u1) != scope_name(c2, u2)


@given(NAMES, NAMES)
def test_a_pair_shares_no_scope_with_a_near_miss(cluster: str, user: str) -> None:
    """Hypothesis rarely draws two colliding pairs at random: these are the ones a
    '-' makes, the cluster's tail moved into the user and back."""
    scope = scope_name(cluster, user)
    for cut in range(1, len(cluster)):
        if cluster[cut] == "-" and cut + 1 < len(cluster):
            assert scope_name(cluster[:cut], cluster[cut + 1 :] + "-" + user) != scope
    for cut in range(1, len(user)):
        if user[cut] == "-" and cut + 1 < len(user):
            assert scope_name(cluster + "-" + user[:cut], user[cut + 1 :]) != scope


@given(NAMES.filter(lambda c: "-" not in c), NAMES)
def test_a_cluster_name_without_a_dash_keeps_the_scope_stored_checkpoints_have(
    cluster: str, user: str
) -> None:
    assert scope_name(cluster, user) == f"slurm-{cluster}-{user}"


def run_runner(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    # The cold path (no warm template to leave behind after a unit test).
    return subprocess.run(
        [sys.executable, "-c", RUNNER, *argv],
        env={**env, "CEDANA_FORKSERVER": "0"},
        capture_output=True,
        timeout=30,
    )


def test_a_job_that_cannot_be_protected_fails_with_the_reason() -> None:
    done = run_runner(
        [*ARGV, "--cwd", "/", "--", "/bin/true"],
        {"SLURM_CLUSTER_NAME": "hpc1", "CEDANA_CHECKPOINT": "bad label!"},
    )
    assert done.returncode == EXIT_RUNNER_FAILED
    assert b"cedana: cannot protect this job: checkpoint label 'bad label!'" in done.stderr
    done = run_runner([*ARGV, "--cwd", "/", "--", "/bin/true"], {"CEDANA_ENABLE": "1"})
    assert done.returncode == EXIT_RUNNER_FAILED
    assert b"SLURM_CLUSTER_NAME" in done.stderr


def test_a_job_that_did_not_opt_in_runs_as_it_would_without_us() -> None:
    me = os.getuid()
    done = run_runner(
        [
            *("--job-id", "42", "--step-id", "batch", "--uid", str(me), "--gid", str(os.getgid())),
            *("--cwd", "/", "--", "/bin/sh", "-c", 'pwd; echo "$X"; exit 4'),
        ],
        {"SLURM_CLUSTER_NAME": "hpc1", "CEDANA_ENABLE": "0", "X": "kept", "PATH": "/bin"},
    )
    assert done.returncode == 4, done.stderr
    assert done.stdout == b"/\nkept\n"
    assert done.stderr == b""


def test_the_jobs_environment_can_come_from_a_file_descriptor() -> None:
    r, w = os.pipe()
    os.write(w, b"CEDANA_CHECKPOINT=v\0X=a=b\0CEDANA_SLURM=1\0broken\0")
    os.close(w)
    request, _ = parse_request(
        [*ARGV, "--cwd", "/", "--env-fd", str(r), "--", "job.sh"], {"LD_PRELOAD": "/evil.so"}
    )
    assert dict(request.env) == {"CEDANA_CHECKPOINT": "v", "X": "a=b"}
    with pytest.raises(OSError):
        os.fstat(r)  # read and closed
    with pytest.raises(InvalidArgument, match="cannot read the job's environment from fd"):
        parse_request([*ARGV, "--cwd", "/", "--env-fd", str(r), "--", "job.sh"], {})


def test_the_task_process_hands_the_keeper_a_rereadable_environment() -> None:
    """The keeper reads the job's environment from --env-fd at offset 0, and so can the
    task process afterwards (a job that turns out unprotected): a pipe is copied into a
    memfd; without --env-fd the runner's own environment is the job's."""
    r, w = os.pipe()
    os.write(w, b"A=1\0")
    os.close(w)
    argv, fd = task_link.with_job_env_fd([*ARGV, "--env-fd", str(r), "--", "x"], {})
    assert argv[argv.index("--env-fd") + 1] == str(fd) and fd != r
    assert os.pread(fd, 100, 0) == b"A=1\0" and not os.get_inheritable(fd)
    os.close(fd)
    given = [*ARGV, "--cwd", "/", "--", "x", "--env-fd", "9"]
    argv, fd = task_link.with_job_env_fd(given, {"B": "2"})
    assert argv == [*given[:-4], "--env-fd", str(fd), *given[-4:]]  # the job's are its own
    request, _ = parse_request(argv, {})
    assert dict(request.env) == {"B": "2"} and request.argv == ("x", "--env-fd", "9")
    assert task_link.replace_env_fd(["--env-fd", "3", "--", "y"], 7) == [
        *("--env-fd", "7", "--", "y")
    ]


def test_the_task_process_reads_the_keepers_answer() -> None:
    task_end, keeper_end = task_link.link()
    keeper_end.send(b"13")
    keeper_end.send(b"7\n")
    assert task_link.wait_for_keeper(task_end) == 137
    keeper_end.send(task_link.RUN_UNPROTECTED + b"\n")
    assert task_link.wait_for_keeper(task_end) is None
    keeper_end.close()
    assert task_link.wait_for_keeper(task_end) == EXIT_RUNNER_FAILED
