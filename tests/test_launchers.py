"""One torch script under torchrun, mpiexec and srun: hoccl.torch's rendezvous variables
from the launcher's (plan_rendezvous, fill_rendezvous_env, Slurm's host lists), the
backend registered at ``import torch`` through the "torch.backends" entry point, and
examples/train_ddp.py on "hoccl" under each launcher, matching gloo's losses bit for
bit.  Skipped when torch is not installed."""

import os
import random
import re
import shlex
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hoccl.torch._launchers import (SLURM_PORTS, expand_nodelist, fill_rendezvous_env,  # noqa: E402
                                    plan_rendezvous, slurm_port, tasks_per_node)
from test_mpi import MPI_ENV, _mpiexec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_ddp.py"
_LAUNCHER_PREFIXES = ("OMPI_COMM_WORLD_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL")
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT")

OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}
SRUN = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "6", "SLURM_NTASKS": "12",
        "SLURM_LOCALID": "2", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "3(x2)",
        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1"}


# -- the plan -------------------------------------------------------------------------------
def test_nothing_is_filled_under_torchrun_or_where_rank_is_set():
    environ = {**OPEN_MPI, **SRUN, "RANK": "0"}
    plan = plan_rendezvous(environ, mpi4py=True)
    assert (plan.launcher, dict(plan.values), plan.through_mpi) == (None, {}, ())
    assert plan_rendezvous({}, mpi4py=True).values == {}


@pytest.mark.parametrize("launcher, environ, want", [
    ("Open MPI", OPEN_MPI, {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                            "LOCAL_WORLD_SIZE": "2"}),
    ("MPICH", MPICH, {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                      "LOCAL_WORLD_SIZE": "1"}),
    ("PMIx", {"PMIX_RANK": "1"}, {"RANK": "1"})])
def test_mpi_launchers_give_the_ranks_and_mpi_agrees_on_the_address(launcher, environ, want):
    plan = plan_rendezvous(environ, mpi4py=True)
    assert plan.launcher == launcher and dict(plan.values) == want
    through = ("MASTER_ADDR", "MASTER_PORT") if "WORLD_SIZE" in want else \
        ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    assert set(plan.through_mpi) == set(through)


def test_variables_already_set_win_and_a_set_address_needs_no_mpi():
    environ = {**OPEN_MPI, "WORLD_SIZE": "8", "LOCAL_RANK": "7", "MASTER_ADDR": "head",
               "MASTER_PORT": "29500"}
    plan = plan_rendezvous(environ, mpi4py=True)
    assert dict(plan.values) == {"RANK": "3", "LOCAL_WORLD_SIZE": "2"}
    assert plan.through_mpi == ()


def test_srun_gives_ranks_the_first_host_and_a_port_from_the_job():
    plan = plan_rendezvous(SRUN, mpi4py=True)
    assert plan.launcher == "srun" and plan.through_mpi == ()
    assert dict(plan.values) == {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "2",
                                 "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "gpu07",
                                 "MASTER_PORT": str(slurm_port(4242, 1))}


def test_a_batch_scripts_own_process_is_not_an_srun_task():
    """sbatch sets SLURM_PROCID=0 and SLURM_NTASKS for the script itself: a plain
    ``python train.py`` in it must not wait for the job's other tasks."""
    batch = {name: value for name, value in SRUN.items() if not name.startswith("SLURM_STEP")}
    assert plan_rendezvous(batch, mpi4py=True).values == {}


def test_mpirun_inside_a_batch_script_takes_mpis_ranks_not_the_batch_steps():
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "9",
             "SLURM_NODELIST": "n[1-2]"}
    plan = plan_rendezvous({**batch, **OPEN_MPI}, mpi4py=True)
    assert plan.launcher == "Open MPI" and plan.values["RANK"] == "3"
    assert set(plan.through_mpi) == {"MASTER_ADDR", "MASTER_PORT"}


def test_an_mpi_job_under_srun_without_mpi4py_takes_slurms_address():
    plan = plan_rendezvous({**SRUN, **MPICH}, mpi4py=False)
    assert plan.launcher == "MPICH" and plan.through_mpi == ()
    assert plan.values["RANK"] == "2"
    assert (plan.values["MASTER_ADDR"], plan.values["MASTER_PORT"]) == \
        ("gpu07", str(slurm_port(4242, 1)))
    # without srun either, nothing names an address: torch's own error says what is missing
    assert "MASTER_ADDR" not in plan_rendezvous(MPICH, mpi4py=False).values


