"""The Slurm job's supervisor: runs the job's step (srun), and after each attempt applies the attempt policy
(deploy/policy.py) inside the same allocation. Both batch scripts reach it through slurm/requeue.sh, which
makes their `srun ...` line `python -m deploy.slurm.supervise -- ...`:

    python -m deploy.slurm.supervise -- --kill-on-bad-exit=1 --output=... python -m job train ...

Variables it reads (the batch script's environment; make submit-slurm sets the JOB_* ones):
  JOB_NODES    nodes a step uses (NODES); the allocation's other nodes are spares (SPARES). Default: all.
  JOB_RETRIES  the retry budget (RETRIES, default 3; 0: none). JOB_LOG_DIR  where the job's records go.
  SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURM_NTASKS_PER_NODE (or SLURM_TASKS_PER_NODE), SLURM_RESTART_COUNT.

After a failure (an exit code other than 0, 2 and 75) with a spare left, the next step starts at once in the
same allocation, on the spare instead of the node whose process failed first, and resumes from the newest
checkpoint: no queue, the same job id. The rest of the policy (requeue, stop) is deploy/policy.py's. Ctrl-C
(SIGINT) is passed on to the step, whose processes save and exit 130; on SIGTERM (Slurm ending the job) the
supervisor waits for the step, and a job that was cancelled is recorded so and never requeued. Each
attempt's record (job/runs/attempts.py) is one `ended` line in RUN_DIR/attempts.jsonl (the run dir process 0
notes at its start), numbered there, and in JOB_LOG_DIR/JOBID-attempts.jsonl (JOB_ATTEMPTS, which also counts
the job's retries across requeues). A run dir that cannot be written is one warning; the supervisor goes on.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from deploy.policy import Decision, Situation, decide
from deploy.runner import Runner
from job.core import exits, internals
from job.runs.attempts import ENV as ATTEMPTS_ENV
from job.runs.attempts import Action, Ended, JobLog, Outcome
from job.runtime.cluster.nodelist import expand_nodelist

NODES_ENV = "JOB_NODES"
RETRIES_ENV = "JOB_RETRIES"
LOG_DIR_ENV = "JOB_LOG_DIR"
DEFAULT_RETRIES = 3
PROBE_TIMEOUT_S = 60  # a probe step on a failed node: longer means it does not answer
_TASK_FAILED = re.compile(r"^srun: error: ([^: ]+): tasks? ([0-9,-]+): (.*)$")
_NODE_FAILED = re.compile(r"^srun: error: Node failure on ([^ ]+)")
_EXITED = re.compile(r"^Exited with exit code (\d+)$")
# options of srun that choose the step's nodes or tasks: the supervisor sets them when it picks the nodes
_PLACEMENT = ("-N", "--nodes", "-n", "--ntasks", "-w", "--nodelist", "-x", "--exclude")


@dataclasses.dataclass(frozen=True)
class Failure:
    """The process that failed first, from srun's own messages."""

    node: str | None
    process: str | None  # its task number (its JAX process index)
    cause: str  # srun's words: 'Killed', 'Exited with exit code 1', 'node failure'
    code: int | None  # the process's own exit code, where srun's words give it (137 for 'Killed')


