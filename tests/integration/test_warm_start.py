"""Ranks forked from a warm interpreter behave like ranks started cold, one interpreter each.

The spawner forks a Python program's ranks from one process that has imported torch. The
first tests run the same program both ways (``VPIPE_COLD_START=1`` is the cold way) and compare
what the ranks saw and how the run ended; the last ones hold how one starter serves several
runs and launchers, and ends their ranks when they go.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from support.processes import child_env
from vpipe_lab.runtime.launch import spawn
from vpipe_lab.runtime.warm_start import COLD_START_ENV, SHARED_STARTER_ENV, WarmStarter, warm_start_possible

# A rank reports what a program sees of its start; ``warm`` says
# whether torch was there before it imported it.
REPORT = """
import json, os, random, sys
warm = "torch.distributed.pipelining" in sys.modules
import numpy
rank = int(os.environ["RANK"])
record = {"rank": rank, "warm": warm, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
          "name": __name__, "random": random.random(), "numpy": float(numpy.random.rand()),
          "world": os.environ["WORLD_SIZE"], "store": os.environ["MASTER_PORT"]}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
code = int(sys.argv[2 + rank]) if len(sys.argv) > 2 + rank else 0
if code == -9:
    os.kill(os.getpid(), 9)
if code == 99:
    raise RuntimeError("rank raised on purpose")