def test_fill_sets_what_the_plan_says_and_only_that():
    environ = {**SRUN, "PATH": "/bin", "LOCAL_RANK": "0"}
    before = dict(environ)
    filled = fill_rendezvous_env(environ)
    assert filled == {name: value for name, value in plan_rendezvous(before).values.items()}
    assert environ == {**before, **filled} and environ["LOCAL_RANK"] == "0"
    assert fill_rendezvous_env(environ) == {}  # RANK is set now


# -- Slurm's formats ------------------------------------------------------------------------
@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("login5", ["login5"]),
    ("a[8-10],b,c[1]", ["a8", "a9", "a10", "b", "c1"]),
    ("gpu-[099-101]", ["gpu-099", "gpu-100", "gpu-101"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"])])
def test_compressed_host_lists_expand_in_order(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[a-b]", "", "node[1-x]"])
def test_a_host_list_that_is_not_slurms_form_is_refused(nodelist):
    with pytest.raises(ValueError, match="expand_nodelist"):
        expand_nodelist(nodelist)


def test_tasks_per_node_expand_their_repeats():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="tasks_per_node"):
        tasks_per_node("2(3)")


def test_slurm_ports_are_the_same_for_a_step_and_differ_between_steps_and_close_jobs():
    ports = {slurm_port(job, step) for job in range(1000, 1100) for step in range(3)}
    assert len(ports) == 300 and all(port in SLURM_PORTS for port in ports)
    assert slurm_port(77, 2) == slurm_port(77, 2)


# -- the entry point -------------------------------------------------------------------------
_WITHOUT_THE_IMPORT = """
import sys
import torch, torch.distributed as dist
assert "hoccl" not in sys.modules, "import torch imported hoccl"
dist.init_process_group("hoccl", store=dist.HashStore(), rank=0, world_size=1)
tensor = torch.arange(4.0)
dist.all_reduce(tensor)
assert dist.get_backend() == "hoccl" and "hoccl.torch" in sys.modules
print("all_reduce on hoccl without the import:", tensor.tolist())
dist.destroy_process_group()
"""


def _clean_env(**extra):
    """This process's environment without any launcher's or torch's rendezvous variables
    (the tests may themselves run under mpirun or srun)."""
    env = {name: value for name, value in os.environ.items()
           if name not in _RENDEZVOUS and not name.startswith(_LAUNCHER_PREFIXES)}
    return {**env, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
            "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), **extra}


def _distribution_with_the_entry_point(directory):
    """A distribution on ``directory`` declaring pyproject's entry point (what
    ``pip install`` writes), so the test needs no install of its own."""
    info = directory / "hoccl_entry_point_test-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hoccl-entry-point-test\n"
                                   "Version: 0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\nhoccl = hoccl_autoload:register\n")


def test_init_process_group_finds_hoccl_without_the_import(tmp_path):
    _distribution_with_the_entry_point(tmp_path)
    env = _clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    code, output = _run([sys.executable, "-c", _WITHOUT_THE_IMPORT], env)
    assert code == 0, output[-3000:]
    assert "without the import: [0.0, 1.0, 2.0, 3.0]" in output
    # the same program with torch's autoloading off: torch's own error, as before
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    code, output = _run([sys.executable, "-c", _WITHOUT_THE_IMPORT], env)
    assert code != 0 and "Unknown backend type hoccl" in output, output[-3000:]


def test_pyproject_declares_the_entry_point():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["torch.backends"] == {"hoccl": "hoccl_autoload:register"}


def test_the_installed_distribution_has_the_entry_point():
    from importlib import metadata
    try:
        distribution = metadata.distribution("hoccl")
    except metadata.PackageNotFoundError:
        pytest.skip("hoccl is not installed (pip install -e .)")
    if distribution.read_text("entry_points.txt") is None:
        pytest.skip("hoccl was installed before it had entry points: pip install -e . again")
    points = [point for point in distribution.entry_points if point.group == "torch.backends"]
    assert [(point.name, point.value) for point in points] == [("hoccl", "hoccl_autoload:register")]


# -- one DDP script, three launchers ---------------------------------------------------------
def _losses(output):
    losses = re.findall(r"^step (\d+) loss \S+ (\S+)$", output, re.M)
    assert len(losses) == 5, output[-4000:]
    return losses


def _run(command, env, timeout=240, reference=False):
    """``command``'s exit status and output; on a timeout its whole session is killed (a
    launcher's children with it) and the test fails with what they printed.

    ``reference``: the gloo run the others are compared with.  Its processes have been
    seen, rarely, to stay in torch's teardown after the last step (gloo's; no hoccl
    call is made in that run): a reference that printed every step before it stopped
    is still the reference, and only its teardown is cut short."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, start_new_session=True)
    try:
        output = process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output = process.communicate()[0]
        steps = re.findall(r"^step (\d+) loss ", output, re.M)
        if reference and len(steps) == 5:
            warnings.warn(f"the gloo reference printed its 5 steps but did not exit within "
                          f"{timeout} s (torch's teardown): its losses are used")
            return 0, output
        pytest.fail(f"{command} ran past {timeout} s:\n{output[-4000:]}")
    return process.returncode, output


def _torchrun(backend):
    reference = backend == "gloo"
    code, output = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc_per_node", "2", str(SCRIPT), "--backend", backend],
                        _clean_env(), timeout=90 if reference else 240, reference=reference)
    assert code == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def gloos_losses():
    return _losses(_torchrun("gloo"))


def test_the_ddp_script_on_hoccl_under_torchrun_matches_gloo(gloos_losses):
    assert _losses(_torchrun("hoccl")) == gloos_losses


@pytest.mark.mpi
def test_the_ddp_script_on_hoccl_under_mpiexec_matches_gloo(gloos_losses):
    """No RANK, no MASTER_ADDR: import hoccl.torch takes the ranks from mpiexec's
    variables and agrees on the address through MPI."""
    code, output = _run([_mpiexec(), "-n", "2", sys.executable, str(SCRIPT)],
                        _clean_env(**MPI_ENV))
    assert code == 0, output[-4000:]
    assert "world_size=2 launcher variables RANK=0 LOCAL_RANK=0" in output, output[-4000:]
    assert _losses(output) == gloos_losses


def _free_slurm_job():
    """A job id whose port (``slurm_port``, step 0) is free here now."""
    inverse = pow(97, -1, len(SLURM_PORTS))
    for _ in range(100):
        port = random.choice(SLURM_PORTS)
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
        job = (port - SLURM_PORTS.start) * inverse % len(SLURM_PORTS) + len(SLURM_PORTS)
        assert slurm_port(job, 0) == port
        return job
    pytest.skip("no free port in the Slurm range")


def _this_host():
    """This host's name where it resolves (as a Slurm node's does), else localhost."""
    try:
        socket.gethostbyname(socket.gethostname())
        return socket.gethostname()
    except OSError:
        return "localhost"


def test_the_ddp_script_on_hoccl_under_srun_matches_gloo(gloos_losses):
    """srun's variables as srun sets them for a two-task step on this host (the test
    starts the tasks itself): the nodelist's first host and the job's port."""
    job = _free_slurm_job()
    step = {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_STEP_NODELIST": f"{_this_host()},absent[1-3]"}
    # the two tasks as one command, as srun starts them; each waited for by its pid (a
    # bare "wait -n" returns 127 when both tasks ended before it)
    tasks = "".join(f"SLURM_PROCID={rank} SLURM_LOCALID={rank} "
                    f"{shlex.quote(sys.executable)} {shlex.quote(str(SCRIPT))} & p{rank}=$!; "
                    for rank in range(2))
    code, output = _run(["bash", "-c", f"{tasks}wait $p0 && wait $p1"], _clean_env(**step))
    assert code == 0, output[-4000:]
    assert "world_size=2 launcher variables RANK=0 LOCAL_RANK=0" in output, output[-4000:]
    assert _losses(output) == gloos_losses


def test_without_python_hostlist_slurms_scontrol_expands_the_list(tmp_path, monkeypatch):
    """A stand-in ``scontrol`` on PATH prints one host per line, as Slurm's does; its
    output is the list, and a refusal is a ValueError naming the list."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 3\n'
                        'case "$3" in bad*) echo "Invalid hostlist" >&2; exit 1;; esac\n'
                        'printf "%s-a\\n%s-b\\n" "$3" "$3"\n')
    scontrol.chmod(0o755)
    monkeypatch.setitem(sys.modules, "hostlist", None)  # python-hostlist not installed
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert expand_nodelist("n[1-2]") == ["n[1-2]-a", "n[1-2]-b"]
    with pytest.raises(ValueError, match="scontrol refused 'bad"):
        expand_nodelist("bad[")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match=r"pip install 'hoccl\[slurm\]'"):
        expand_nodelist("n[1-2]")
