"""Running a sweep: train every unfinished run (here, in worker processes, or as submitit jobs), then
write the results and the report. Above `runs` (planning, one run's training and measurement),
`results` (aggregation, verdicts, the report) and `attnlab.experiments.launch` (the cluster
launcher), each of which imports `runs` and none of which imports this module."""

from __future__ import annotations

import os
from pathlib import Path

from attnlab import interrupt
from attnlab.lock import FolderLock, check_free
from attnlab.models.config import ConfigError
from attnlab.pool import run_pool

from ..launch import SUBMITIT_DIR, SweepJob, launch
from .budget import check_budget
from .records import check_target, write_records
from .results import whole_command, write_results
from .runs import RunPlan, execute, plan, summary_of
from .spec import Spec, SweepError, load_spec


def run(
    spec: Spec | str | os.PathLike,
    *,
    out: str | os.PathLike | None = None,
    jobs: int = 1,
    progress: bool = True,
    quiet: bool = False,
    command: str | None = None,
    plans: list[RunPlan] | None = None,
    launcher=None,
    only: list[str] | None = None,
    records: str | os.PathLike | None = None,
) -> dict:
    """Train every run that is not finished (`jobs` at once), then write OUT/results.json,
    report.md and plots from all run folders (OUT: `out` or the spec's); returns the results dict
    (every run, mean and sd per variant, "verdicts" with outcome and reason). spec: a Spec or a path;
    plans: what `plan` returned; `launcher` (a launch.Launcher) makes each unfinished run a submitit
    job; `only` ("variant/seedK" names) trains just those runs, one piece of a sweep run in pieces
    (docs/guide/experiments.md: the results it writes hold them beside every run OUT/results.json
    recorded before). `records` (a folder): after each run finishes, rewrite the spec's records file
    there with every finished run `only` names (all runs without it): what `attnlab sweep --merge`
    folds into results.json elsewhere (.records). Raises ConfigError / SweepError as `plan` does
    (SweepError for a name in `only` that is no run of the spec, or a records file there of another
    spec), FolderBusy when another process writes OUT."""
    from tqdm.auto import tqdm

    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs must be an int >= 1, got {jobs!r}")
    out = Path(out) if out is not None else spec.out
    plans = plans if plans is not None else plan(spec, out, jobs=jobs)
    todo = [p for p in plans if p.state not in ("done", "recorded")]
    if any(p.state != "evaluate" for p in todo):
        check_budget(spec, plans)  # nothing is trained below the budget rule without a stated reason
    chosen = plans
    if only is not None:
        names = select_runs(plans, only)
        todo = [p for p in todo if f"{p.variant}/seed{p.seed}" in names]
        chosen = [p for p in plans if f"{p.variant}/seed{p.seed}" in names]
    if records is not None:
        check_target(spec, records)

    def finished() -> None:  # the records of the runs finished so far, after each run
        if records is not None:
            write_records(spec, chosen, records, out)
    counts = {s: sum(p.state == s for p in plans) for s in ("done", "recorded", "evaluate", "resume", "restart", "new")}
    if not quiet:
        print(f"sweep {spec.title!r}: {len(spec.variants)} variants x {len(spec.seeds)} seeds = {len(plans)} runs "
              f"({', '.join(f'{n} {s}' for s, n in counts.items() if n)}) in {out}", flush=True)
    jobs_list = [{"raw": p.raw, "state": p.state, "metrics": spec.metrics} for p in todo]
    collect = launcher is not None and launcher.kind == "slurm"  # its runs may be training in jobs left running
    for folder in [out] + ([] if collect else [p.run_dir for p in todo]):  # another sweep, or a manual run
        check_free(folder)
    with FolderLock(out):
        bar = tqdm(total=len(plans), initial=len(plans) - len(todo), desc="sweep", unit="run", disable=not progress,
                   dynamic_ncols=True)
        try:
            if launcher is not None:
                launch([(f"{p.variant}/seed{p.seed}", SweepJob(job)) for p, job in zip(todo, jobs_list)], launcher,
                       out / SUBMITIT_DIR, bar=bar, stopped=lambda: _stopped(plans, todo), quiet=quiet)
            elif jobs == 1 or len(todo) <= 1:
                with interrupt.graceful():
                    for p, job in zip(todo, jobs_list):
                        bar.set_postfix_str(f"{p.variant}/seed{p.seed}")
                        execute(job)
                        finished()
                        bar.update(1)
                        interrupt.check(lambda: _stopped(plans, todo))
            else:
                _run_pool(todo, jobs_list, jobs, bar, plans, finished)
        finally:
            bar.close()
        if records is not None:
            _say_records(spec, chosen, records, out, quiet)
        # nothing trained now: the report keeps the command and machine that trained the runs (report_only)
        return write_results(spec, out, command=command, quiet=quiet, report_only=not todo)


def select_runs(plans: list[RunPlan], only: list[str]) -> set[str]:
    """The runs `only` names ("variant/seedK"), checked against the spec's (SweepError naming the others)."""
    names = {f"{p.variant}/seed{p.seed}" for p in plans}
    unknown = [n for n in only if n not in names]
    if unknown:
        raise SweepError(f"--only names runs the spec does not have: {', '.join(unknown)}; its runs are "
                         f"{', '.join(sorted(names))}")
    return set(only)


