"""batchfit.budget.side_by_side: the deeper shallow copy measured in a forked worker gives the same measurements."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest

from batchfit import InvalidArgument
from batchfit.budget import side_by_side as sbs
from batchfit.budget.causal_lm_probe import causal_lm_step
from batchfit.budget.depth import DEFAULT_DEPTHS, DepthExtrapolatedStep, build_depth_steps
from batchfit.budget.side_by_side import Beside, Deferred, WorkerLost, call_method, side_by_side
from batchfit.memory import get_backend
from batchfit.models import build_causal_lm
from batchfit.parallel.distributed import simulated_world
from batchfit.parallel.sharding import Sharding
from multirank import scaled

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="side by side needs a POSIX fork")


def _depth_step(memory_limit: int | None = None, built_beside: bool = False, **step_opts) -> DepthExtrapolatedStep:
    be = get_backend("estimate", memory_limit=memory_limit, reserve_bytes=0)
    sharding = Sharding("fsdp2", world_size=4)

    def make(n_layers: int):
        model = build_causal_lm("tiny", backend=be, sharding=sharding, num_hidden_layers=n_layers, gradient_checkpointing=True)
        return causal_lm_step(model, backend=be, **step_opts)

    if built_beside:
        return build_depth_steps(make, 9, backend=be)
    return DepthExtrapolatedStep({k: make(k) for k in DEFAULT_DEPTHS}, 9)


def _fields(m):
    return {k: v for k, v in dataclasses.asdict(m).items() if k != "seconds"}


def _gone(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


# lengths in the order a search probes them, one over the limit among them, and how the search
# has the backend measure each: as it is, stopped at a lower limit, or run to the end
PROBES = ([40] * 2, [64] * 3, [17, 40], [512] * 64, [512] * 64, [40] * 2, [8])
CONTEXTS = ("plain", "stop", "plain", "plain", "to_the_end", "stop", "plain")


def _measured(step: DepthExtrapolatedStep) -> list[dict]:
    out, be = [], step.backend
    for lengths, how in zip(PROBES, CONTEXTS):
        context = {"plain": contextlib.nullcontext, "stop": lambda: be.stopping_above(3_000_000),
                   "to_the_end": be.running_to_the_end}[how]()  # fmt: skip
        with context:
            out.append(_fields(step.measure(lengths)))
    return out


@pytest.mark.parametrize(
    ("step_opts", "built_beside"),
    [
        pytest.param({}, True, id="update-built-beside"),
        # the first tier's time: one case there, the others in the second
        pytest.param({}, False, id="update", marks=pytest.mark.slow),
        pytest.param({"forward_only": True}, False, id="forward-only", marks=pytest.mark.slow),
    ],
)
def test_the_deeper_copy_measured_beside_gives_every_field_as_in_process(step_opts, built_beside):
    limit = 64 * 2**20
    with simulated_world(4):
        here = _depth_step(limit, **step_opts)
        expected = _measured(here)
        expected_state = _fields(here.measure_state())
        with side_by_side(2) as used:
            assert used == 2
            beside = _depth_step(limit, built_beside, **step_opts)
            assert isinstance(beside.steps[6], Deferred) == built_beside  # built in the worker only
            got = _measured(beside)
            got_state = _fields(beside.measure_state())
            worker = beside._deeper._worker
            assert worker is not None and worker.pid != os.getpid()  # measured in another process
        assert _gone(worker.pid)  # the block reaped it
    # stopped at the device's limit, then run to the end past it; (update) stopped at the search's limit
    exceeded = [m["exceeded"] for m in expected]
    assert exceeded[3:5] == [True, False] and exceeded[1] == (not step_opts)
    assert got == expected
    assert got_state == expected_state


@pytest.mark.parametrize("built_beside", [pytest.param(False, marks=pytest.mark.slow), True], ids=["built-here", "built-beside"])
def test_after_its_block_the_copy_is_measured_here_again(built_beside):
    with simulated_world(4):
        with side_by_side(2):
            step = _depth_step(built_beside=built_beside)
            first = _fields(step.measure([40] * 2))
        assert step._deeper._current() is None  # no block: no worker
        assert _fields(step.measure([40] * 2)) == first
        assert step._deeper._step is not None  # built here now, if it was built beside before


def test_a_build_error_in_the_worker_is_raised_here():
    def make(n_layers: int):
        if n_layers == 6:
            raise InvalidArgument("num_hidden_layers=6 is refused here")
        return _Toy()

    with side_by_side(2), pytest.raises(InvalidArgument, match="num_hidden_layers=6"):
        build_depth_steps(make, 9, backend=_Toy())


class _Toy:
    """A stand-in step: what its calls do in whichever process they run."""

    simulated = True

    def measure(self, lengths):
        if lengths == [0]:
            raise InvalidArgument("lengths must be positive, but got lengths=[0]")
        if lengths == [13]:
            warnings.warn("thirteen tokens", UserWarning, stacklevel=1)
        return (os.getpid(), sum(lengths))


def test_an_error_a_warning_and_a_lost_worker_reach_the_caller():
    beside = Beside(_Toy(), _Toy())
    with side_by_side(2):
        pid, total = beside.call(call_method, "measure", [3, 4])
        assert (total, pid != os.getpid()) == (7, True)
        with pytest.raises(InvalidArgument, match=r"lengths=\[0\]"):
            beside.call(call_method, "measure", [0])
        with pytest.warns(UserWarning, match="thirteen tokens"):
            assert beside.call(call_method, "measure", [13])[1] == 13
        os.kill(beside._worker.pid, signal.SIGKILL)
        with pytest.raises(WorkerLost, match=r"killed by signal 9.*--jobs 1"):
            beside.call(call_method, "measure", [1])


def test_nothing_is_forked_outside_a_block_or_with_one_job():
    beside = Beside(_Toy(), _Toy())
    assert beside.call(call_method, "measure", [2])[0] == os.getpid()
    with side_by_side(1):
        assert beside.call(call_method, "measure", [2])[0] == os.getpid()
    not_simulated = Beside(_Toy(), object())
    with side_by_side(2):
        assert not_simulated.call(call_method, "measure", [2])[0] == os.getpid()


def test_blocks_nest_and_jobs_are_checked(monkeypatch):
    with side_by_side(2):
        with side_by_side(1):
            assert sbs.jobs() == 1
        assert sbs.jobs() == 2
    assert sbs.jobs() == 1
    with side_by_side(5) as used:
        assert used == sbs.MAX_JOBS
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(InvalidArgument, match="jobs must be a positive integer"), side_by_side(bad):
            pass
    monkeypatch.setenv(sbs.JOBS_ENV, "two")
    with pytest.raises(InvalidArgument, match=r"BATCHFIT_JOBS='two'"), side_by_side():
        pass
    monkeypatch.setenv(sbs.JOBS_ENV, "2")
    with side_by_side() as used:
        assert used == 2
    monkeypatch.delenv(sbs.JOBS_ENV)
    with side_by_side() as used:
        assert used == (2 if sbs.available_cpus() >= 2 else 1)


@pytest.mark.slow
def test_the_cli_answers_the_same_with_one_and_two_jobs(capsys):
    from batchfit.cli import main

    outputs = []
    for jobs in ("1", "2"):
        argv = ["profile", "--model", "qwen2.5-0.5b", "--max-seq-len", "512", "--json", "--no-progress", "--no-cache"]
        assert main([*argv, "--jobs", jobs]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1]
    assert outputs[0]["combined"]["tokens"] > 0


def test_a_bad_jobs_flag_is_one_line(capsys):
    from batchfit.cli import main

    assert main(["profile", "--jobs", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "jobs must be a positive integer" in err[0]


def test_a_worker_of_a_parent_that_ran_openmp_threads_does_not_hang():
    # GNU libgomp's threads are not in a forked child: a parallel region there waited on them forever
    code = textwrap.dedent(
        """
        import torch
        from batchfit.budget.side_by_side import Beside, side_by_side
        torch.set_num_threads(2)
        (torch.ones(4_000_000) * 2).sum()  # the parent's OpenMP team, started
        class Toy:
            simulated = True
        def work(step):
            return float((torch.ones(4_000_000) * 3).sum())
        with side_by_side(2):
            print(Beside(Toy(), Toy()).call(work))
        """
    )
    env = dict(os.environ, OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120), env=env)
    assert (done.returncode, done.stdout.strip()) == (0, "12000000.0"), done.stderr