def first_failure(stderr: str) -> Failure | None:
    """Among srun's messages, the failure that caused the others: a crash (a task killed by SIGKILL, SIGSEGV,
    ...) if any, else the first task that failed; a lost node when no task says."""
    failures: list[Failure] = []
    for line in stderr.splitlines():
        found = _TASK_FAILED.match(line.strip())
        if found:
            node, tasks, cause = found.groups()
            exited = _EXITED.match(cause.strip())
            code = int(exited.group(1)) if exited else exits.of_signal_text(cause)
            failures.append(Failure(node, re.split(r"[,-]", tasks)[0], cause.strip(), code))
            continue
        lost = _NODE_FAILED.match(line.strip())
        if lost and not failures:
            failures.append(Failure(lost.group(1), None, "node failure", None))
    crashed = [f for f in failures if f.code is not None and exits.is_crash(f.code)]
    return crashed[0] if crashed else failures[0] if failures else None


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The job's nodes and what a step of the run needs from them."""

    job_id: str
    nodes: tuple[str, ...]  # every node of the allocation, in Slurm's order
    run_nodes: int  # how many a step uses (JOB_NODES)
    tasks_per_node: int
    restart_count: int  # SLURM_RESTART_COUNT: requeues so far

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Allocation:
        listed = env.get("SLURM_JOB_NODELIST", "")
        nodes = tuple(expand_nodelist(listed)) if listed else ()
        per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
        run_nodes = int(env.get(NODES_ENV) or len(nodes) or 1)
        counted = re.match(r"\d+", per_node)
        return cls(env.get("SLURM_JOB_ID", "0"), nodes, min(run_nodes, len(nodes)) if nodes else run_nodes,
                   int(counted.group()) if counted else 1,
                   int(env.get("SLURM_RESTART_COUNT") or 0))

    def usable(self, lost: set[str]) -> list[str]:
        return [n for n in self.nodes if n not in lost]

    def step_nodes(self, lost: set[str]) -> list[str]:
        return self.usable(lost)[:self.run_nodes]

    def spares_left(self, lost: set[str]) -> int:
        return len(self.usable(lost)) - self.run_nodes


def step_argv(srun: str, args: Sequence[str], alloc: Allocation, lost: set[str]) -> list[str]:
    """srun's command line for the next step: as given while the step takes the whole allocation; with spares,
    or once a node is lost, on the chosen nodes (the given placement options replaced)."""
    if len(alloc.nodes) <= alloc.run_nodes and not lost:
        return [srun, *args]
    nodes = alloc.step_nodes(lost)
    kept: list[str] = []
    skip = False
    for word in args:
        if skip:
            skip = False
            continue
        if word in _PLACEMENT:
            skip = True
            continue
        if word.startswith(tuple(f"{o}=" for o in _PLACEMENT if o.startswith("--"))):
            continue
        kept.append(word)
    return [srun, f"--nodes={len(nodes)}", f"--ntasks={len(nodes) * alloc.tasks_per_node}",
            f"--nodelist={','.join(nodes)}", *kept]


def _at_or_after(time: object, since: float) -> bool:
    """A record's "time" (seconds since the epoch, a number) is at or after `since`; missing or garbled: not."""
    return isinstance(time, (int, float)) and time >= since