sys.exit(code)
"""


def _run(tmp_path: Path, cold: bool, *codes: int) -> tuple[int, list[dict], str]:
    program = tmp_path / "program" / "report.py"
    program.parent.mkdir(exist_ok=True)
    program.write_text(REPORT)
    out = tmp_path / ("cold" if cold else "warm")
    out.mkdir()
    with open(out / "stderr.txt", "w+") as stderr:
        code = spawn([sys.executable, str(program), str(out), *map(str, codes)], 2, grace_s=5,
                     extra_env={COLD_START_ENV: "1" if cold else "0"}, stderr=stderr, timeout_s=120)
        stderr.seek(0)
        printed = stderr.read()
    return code, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], printed


def test_a_forked_rank_sees_its_program_as_a_cold_one_does(tmp_path):
    warm_code, warm, _ = _run(tmp_path, False)
    cold_code, cold, _ = _run(tmp_path, True)
    assert warm_code == cold_code == 0
    assert [r["warm"] for r in warm] == [True, True] and [r["warm"] for r in cold] == [False, False]
    for w, c in zip(warm, cold):
        # the same program, its own out dir
        assert w["argv"][0] == c["argv"][0] and w["argv"][1:] != c["argv"][1:]
        assert (w["rank"], w["cwd"], w["path0"], w["name"], w["world"]) == (c["rank"], c["cwd"], c["path0"],
                                                                            c["name"], c["world"])
    assert warm[0]["store"] == warm[1]["store"]
    # a cold interpreter seeds random and numpy from the OS: forked
    # ranks must not share their parent's sequence
    assert warm[0]["random"] != warm[1]["random"] and warm[0]["numpy"] != warm[1]["numpy"]


@pytest.mark.parametrize("codes, exit_code, said", [
    ((0, 3), 3, "rank 1 exited first with code 3"),
    ((0, -9), 1, "rank 1 exited first with code -9"),  # killed by a signal
    ((99, 0), 1, "rank 0 exited first with code 1"),  # an uncaught exception, its traceback printed
])
def test_a_forked_rank_ends_the_run_with_the_code_a_cold_one_would(tmp_path, capfd, codes, exit_code, said):
    for cold in (False, True):
        code, _, printed = _run(tmp_path, cold, *codes)
        assert code == exit_code, printed
        assert said in capfd.readouterr().err  # the launcher's summary
        if 99 in codes:
            assert "RuntimeError: rank raised on purpose" in printed and "Traceback" in printed


def test_modules_and_code_strings_start_warm_too(tmp_path):
    (tmp_path / "wsmod.py").write_text("import os, sys\nopen(sys.argv[1] + os.environ['RANK'], 'w').write("
                                       "repr((__name__, sys.argv[2:], 'torch' in sys.modules)))\n")
    code = spawn([sys.executable, "-m", "wsmod", str(tmp_path / "m"), "a", "b"], 2,
                 extra_env={"PYTHONPATH": str(
        tmp_path)})
    assert code == 0
    assert [(tmp_path / f"m{r}").read_text() for r in range(2)] == ["('__main__', ['a', 'b'], True)"] * 2
    # rank 0 fails at once; rank 1 waits to be ended, so which rank failed first is never a race
    code = spawn([sys.executable, "-c",
                  "import os, sys, time; rank = int(os.environ['RANK']); time.sleep(600 * rank); "
                  "sys.exit(5 + rank)"], 2, grace_s=1)
    assert code == 5


def test_only_python_programs_without_a_gpu_or_the_opt_out_start_warm():
    python = [sys.executable, "train.py"]
    assert warm_start_possible(python, {}) is not Path("/dev/nvidiactl").exists()
    assert not warm_start_possible(python, {COLD_START_ENV: "1"})
    assert not warm_start_possible(["/bin/sh", "-c", "true"], {})


def test_the_starter_ends_its_ranks_when_the_launcher_goes(tmp_path):
    """A launcher killed outright leaves no rank behind: its starter sees the pipe close and kills them."""
    program = ("import sys, time\nfrom vpipe_lab.runtime.launch import spawn\n"
               "spawn([sys.executable, '-c', 'import time; time.sleep(600)'], 2)\n")
    launcher = subprocess.Popen([sys.executable, "-c", program], env=child_env(**{COLD_START_ENV: "0",
                                                                                   SHARED_STARTER_ENV: ""}))
    try:
        descendants: list = []
        for _ in range(600):
            descendants = psutil.Process(launcher.pid).children(recursive=True)
            if len(descendants) >= 3:  # the starter and its two ranks
                break
            time.sleep(0.1)
        assert len(descendants) >= 3
    finally:
        launcher.kill()
        launcher.wait()
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert not alive, f"left running after the launcher died: {alive}"


def test_one_starter_serves_runs_one_after_another_each_with_its_own_output_and_path(tmp_path):
    (tmp_path / "only_here.py").write_text("WHERE = 'tmp'\n")
    program = ("import os, sys\nimport only_here\nprint(f\"rank {os.environ['RANK']} of run {sys.argv[1]} "
               "found {only_here.WHERE}\", file=sys.stderr)\n")
    starter = WarmStarter(child_env())
    try:
        for run in ("a", "b"):
            with open(tmp_path / f"{run}.txt", "w+") as stderr:
                code = spawn([sys.executable, "-c", program, run], 2, stderr=stderr, starter=starter,
                             extra_env={"PYTHONPATH": str(tmp_path)})
                stderr.seek(0)
                lines = sorted(stderr.read().splitlines())
            assert code == 0
            assert lines == [f"rank {r} of run {run} found tmp" for r in range(2)]
    finally:
        starter.close()


def test_launchers_share_a_listening_starter_and_one_that_goes_takes_only_its_own_ranks(tmp_path):
    """``VPIPE_WARM_STARTER`` sends a launcher's ranks to a starter that serves several launchers at once."""
    starter = WarmStarter(child_env(), listen=True)
    env = child_env(**{COLD_START_ENV: "0", SHARED_STARTER_ENV: str(starter.address)})
    spawn_ = "import sys\nfrom vpipe_lab.runtime.launch import spawn\n"
    sleeper = subprocess.Popen([sys.executable, "-c", spawn_ + "spawn([sys.executable, '-c', 'import time; "
                                "time.sleep(600)'], 2)\n"], env=env)
    try:
        sleeping: list = []
        for _ in range(600):
            sleeping = psutil.Process(starter.pid).children()
            if len(sleeping) == 2:
                break
            time.sleep(0.1)
        assert len(sleeping) == 2 and not psutil.Process(sleeper.pid).children()  # the starter's, not its own
        report = ("import os, sys; print(os.environ['RANK'], os.getppid(), 'torch' in "
                  "sys.modules, flush=True); "
                  "sys.exit(5 * int(os.environ['RANK']))")  # rank 1 fails, rank 0 ends well
        quick = subprocess.run([sys.executable, "-c",
                                spawn_ + f"sys.exit(spawn([sys.executable, '-c', {report!r}], "
                                "2, grace_s=5))\n"], env=env, capture_output=True, text=True, timeout=120)
        assert quick.returncode == 5 and "rank 1 exited first with code 5" in quick.stderr, quick.stderr
        assert sorted(quick.stdout.split("\n")[:2]) == [f"{r} {starter.pid} True" for r in range(2)]
        sleeper.kill()
        sleeper.wait()
        _, alive = psutil.wait_procs(sleeping, timeout=30)
        assert not alive, f"left running after their launcher died: {alive}"
        assert psutil.Process(starter.pid).status() != psutil.STATUS_ZOMBIE  # still serving the others
    finally:
        sleeper.kill()
        starter.close()


