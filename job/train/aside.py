"""Programs compiled on threads of their own while the loop's thread compiles the train step: XLA compiles them
at once (on a v5e VM, the GPT-2-small LM's init took 28 s to compile alone, and two such compiles 22.5 s together
against 55 s one after the other).

    init = init_aside(planned.init, expected)  # a fresh start's state init: InitAside, else InitCalled
    evals = eval_aside(task, evaluator, planned, policy)  # the eval step, under the policy auto compiles first
    ... the train step compiles (plan.compile_step, which calls eval_aside first) ...
    state = init()                             # waits for the init's compile, then creates the state
    evals.take(evaluator, state, remat)        # the eval step compiled aside, where it is the chosen policy's
    init.settle(); evals.settle()              # a run stopping early: no compile left running at its exit

Each program is traced and lowered on the loop's thread (tracing is not thread-safe: a model's code, the
rules' context); a thread only compiles it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from job.kernels.rematerialize import choosing
from job.train import state as state_plan
from job.train.evaluation import Evaluator
from job.train.steps import jit_eval_step
from job.train.task import Task


class Aside:
    """`lowered` compiled in order on a thread named `name`, started now."""

    def __init__(self, lowered: Sequence[jax.stages.Lowered], name: str) -> None:
        self._compiled: concurrent.futures.Future[list[jax.stages.Compiled]] = concurrent.futures.Future()

        def compile_all() -> None:
            try:
                self._compiled.set_result([each.compile() for each in lowered])
            except BaseException as exc:  # noqa: BLE001 - raised where the programs are asked for
                self._compiled.set_exception(exc)

        threading.Thread(target=compile_all, name=name, daemon=True).start()

    def compiled(self) -> list[jax.stages.Compiled]:
        """Wait for the compiles: the programs, or the first compile's error raised here."""
        return self._compiled.result()

    def settle(self) -> None:
        """Wait for the compiles, their outcome dropped: a run that stops before it uses them (an error, a step
        that does not fit) must not leave XLA compiling on a thread while the interpreter tears down."""
        concurrent.futures.wait([self._compiled])


class InitAside:
    """The state's init, compiled aside (`init_aside`). Calling it waits for that compile and creates the state."""

    def __init__(self, init: jax.stages.Wrapped) -> None:
        self._aside = Aside([init.lower()], "job-init-compile")

    def __call__(self) -> nnx.State:
        return self._aside.compiled()[0]()

    def settle(self) -> None:
        self._aside.settle()


class InitCalled:
    """The init as it is, compiled when it is called (a run dir holding a saved step: `init_aside`)."""

    def __init__(self, init: jax.stages.Wrapped) -> None:
        self._init = init

    def __call__(self) -> nnx.State:
        return self._init()

    def settle(self) -> None:
        """Nothing runs aside."""


def init_aside(init: jax.stages.Wrapped, expected: int) -> InitAside | InitCalled:
    """The state's `init` for the restore: compiled aside from now (`InitAside`) for a fresh start (`expected`, the
    step the restore is expected to start from, plan.expected_start, is 0), else left to be compiled if it is ever
    called (every saved step unreadable, say)."""
    return InitCalled(init) if expected else InitAside(init)


class EvalAside:
    """The eval step jitted afresh, lowered for the state's abstract shapes and each batch shape of the
    evaluator's plan under `policy` (the one remat auto tries first), and compiled aside (`eval_aside`)."""

    def __init__(self, step: jax.stages.Wrapped, policy: str, lowered: Sequence[jax.stages.Lowered]) -> None:
        self.step, self.policy, self._lowered = step, policy, list(lowered)
        self._aside = Aside(self._lowered, "job-eval-compile")

    def take(self, evaluator: Evaluator, state: Any, remat: str) -> bool:
        """Hand the step compiled aside to `evaluator` where it is the program the chosen policy `remat` gives:
        the same policy, or the same lowered program (a forward pass under any remat policy is one program;
        a model may still read the policy itself). True when handed; False: the evaluator's own step is left to
        compile under `remat`, once this compile has ended. A compile that failed raises here."""
        try:
            self._aside.compiled()  # the step's later calls find these programs
        except Exception:
            if remat == self.policy:
                raise
            return False  # compiled under another policy: the evaluator's own step compiles as the run chose
        if remat != self.policy:
            with choosing(remat):
                own = evaluator.lower(state)
            if [each.as_text() for each in own] != [each.as_text() for each in self._lowered]:
                return False
        evaluator.use(self.step)
        return True

    def settle(self) -> None:
        self._aside.settle()


class NoEvalAside:
    """No evaluation planned (no eval split, or --data.eval-batches 0): nothing to compile."""

    def take(self, evaluator: Evaluator, state: Any, remat: str) -> bool:
        return True

    def settle(self) -> None:
        """Nothing runs aside."""


def eval_aside(task: Task, evaluator: Evaluator, planned: state_plan.Plan, policy: str) -> EvalAside | NoEvalAside:
    """`evaluator`'s eval step compiled aside from now, jitted afresh for the `planned` state's abstract shapes
    under `policy`, the one remat auto compiles first (plan.RematAsk.first). Called inside the run's mesh
    context, as the loop traces its steps (plan.compile_step). Reads the rows of one eval batch per shape and
    split, as `Evaluator.compile` does."""
    if not evaluator.plan:
        return NoEvalAside()
    step = jit_eval_step(task.loss, planned.eval_graphdef, task.weight)
    with choosing(policy):
        lowered = evaluator.lower(planned.abstract, step)
    return EvalAside(step, policy, lowered)


__all__ = ["Aside", "EvalAside", "InitAside", "InitCalled", "NoEvalAside", "eval_aside", "init_aside"]
