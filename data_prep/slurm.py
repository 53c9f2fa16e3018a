"""``prep-data --executor slurm --emit DIR``: the job's units as a Slurm job array, and its merge.

Nothing is submitted here. ``DIR`` gets ``job.json`` (the job: inputs, unit plan, the checked
tokenizer serialized, index header), ``units.sbatch`` (one array task per unit, each running
``porting prep-data run-unit``), ``merge.sbatch`` (``porting prep-data finish``) and
``submit.sh``, which submits the array and then the merge with ``--dependency=afterok``. The
tasks may run in any order, on any node that sees the inputs and the output's directory, any
number of times: a unit already done is checked and skipped, and ``finish`` merges in unit order
and refuses while a unit is missing, naming it.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from data_prep import units
from data_prep.report import write_json_atomic
from porting.errors import PortingError
from porting.guard import output_lock

JOB_FILE = "job.json"


def emit(job: units.Job, directory: str | Path) -> dict:
    """Write the job file and the sbatch scripts for ``job`` into ``directory``."""
    if not job.units:
        raise PortingError("the inputs hold no data: nothing to tokenize (use --executor local)")
    out = Path(directory).absolute()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / JOB_FILE, units.job_to_json(job))
    cli = f"{shlex.quote(sys.executable)} -m porting.cli prep-data"
    job_file = shlex.quote(str(out / JOB_FILE))
    logs = shlex.quote(str(out / "logs"))
    n = len(job.units)
    scripts = {
        "units.sbatch": (
            "#!/bin/bash\n"
            "#SBATCH --job-name=prep-data-units\n"
            f"#SBATCH --array=0-{n - 1}\n"
            "#SBATCH --cpus-per-task=1\n"
            f"#SBATCH --output={logs}/unit-%a.out\n"
            "set -euo pipefail\n"
            f'exec {cli} run-unit --job {job_file} --unit "$SLURM_ARRAY_TASK_ID"\n'
        ),
        "merge.sbatch": (
            "#!/bin/bash\n"
            "#SBATCH --job-name=prep-data-merge\n"
            "#SBATCH --cpus-per-task=1\n"
            f"#SBATCH --output={logs}/merge.out\n"
            "set -euo pipefail\n"
            f"exec {cli} finish --job {job_file}\n"
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
    for name, text in scripts.items():
        path = out / name
        path.write_text(text)
        path.chmod(0o755)
    return {"emit": str(out), "units": n, "staging": job.staging, "scripts": sorted(scripts)}


def load(job_file: str | Path) -> units.Job:
    """The job an emitted ``job.json`` describes, after checking that its staging directory is
    this job's (another job's is never written into)."""
    try:
        job = units.job_from_json(json.loads(Path(job_file).read_text()))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise PortingError(f"{job_file}: not a prep-data job file ({err})") from err
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
        timing = {"units": len(job.units)}
        report = units.finish(job, summaries, "slurm", timing)
    report["time"]["seconds"] = round(time.perf_counter() - t0, 3)
    return report