def test_a_shared_starter_that_is_not_there_is_said_and_the_run_starts_its_own(tmp_path, caplog):
    missing = tmp_path / "no-starter"
    code = spawn([sys.executable, "-c", "import sys; sys.exit('torch' not in sys.modules)"], 1,
                 extra_env={SHARED_STARTER_ENV: str(missing), COLD_START_ENV: "0"})
    assert code == 0  # forked warm all the same, by a starter of its own
    assert f"VPIPE_WARM_STARTER={missing}: no warm starter answers there" in caplog.text


def _launcher_with_sleeping_ranks() -> tuple[subprocess.Popen, psutil.Process, list[psutil.Process]]:
    """A launcher in a process group of its own (as a shell's job is) whose own starter forks two sleeping
    ranks; returns it, its starter and every process under it."""
    program = ("import sys\nfrom vpipe_lab.runtime.launch import spawn\n"
               "sys.exit(spawn([sys.executable, '-c', 'import time; time.sleep(600)'], 2))\n")
    launcher = subprocess.Popen([sys.executable, "-c", program], start_new_session=True,
                                stderr=subprocess.PIPE,
                                text=True, env=child_env(**{COLD_START_ENV: "0", SHARED_STARTER_ENV: ""}))
    descendants: list = []
    for _ in range(600):
        descendants = psutil.Process(launcher.pid).children(recursive=True)
        if len(descendants) >= 3:  # the starter and its two ranks
            break
        time.sleep(0.1)
    assert len(descendants) >= 3
    starter = next(p for p in psutil.Process(launcher.pid).children() if p.children())
    return launcher, starter, descendants


def test_sigterm_to_the_launchers_group_ends_it_and_every_rank_within_seconds():
    """`timeout 20 vpipe train ...` signals the whole group: the ranks and the starter die at once, and the
    launcher, which used to wait for exit codes nobody would report, ends with one line."""
    import os
    import signal

    launcher, _, descendants = _launcher_with_sleeping_ranks()
    started = time.monotonic()
    os.killpg(launcher.pid, signal.SIGTERM)
    try:
        code = launcher.wait(timeout=10)
    finally:
        launcher.kill()
    assert time.monotonic() - started < 10
    assert code == 128 + signal.SIGTERM
    lines = launcher.stderr.read().strip().splitlines()
    assert lines[-1].startswith("vpipe: interrupted (SIGTERM); every rank stopped")
    _, alive = psutil.wait_procs(descendants, timeout=10)
    assert not alive, f"left running: {alive}"


def test_a_starter_killed_outright_takes_its_ranks_and_ends_the_launcher_saying_so():
    launcher, starter, descendants = _launcher_with_sleeping_ranks()
    starter.kill()
    try:
        code = launcher.wait(timeout=10)
    finally:
        launcher.kill()
    assert code == 1
    assert "the warm starter that forked the ranks ended, so every rank was stopped" in launcher.stderr.read()
    _, alive = psutil.wait_procs(descendants, timeout=10)
    assert not alive, f"ranks left training on as orphans: {alive}"
