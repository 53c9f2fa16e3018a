"""``prep-data --executor slurm``: the job's units as a Slurm job array and its merge, submitted.

``DIR`` (``--emit``) gets ``job.json`` (the job: inputs, unit plan, the checked tokenizer
serialized, index header), ``units.sbatch`` (one array task per unit, each running ``porting
prep-data run-unit``), ``merge.sbatch`` (``porting prep-data finish``) and ``submit.sh``, which
submits the array and then the merge with ``--dependency=afterok``. :func:`submit` does the same
with ``sbatch`` for the units not yet done and records the job ids in ``submitted.json``;
:func:`follow` watches them to the dataset's report, and stops at the first task that failed,
naming it with its log. The tasks may run in any order, on any node that sees the inputs and the
output's directory, any number of times: a unit already done is checked and skipped, and
``finish`` merges in unit order and refuses while a unit is missing, naming it.

Slurm is asked through ``scontrol`` (a finished job stays there for the cluster's ``MinJobAge``,
5 minutes by default); a job it has forgotten is judged by what it left: the report, or the log.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from data_prep import units
from data_prep.report import report_path, write_json_atomic
from porting import slurm as sl
from porting.errors import PortingError
from porting.guard import output_lock

JOB_FILE = "job.json"
SUBMITTED = "submitted.json"


def emit(
    job: units.Job,
    directory: str | Path,
    partition: str | None = None,
    time_limit: str | None = None,
    what: str = "--emit",
) -> dict:
    """Write the job file and the sbatch scripts for ``job`` into ``directory``, as one set
    (:func:`porting.shell.write_set`): a failure leaves none of them new. ``what`` names the
    directory in an error (the flag it came from)."""
    from porting import shell

    if not job.units:
        raise PortingError("the inputs hold no data: nothing to tokenize (use --executor local)")
    out = Path(directory).absolute()
    python = shell.word(sys.executable, "this Python's path")
    job_file = shell.word(str(out / JOB_FILE), what)
    logs = out / "logs"
    n = len(job.units)
    # in the scripts, so that submit.sh by hand asks for what the command would
    asked = "".join(
        shell.directive(flag, value) + "\n"
        for flag, value in (("partition", partition), ("time", time_limit))
        if value
    )
    scripts = {
        "units.sbatch": (
            "#!/bin/bash\n"
            "#SBATCH --job-name=prep-data-units\n"
            f"{shell.directive('array', f'0-{n - 1}')}\n"
            "#SBATCH --cpus-per-task=1\n"
            f"{shell.directive('output', shell.log_pattern(logs, 'unit-%a.out', what), what)}\n"
            f"{asked}"
            "set -euo pipefail\n"
            f"exec {python} -m porting.cli prep-data run-unit --job {job_file} --unit "
            '"$SLURM_ARRAY_TASK_ID"\n'
        ),
        "merge.sbatch": (
            "#!/bin/bash\n"
            "#SBATCH --job-name=prep-data-merge\n"
            "#SBATCH --cpus-per-task=1\n"
            f"{shell.directive('output', shell.log_pattern(logs, 'merge.out', what), what)}\n"
            f"{asked}"
            "set -euo pipefail\n"
            f"exec {python} -m porting.cli prep-data finish --job {job_file}\n"
        ),
        "submit.sh": (
            "#!/bin/bash\n"
            "# The unit array, then the merge once every unit has succeeded.\n"
            "set -euo pipefail\n"
            'cd "$(dirname "$0")"\n'
            "units=$(sbatch --parsable units.sbatch)\n"
            'sbatch --dependency=afterok:"${units%%;*}" merge.sbatch\n'
        ),
    }
    job_text = json.dumps(units.job_to_json(job), indent=2, ensure_ascii=False) + "\n"
    files = {JOB_FILE: (job_text, 0o644)}
    files |= {name: (text, 0o755) for name, text in scripts.items()}
    shell.write_set(out, files, what)
    logs.mkdir(exist_ok=True)
    (out / SUBMITTED).unlink(missing_ok=True)  # an earlier submission's ids are not this job's
    return {"emit": str(out), "units": n, "staging": job.staging, "scripts": sorted(scripts)}


def load(job_file: str | Path, staged: bool = True) -> units.Job:
    """The job an emitted ``job.json`` describes, after checking that its staging directory is
    this job's (another job's is never written into); ``staged=False`` only reads it (a
    finished job's staging directory is gone)."""
    try:
        job = units.job_from_json(json.loads(Path(job_file).read_text()))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise PortingError(f"{job_file}: not a prep-data job file ({err})") from err
    if not staged:
        return job
    marker = Path(job.staging) / units.JOB
    try:
        fp = json.loads(marker.read_text()).get("fingerprint")
    except (OSError, json.JSONDecodeError) as err:
        raise PortingError(
            f"{marker}: unreadable ({err}); emit the job again (the staging directory is gone)"
        ) from err
    if fp != job.fingerprint:
        raise PortingError(
            f"{job.staging}: staged by another job than {job_file}; emit the job again"
        )
    return job


def run_unit(job_file: str | Path, index: int) -> dict:
    """One array task: tokenize unit ``index`` unless it is already done (checked)."""
    job = load(job_file)
    if not 0 <= index < len(job.units):
        raise PortingError(f"--unit {index}: the job has units 0-{len(job.units) - 1}")
    summary = units.verified(job, index)
    return summary if summary is not None else units.run_unit(job, index)


def finish(job_file: str | Path) -> dict:
    """The merge job: every unit checked, merged in order, the outputs and report written."""
    t0 = time.perf_counter()
    job = load(job_file)
    with output_lock(job.output_prefix, "dataset"):
        for key in job.json_keys:
            final = units.output_prefix_for(job.output_prefix, key)
            if Path(f"{final}.bin").exists() and not job.overwrite:
                raise PortingError(f"{final}.bin exists; emit with --overwrite to replace it")
        summaries = [units.verified(job, u.index) for u in job.units]
        missing = [u.index for u, s in zip(job.units, summaries, strict=True) if s is None]
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise PortingError(
                f"{job.staging}: {len(missing)} unit(s) not done ({shown}); run "
                f"`porting prep-data run-unit --job {job_file} --unit N` for each"
            )
        # Submitted by `prep-data --executor slurm`: the job's time counts from its submission
        # (queue, units and merge), which the rates in the report are of; by hand, the merge's.
        try:
            since = json.loads((Path(job_file).parent / SUBMITTED).read_text())["submitted_at"]
            seconds = time.time() - since
        except (OSError, json.JSONDecodeError, KeyError):
            seconds = time.perf_counter() - t0
        timing = {"units": len(job.units), "seconds": round(seconds, 3)}
        return units.finish(job, summaries, "slurm", timing)


def _ranges(indices: list[int]) -> str:
    """``0-3,7,9-10``: sbatch's --array for these indices."""
    parts, start = [], None
    for i, index in enumerate(indices):
        if start is None:
            start = index
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            parts.append(str(start) if start == index else f"{start}-{index}")
            start = None
    return ",".join(parts)


def refuse_live(directory: str | Path) -> None:
    """Refuse to stage a job over one submitted from ``DIR`` that Slurm still has queued or
    running: its tasks would find their staging replaced (and fail), and two merges race."""
    out = Path(directory)
    try:
        sub = json.loads((out / SUBMITTED).read_text())
    except (OSError, json.JSONDecodeError):
        return
    for job_id in (sub.get("units_job"), sub.get("merge_job")):
        for task in sl.tasks(job_id) or []:
            state = task.get("JobState", "")
            if state and state not in sl.FAILED_STATES and state != "COMPLETED":
                raise PortingError(
                    f"{out}: Slurm job {job_id} submitted from here is still {state.lower()}; "
                    f"follow it (`porting prep-data status --job {out / JOB_FILE} --wait`) or "
                    f"cancel it (scancel {job_id}) first"
                )


def submit(job: units.Job, directory: str | Path) -> dict:
    """Submit the units not yet done (checked) as one array, then the merge after them; the ids go
    to ``DIR/submitted.json``. A merge that cannot be submitted cancels the array."""
    out = Path(directory)
    todo = [u.index for u in job.units if units.verified(job, u.index) is None]
    units_job = None
    if todo:
        units_job = sl.sbatch(
            [f"--array={_ranges(todo)}", str(out / "units.sbatch")], "the unit array"
        )
    merge_job = None
    try:
        after = [f"--dependency=afterok:{units_job}", "--kill-on-invalid-dep=yes"]
        merge_job = sl.sbatch(
            [*(after if units_job else []), str(out / "merge.sbatch")], "the merge job"
        )
        record = {
            "units_job": units_job,
            "merge_job": merge_job,
            "submitted_units": len(todo),
            "submitted_at": time.time(),
        }
        # unrecorded, the jobs could be neither followed nor refused by a rerun: cancelled
        write_json_atomic(out / SUBMITTED, record)
        print(
            f"submitted Slurm jobs {units_job or '(no unit left)'} (units) and {merge_job} "
            f"(merge); logs in {out / 'logs'}",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    except BaseException as err:
        said = sl.cancel([units_job, merge_job])
        if isinstance(err, PortingError):
            raise PortingError(f"{err}\n{said}" if said else str(err)) from err
        raise
    return record


@dataclass
class Progress:
    """Where a submitted job stands: units done, and either finished, failed (why) or going."""

    done: int
    total: int
    finished: bool = False
    failed: str | None = None
    line: str = ""


def progress(directory: str | Path) -> Progress:
    """Ask Slurm and the staging directory where the job of ``DIR`` stands."""
    out = Path(directory)
    job = load(out / JOB_FILE, staged=False)
    try:
        sub = json.loads((out / SUBMITTED).read_text())
    except (OSError, json.JSONDecodeError):
        raise PortingError(f"{out}: nothing submitted from here ({SUBMITTED} missing)") from None
    staging = Path(job.staging)
    total = len(job.units)
    done = len(list(staging.glob("u*.json"))) if staging.is_dir() else total
    report = report_path(job.output_prefix)
    produced = report.is_file() and report.stat().st_mtime >= sub["submitted_at"] - 1
    unit_tasks, merge = sl.tasks(sub["units_job"]), sl.tasks(sub["merge_job"])
    resume = f"finished units kept in {staging}; rerun the same command with --resume"
    for task in unit_tasks or []:
        state = task.get("JobState", "")
        if state in sl.FAILED_STATES:
            index = task.get("ArrayTaskId", "?")
            if state == "CANCELLED" and not produced:
                why = (
                    f"the unit array (job {sub['units_job']}) was cancelled after {done} of "
                    f"{total} units"
                )
            else:
                log_file = out / "logs" / f"unit-{index}.out"
                why = (
                    f"unit {index} (job {sub['units_job']}_{index}) ended {sl.ended(task)}; its "
                    f"log {log_file} ends:\n{sl.tail(log_file)}"
                )
            return Progress(done, total, failed=f"{why}\n{resume}")
    merge_state = merge[0].get("JobState", "") if merge else None
    if merge_state == "COMPLETED" or (merge is None and produced):
        if not produced:
            raise sl.JobEnded(
                f"merge job {sub['merge_job']} completed but {report} is missing: nothing is "
                "taken as written. The output must be on a file system every node sees, not a "
                "node-local path"
            )
        return Progress(total, total, finished=True, line="merged")
    if merge is None:
        return Progress(done, total, failed=(
            f"Slurm no longer knows merge job {sub['merge_job']} and it wrote no report; its "
            f"log {out / 'logs' / 'merge.out'} ends:\n{sl.tail(out / 'logs' / 'merge.out')}"
        ))  # fmt: skip
    if merge_state in sl.FAILED_STATES:
        return Progress(done, total, failed=(
            f"merge job {sub['merge_job']} ended {merge_state} (exit "
            f"{merge[0].get('ExitCode', '?')}); its log {out / 'logs' / 'merge.out'} ends:\n"
            f"{sl.tail(out / 'logs' / 'merge.out')}\n{resume}"
        ))  # fmt: skip
    states: dict[str, int] = {}
    for task in unit_tasks or []:
        states[task.get("JobState", "?")] = states.get(task.get("JobState", "?"), 0) + 1
    line = ", ".join(f"{n} {state.lower()}" for state, n in sorted(states.items()))
    return Progress(
        done, total, line=f"units: {line or 'none queued'}; merge {merge_state.lower()}"
    )


def submitted(directory: str | Path) -> list[str]:
    """The ids of the jobs ``DIR`` submitted (none when nothing is recorded)."""
    try:
        sub = json.loads((Path(directory) / SUBMITTED).read_text())
    except (OSError, json.JSONDecodeError):
        return []
    return [j for j in (sub.get("units_job"), sub.get("merge_job")) if isinstance(j, str) and j]


def cancel(directory: str | Path) -> list[str]:
    """Cancel what ``DIR`` submitted; the ids cancelled."""
    ids = submitted(directory)
    sl.cancel(ids)
    return ids


def follow(directory: str | Path, show_progress: bool, poll_s: float = 1.0) -> dict:
    """Watch the job of ``DIR`` to its end: the dataset's report, or an error naming the task
    that failed and its log (the rest of the job cancelled, the finished units kept). Ctrl-C,
    SIGTERM, an error, or Slurm not answering for longer than :data:`porting.slurm.PATIENCE_S`
    cancels the job too, as ``srun`` does (:func:`porting.slurm.follow`)."""
    from tqdm import tqdm

    out = Path(directory)
    ids = submitted(out)
    try:
        job = load(out / JOB_FILE, staged=False)
    except PortingError as err:  # nothing could be followed: nothing is left running
        raise PortingError(f"{err}\n{sl.cancel(ids)}") from err
    bar = tqdm(total=len(job.units), unit="unit", desc="slurm", disable=not show_progress)

    def poll() -> bool:
        now = progress(out)
        bar.update(now.done - bar.n)
        bar.set_postfix_str(now.line, refresh=True)
        if now.failed:
            raise sl.JobEnded(f"{now.failed}\n{sl.cancel(ids)}")
        return now.finished

    try:
        sl.follow(
            ids, poll, poll_s=poll_s,
            then=f"finished units kept in {job.staging}; rerun the same command with --resume",
        )  # fmt: skip
    finally:
        bar.close()
    return json.loads(report_path(job.output_prefix).read_text())
