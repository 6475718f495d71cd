"""The batch step's script at the checkpointed job's spool path (slurm/batch_script.py):
made only for another job's batch step, only where nothing is, removed at the end."""

from __future__ import annotations

import os
from pathlib import Path

from cedana_shim.slurm.batch_script import BatchScript
from cedana_shim.slurm.job_spec import batch_job_of


def test_the_job_of_a_batch_steps_container() -> None:
    assert batch_job_of("slurm-13.batch") == 13
    assert batch_job_of("slurm-13.0") is None
    assert batch_job_of("slurm-x.batch") is None
    assert batch_job_of("k8s-13.batch") is None


def spool_with_script(tmp_path: Path) -> Path:
    job = tmp_path / "job00014"
    job.mkdir(mode=0o750)
    (job / "slurm_script").write_text("#!/bin/bash\nsleep 600\n")
    os.chmod(job / "slurm_script", 0o500)
    return job / "slurm_script"


def test_another_jobs_path_holds_this_jobs_script_until_the_end(tmp_path: Path) -> None:
    script = BatchScript("14", "batch", (str(spool_with_script(tmp_path)),))
    script.stage_for("slurm-13.batch")
    old = tmp_path / "job00013" / "slurm_script"
    assert old.read_text() == "#!/bin/bash\nsleep 600\n"
    assert old.stat().st_mode & 0o7777 == 0o500
    assert (tmp_path / "job00013").stat().st_mode & 0o7777 == 0o750
    script.remove_staged()
    assert not (tmp_path / "job00013").exists()
    assert (tmp_path / "job00014" / "slurm_script").exists()


def test_nothing_is_made_for_the_same_job_a_step_or_a_path_that_is_there(tmp_path: Path) -> None:
    path = spool_with_script(tmp_path)
    (tmp_path / "job00012").mkdir()
    script = BatchScript("14", "batch", (str(path),))
    for container in ("slurm-14.batch", "slurm-13.0", "slurm-12.batch"):
        script.stage_for(container)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job00012", "job00014"]
    script.remove_staged()
    assert (tmp_path / "job00012").is_dir()  # never anything stage_for did not make
    BatchScript("14", "0", (str(path),)).stage_for("slurm-13.batch")
    BatchScript("14", "batch", ("/bin/true",)).stage_for("slurm-13.batch")
    assert not (tmp_path / "job00013").exists()