class Supervisor:
    def __init__(self, args: Sequence[str], runner: Runner, env: Mapping[str, str] = os.environ) -> None:
        self.args = list(args)
        self.runner = runner
        self.env = env
        self.alloc = Allocation.from_env(env)
        retries = env.get(RETRIES_ENV, "")
        self.retries = int(retries) if retries.isdigit() else DEFAULT_RETRIES
        self.log_dir = log_dir = Path(env.get(LOG_DIR_ENV) or ".").absolute()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.records = JobLog(log_dir / f"{self.alloc.job_id}-attempts.jsonl")
        self.lost: set[str] = set()
        self.interrupted = False  # a SIGINT came (Ctrl-C, scancel --signal=INT): nothing restarts after this step
        self.terminated = False  # a SIGTERM came (scancel, the time limit, a preemption): the step ends too

    def _on_sigint(self, signum: int, frame: object) -> None:
        """Ctrl-C to the batch script (a terminal's, `scancel --signal=INT --full`): passed on to the step's tasks,
        which save and exit 130 (srun itself only prints their state on one SIGINT), while the supervisor waits
        for them instead of dying with the attempt unrecorded; nothing restarts or requeues after (a person
        asked to stop)."""
        if self.interrupted:
            return
        self.interrupted = True
        self.say(f"job {self.alloc.job_id}: SIGINT: passed on to the step's processes, which save and stop; nothing "
                 "is restarted or requeued after it", error=True)
        # the job's running steps, not the batch step this supervisor runs in, nor the job: a job's signal in an
        # array with elements still pending is refused for a while ('Job can not be altered now'), and scancel
        # sends it again every few seconds for 95 s, a second Ctrl-C that ends the tasks before their save
        steps = self.runner.run(["squeue", "--steps", "--jobs", self.alloc.job_id, "--noheader", "--format=%i"],
                                check=False, capture=True)
        running = [s for s in (steps.stdout or "").split() if s.rpartition(".")[2].isdigit()]
        self.runner.run(["scancel", "--signal=INT", *(running or [self.alloc.job_id])], check=False, capture=True)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        """SIGTERM to the batch script: Slurm sends it to every step of a job it cancels or stops (scancel, the
        time limit, a preemption), the tasks' included, which save and exit 75. The supervisor waits for them
        instead of dying with the attempt unrecorded, then asks Slurm whether the job was cancelled."""
        if not self.terminated:
            self.terminated = True
            self.say(f"job {self.alloc.job_id}: SIGTERM: waiting for the step's processes to save and end", error=True)

    def say(self, text: str, *, error: bool = False) -> None:
        print(text, file=sys.stderr if error else sys.stdout, flush=True)

    def run(self) -> int:
        srun = self.runner.which("srun") or "srun"
        step_env = {**self.env, ATTEMPTS_ENV: str(self.records.path)}
        signal.signal(signal.SIGINT, self._on_sigint)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        while True:
            nodes = self.alloc.step_nodes(self.lost) if self.alloc.nodes else []
            began = time.time()
            proc = self.runner.run_echoing_stderr(step_argv(srun, self.args, self.alloc, self.lost), env=step_env)
            code = proc.returncode
            failure = first_failure(proc.stderr or "") if code != 0 else None
            if failure is not None and failure.code is not None:
                code = failure.code  # srun's own status is the last task's (143 once it stopped the others)
            if code != 0:  # a hang the watchdog ended: the process its roll call named, not the first to exit
                failure = self.stuck(began, nodes) or failure
            decision = self.decide(code, failure)
            # numbered by the run dir's record (across job ids); without one, by the job's own, or by Slurm's count
            # of requeues where that knows more (job.runs.attempts.number)
            attempt = self.records.add(Ended(
                job=self.alloc.job_id, began=began, ended=time.time(), code=code, outcome=decision.outcome,
                action=decision.action, says=decision.describe(),
                node=failure.node if failure and failure.node else "-",
                process=failure.process if failure and failure.process else "-",
                cause=failure.cause if failure else "", nodes=",".join(nodes)),
                requeues=self.alloc.restart_count).attempt
            if decision.action is not Action.RESTART:
                return self.finish(code, attempt, decision, failure)
            self.say(f"job {self.alloc.job_id} attempt {attempt} {self.ended_words(code, decision, failure)}: "
                     f"{decision.describe()}")
            if decision.exclude:
                self.lost.add(decision.exclude)
            self.clear_half_written()

    def clear_half_written(self) -> None:
        """What the ended attempt's tasks left half-written as srun ended them, removed before the next attempt
        starts (nothing of this job runs between two attempts): submitit's result of a task ended while saving it,
        over which that task's next attempt refuses to start (a survivor of a peer's death ends at once, and srun
        ends it while it saves)."""
        for path in self.log_dir.glob(f"{self.alloc.job_id}_*{internals.SUBMITIT_HALF_WRITTEN}"):
            path.unlink(missing_ok=True)

    def stuck(self, since: float, nodes: list[str]) -> Failure | None:
        """The process the watchdog's roll call named in this attempt (process 0's `hang` record), if any."""
        hangs = [r for r in self.records.lines() if r.get("event") == "hang" and _at_or_after(r.get("time"), since)]
        if not hangs:
            return None
        hang = hangs[-1]
        process = str(hang.get("process", ""))
        node = str(hang.get("node") or "")
        if not node and process.isdigit() and nodes:  # it did not answer: its node from the step's block layout
            node = nodes[min(int(process) // self.alloc.tasks_per_node, len(nodes) - 1)]
        return Failure(node or None, process or None, f"stuck ({hang.get('where', 'the watchdog ended it')})", None)

    def decide(self, code: int, failure: Failure | None) -> Decision:
        """The policy's decision on the attempt that ended with `code`: a SIGINT (Ctrl-C) stops it whatever the
        code; after a SIGTERM, a job Slurm cancelled is never requeued (a requeue would undo the scancel)."""
        outcome = Outcome.of(code)
        cancelled = self.terminated and not self.interrupted and outcome is not Outcome.COMPLETED and self.cancelled()
        if outcome in (Outcome.COMPLETED, Outcome.CONFIGURATION_ERROR):
            return decide(Situation(code, 0, self.retries, interrupted=self.interrupted, cancelled=cancelled))
        node = failure.node if failure is not None else None
        ended = Situation(code, self.records.failures(), self.retries, spares_left=self.alloc.spares_left(self.lost),
                          can_requeue=self.can_requeue(), node=node, interrupted=self.interrupted, cancelled=cancelled)
        if (outcome is Outcome.FAILED and node and ended.spares_left <= 0 and not ended.can_requeue
                and ended.failures_before < ended.retries):
            ended = dataclasses.replace(ended, node_answers=self.answers(node))
        return decide(ended)

    def ended_words(self, code: int, decision: Decision, failure: Failure | None) -> str:
        where = f" (process {failure.process} on {failure.node}: {failure.cause})" if failure and failure.process \
            else f" (on {failure.node}: {failure.cause})" if failure and failure.node else ""
        return f"{decision.outcome.value} with exit code {code}{where}" if decision.outcome is Outcome.FAILED \
            else f"ended with exit code {code}{where}"

    def can_requeue(self) -> bool:
        """Slurm would requeue this job: its Requeue flag (JobRequeue=0 and --no-requeue leave it 0)."""
        return re.search(r"\bRequeue=1\b", self.shown()) is not None

    def cancelled(self) -> bool:
        """Slurm is ending this job because it was cancelled (scancel): its JobState is no longer RUNNING
        (COMPLETING while its processes end) for no reason of Slurm's own. Ended by the time limit
        (Reason=TimeLimit) or a preemption (Reason=Preempted), it is not: those are requeued as the policy says
        (`scontrol requeue` takes a completing job, so a cancelled one must not be handed to it)."""
        shown = self.shown()
        state, reason = (re.search(rf"\b{field}=(\w+)", shown) for field in ("JobState", "Reason"))
        if state is None or state.group(1) in ("RUNNING", "PENDING", "REQUEUED", "SUSPENDED"):
            return False
        return reason is None or not reason.group(1).startswith(("TimeLimit", "Preempt"))

    def shown(self) -> str:
        """`scontrol show job` of this job; '' where scontrol fails."""
        proc = self.runner.run(["scontrol", "show", "job", self.alloc.job_id], check=False, capture=True,
                               mutating=False)
        return (proc.stdout or "") if proc.returncode == 0 else ""

    def answers(self, node: str) -> bool:
        """A one-task probe step on `node` ends well within PROBE_TIMEOUT_S."""
        try:
            proc = self.runner.run(["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "true"], check=False,
                                   capture=True, timeout=PROBE_TIMEOUT_S, mutating=False)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return proc.returncode == 0

    def finish(self, code: int, attempt: int, decision: Decision, failure: Failure | None) -> int:
        job = self.alloc.job_id
        if decision.outcome is Outcome.PREEMPTED:
            self.say(f"job {job} saved its state after a preemption signal: requeueing (restart "
                     f"{self.alloc.restart_count + 1})")
            self.requeue(None)
        elif decision.outcome is Outcome.STOPPED:
            self.say(f"job {job} attempt {attempt} ended with exit code {code} after Ctrl-C: {decision.describe()}")
            return exits.STOPPED if code != 0 else code
        elif decision.outcome is Outcome.CANCELLED:
            self.say(f"job {job} attempt {attempt} ended with exit code {code}, the job cancelled: "
                     f"{decision.describe()}")
        elif decision.outcome is Outcome.CONFIGURATION_ERROR:
            self.say(f"job {job} attempt {attempt} ended with exit code {code} (a configuration error"
                     f"{f', process {failure.process} on {failure.node}' if failure and failure.process else ''}): "
                     f"{decision.describe()}", error=True)
        elif decision.outcome is Outcome.FAILED:
            self.say(f"job {job} attempt {attempt} {self.ended_words(code, decision, failure)}: {decision.describe()}")
            if decision.action is Action.REQUEUE:
                self.requeue(decision.exclude)
            else:
                self.say(f"job {job} ends with exit code {code}: {decision.describe()}. Fix: read the log above; "
                         "submit the same command again to resume from the newest checkpoint", error=True)
        return code

    def requeue(self, node: str | None) -> None:
        """`scontrol requeue` this job; with a node, keep it out of the next allocation once the job is pending
        again (the update is refused before). Requeueing signals the batch script: SIGTERM is held off."""
        job = self.alloc.job_id
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        proc = self.runner.run(["scontrol", "requeue", job], check=False, capture=True)
        if proc.returncode != 0:
            self.say(f"requeue: expected scontrol requeue {job} to requeue the job, found it refused "
                     f"({(proc.stderr or '').strip() or 'no message'}); its checkpoint is kept. Fix: submit the same "
                     "command again to resume from it (and ask for --requeue where JobRequeue=0)", error=True)
            return
        excluded = self.excluded_with(node) if node else None
        if excluded:
            update = self.runner.run(["scontrol", "update", f"JobId={job}", f"ExcNodeList={excluded}"], check=False,
                                     capture=True)
            if update.returncode != 0:
                self.say(f"requeue: expected to keep {excluded} out of the next attempt, found scontrol update "
                         f"refused ({(update.stderr or '').strip()}); it may run there again", error=True)

    def excluded_with(self, node: str) -> str | None:
        """The job's ExcNodeList with `node` added; None (and why) when too few nodes of its partition would be
        left for it: it would wait in the queue for ever."""
        now = re.search(r"ExcNodeList=(\S+)", self.shown())
        excluded = set(expand_nodelist(now.group(1))) if now and now.group(1) != "(null)" else set()
        excluded.add(node)
        partition = self.env.get("SLURM_JOB_PARTITION", "")
        listed = self.runner.run(["sinfo", "-h", "-p", partition, "-N", "-o", "%N"], check=False, capture=True,
                                 mutating=False).stdout or ""
        usable = {n.strip() for n in listed.splitlines() if n.strip()} - excluded
        needed = int(self.env.get("SLURM_JOB_NUM_NODES") or len(self.alloc.nodes) or 1)
        if len(usable) < needed:
            self.say(f"requeue: excluding {','.join(sorted(excluded))} would leave {len(usable)} node(s) of partition "
                     f"{partition or '?'} for {needed}: requeued without excluding {node}", error=True)
            return None
        return ",".join(sorted(excluded))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("python -m deploy.slurm.supervise: expected srun's arguments after --, found none. Fix: "
              "python -m deploy.slurm.supervise -- --kill-on-bad-exit=1 python -m job train", file=sys.stderr)
        return exits.BAD_INPUT
    return Supervisor(args, Runner()).run()


if __name__ == "__main__":
    sys.exit(main())
