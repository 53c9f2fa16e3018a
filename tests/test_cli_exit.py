"""The ``porting`` console script ends the process once Python's exit has waited for the
command's threads and run its exit handlers, skipping only the interpreter's teardown of the
libraries (2-3 s on the CI machine after a verify): the exit code, the output, every handler and
every non-daemon thread are as a normal exit leaves them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

PORTING = str(Path(sys.executable).with_name("porting"))


def test_the_console_script_is_run():
    text = Path(PORTING).read_text()
    assert "from porting.cli import run" in text, text


def test_exit_code_output_handlers_and_threads_are_kept(tmp_path):
    code = textwrap.dedent(
        f"""
        import atexit, pathlib, sys, threading, time
        from porting import cli

        out = pathlib.Path({str(tmp_path)!r})

        def command(argv=None):
            atexit.register(lambda: (out / "handler").write_text("ran"))
            def late():
                time.sleep(0.5)
                (out / "thread").write_text("done")
            threading.Thread(target=late).start()
            sys.stdout.write("x" * 100000)  # buffered: flushed before the process ends
            return 3

        cli.main = command
        cli.run()
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 3, result.stderr
    assert result.stdout == "x" * 100000
    assert (tmp_path / "handler").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "done"


def test_a_crash_keeps_pythons_own_report_and_status():
    code = "from porting import cli\ndef boom(argv=None):\n    raise RuntimeError('boom')\n"
    code += "cli.main = boom\ncli.run()\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1
    assert "RuntimeError: boom" in result.stderr


def test_a_refusal_through_the_console_script(tmp_path):
    result = subprocess.run(
        [PORTING, "import", str(tmp_path / "missing"), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("porting import: error: ") and "missing" in result.stderr


def test_only_the_console_scripts_own_process_freezes_its_loaded_objects():
    """guard.keep_loaded_out_of_collections freezes the heap (gc.freeze) in a process that
    cli.run started, where every object lives until the command exits; in a process that calls
    porting.cli.main or the API itself, its objects stay collectable."""
    import gc

    from porting import guard

    before = gc.get_freeze_count()
    guard.keep_loaded_out_of_collections()  # this process embeds us
    assert gc.get_freeze_count() == before
    code = textwrap.dedent(
        """
        import gc, sys
        from porting import cli, guard

        def command(argv=None):
            guard.keep_loaded_out_of_collections()
            print(gc.get_freeze_count() > 0, flush=True)
            return 0

        cli.main = command
        cli.run()
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr
