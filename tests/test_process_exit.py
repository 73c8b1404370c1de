"""A process that ran collectives ends without finalizing (NOTE [ A collective's worker outlives the interpreter ])."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from multirank import scaled


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=scaled(120))


def test_the_exit_flushes_what_was_written_and_skips_finalization():
    done = _python(
        """
        import atexit, sys
        from batchfit.parallel.process_exit import exit_after_collectives
        atexit.register(lambda: print("atexit ran"))
        print("out", end="")
        sys.stderr.write("err")
        exit_after_collectives(3)
        print("after")
        """
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "out", "err")


def test_the_cli_ends_there_only_when_it_joined_ranks():
    code = """
        import atexit
        from batchfit.parallel import process_exit
        {join}
        atexit.register(lambda: print("finalized"))
        from batchfit.cli import main
        print("returned", main([]))
        """
    joined = _python(code.format(join="process_exit.note_joined()"))
    assert joined.returncode == 2 and "returned" not in joined.stdout and "finalized" not in joined.stdout
    assert "name a command" in joined.stderr  # the command's own error line was flushed
    alone = _python(code.format(join=""))
    assert alone.returncode == 0 and "returned 2" in alone.stdout and "finalized" in alone.stdout


def test_a_quick_exit_runs_the_atexit_handlers_flushes_and_keeps_the_code(tmp_path):
    # NOTE [ A command ends without tearing torch down ]
    marker = tmp_path / "handler-ran"
    done = _python(
        f"""
        import atexit, sys, weakref
        from batchfit.parallel.process_exit import quick_exit
        atexit.register(lambda: open({str(marker)!r}, "w").close())
        class Held: pass
        held = Held()
        weakref.finalize(held, print, "finalizer ran")
        print("out", end="")
        sys.stderr.write("err")
        quick_exit(3)
        print("after")
        """
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "outfinalizer ran\n", "err")
    assert marker.exists()


def test_the_console_script_ends_quickly_with_the_commands_code_and_output():
    ok = subprocess.run(
        [sys.executable, "-m", "batchfit", "plan", "--json", "--policy-mini-batch-size", "4", "--train-batch-size", "8"],
        capture_output=True, text=True, timeout=scaled(120),
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.rstrip().endswith("}")  # the whole JSON was flushed
    bad = subprocess.run([sys.executable, "-m", "batchfit", "profile", "--jobs", "0"], capture_output=True, text=True, timeout=scaled(120))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