def _stopped(plans: list[RunPlan], todo: list[RunPlan]) -> str:
    """Where an interrupted sweep stands: runs finished, and those saved to resume."""
    done = sum(summary_of(p.run_dir, p.cfg.train.steps) is not None for p in plans)
    return f"sweep stopped with {done} of {len(plans)} runs finished; the others resume from their checkpoints"

def _say_records(spec: Spec, chosen: list[RunPlan], folder, out: Path, quiet: bool) -> None:
    """Write the records file once more (runs finished before this command count too) and say what it holds."""
    path = write_records(spec, chosen, folder, out)
    if quiet:
        return
    elsewhere = [f"{p.variant}/seed{p.seed}" for p in chosen if p.state == "recorded"]
    print(f"records: {path if path else 'none written: no run finished'}"
          + (f"; not in it: {', '.join(elsewhere)} (results.json records them: trained elsewhere)" if elsewhere else ""),
          flush=True)


def _run_pool(todo: list[RunPlan], jobs_list: list[dict], jobs: int, bar, plans: list[RunPlan],
              finished=lambda: None) -> None:
    """Train `todo` in `jobs` worker processes (`attnlab.pool.run_pool`: the first SIGINT/SIGTERM
    reaches every worker, each finishes its step, checkpoints and stops; queued runs are not started)."""

    def done(i: int) -> None:
        finished()
        bar.set_postfix_str(f"{todo[i].variant}/seed{todo[i].seed}")
        bar.update(1)

    run_pool(execute, [(job,) for job in jobs_list], jobs, on_done=done, stopped=lambda: _stopped(plans, todo))


def run_queue(specs: list[Spec | str | os.PathLike], *, jobs: int = 1, progress: bool = True, quiet: bool = False,
              records: str | os.PathLike | None = None) -> list[dict]:
    """Several sweeps as one queue: every unfinished run of every spec, in the specs' order, `jobs` at
    once, so that no core idles at the end of one sweep while the next waits. Each spec's results.json
    and report are written as soon as its last run finishes (and `records`, if given, after each of its
    runs); returns the results of each spec. Every spec is loaded and planned, and the budget rule
    checked, before anything trains. Each report names the command that trains its own sweep alone."""
    from contextlib import ExitStack

    from tqdm.auto import tqdm

    specs = [s if isinstance(s, Spec) else load_spec(s) for s in specs]
    outs = [s.out for s in specs]
    dup = sorted({str(o) for o in outs if outs.count(o) > 1})
    if dup:
        raise SweepError(f"a queue trains each sweep once: {', '.join(dup)} is the output folder of more than one spec")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs must be an int >= 1, got {jobs!r}")
    plans = [plan(s, s.out, jobs=jobs) for s in specs]
    todos = [[p for p in ps if p.state not in ("done", "recorded")] for ps in plans]
    for s, ps, todo in zip(specs, plans, todos):
        if any(p.state != "evaluate" for p in todo):
            check_budget(s, ps)
        if records is not None:
            check_target(s, records)
        for folder in [s.out] + [p.run_dir for p in todo]:
            check_free(folder)
    queue = [(k, p) for k, todo in enumerate(todos) for p in todo]
    if not quiet:
        print(f"queue of {len(specs)} sweeps: {len(queue)} runs to train, {jobs} at once", flush=True)
    left = [len(t) for t in todos]
    commands = [whole_command(s, s.out) + (f" --jobs {jobs}" if jobs > 1 else "") for s in specs]
    results: list[dict | None] = [None] * len(specs)

    def finished(i: int) -> None:
        k = queue[i][0]
        left[k] -= 1
        if records is not None:
            write_records(specs[k], plans[k], records, specs[k].out)
        if left[k] == 0:
            results[k] = write_results(specs[k], specs[k].out, command=commands[k], quiet=quiet)

    every = [p for ps in plans for p in ps]
    with ExitStack() as stack:
        for s in specs:
            stack.enter_context(FolderLock(s.out))
        bar = tqdm(total=len(queue), desc="queue", unit="run", disable=not progress, dynamic_ncols=True)
        jobs_list = [{"raw": p.raw, "state": p.state, "metrics": specs[k].metrics} for k, p in queue]
        todo_all = [p for _, p in queue]

        def done(i: int) -> None:
            finished(i)
            bar.set_postfix_str(f"{queue[i][1].variant}/seed{queue[i][1].seed}")
            bar.update(1)
        try:
            if jobs == 1 or len(queue) <= 1:
                with interrupt.graceful():
                    for i, job in enumerate(jobs_list):
                        execute(job)
                        done(i)
                        interrupt.check(lambda: _stopped(every, todo_all))
            else:
                run_pool(execute, [(job,) for job in jobs_list], jobs, on_done=done,
                         stopped=lambda: _stopped(every, todo_all))
        finally:
            bar.close()
        for k, s in enumerate(specs):  # sweeps with nothing left to train: their report rebuilt
            if results[k] is None:
                results[k] = write_results(s, s.out, command=commands[k], quiet=quiet, report_only=not todos[k])
    return results
