"""`make gpu-check` where CUDA is absent: on a machine without a GPU it says why it skips, exits
0 and writes a report saying so; on a machine that shows a GPU (nvidia-smi on PATH) a torch that
cannot use it is a failure; the wheelhouse unpacks without pip; and the report it writes on a
GPU (its Markdown, its failures) from checks recorded by hand. `make gpu-check-dry` (CI) runs
every step of the check itself on the CPU."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import REPO, cli_environ

sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402


def make_gpu_check(tmp_path, env: dict) -> subprocess.CompletedProcess:
    env.pop("PYTHONPATH", None)  # the target puts this checkout's src/ on it itself
    return subprocess.run(["make", "--no-print-directory", "gpu-check", f"PY={sys.executable}",
                           f"GPU_CHECK_ARGS=--out {tmp_path}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_make_gpu_check_without_a_gpu_skips_cleanly_saying_why(tmp_path):
    env = cli_environ() | {"CUDA_VISIBLE_DEVICES": ""}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not (Path(p) / "nvidia-smi").exists())
    done = make_gpu_check(tmp_path, env)
    assert done.returncode == 0, done.stderr
    why = (f"CUDA absent: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no "
           "GPU, and this machine shows none (no nvidia-smi, no /dev/nvidia*)")
    assert f"\ngpu-check: skipped: {why} (report: " in done.stdout  # after make's echo
    report = (tmp_path / "report.md").read_text()
    assert report == f"# gradsync GPU check\n\n- skipped: {why}; nothing was run.\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no GPU")
def test_a_gpu_machine_whose_torch_cannot_use_it_fails_saying_why(tmp_path):
    """nvidia-smi on PATH (here a stand-in) says the machine has a GPU: a CPU-only torch, or a
    driver this torch cannot use, is then a failure, not a skip (a false pass on a GPU box)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = cli_environ()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    done = make_gpu_check(tmp_path / "out", env)
    assert done.returncode == 2  # make's own, for the check's exit code 1
    build = f"torch {torch.__version__} (CUDA build: {torch.version.cuda})"
    if torch.version.cuda is None:
        why = (f"this machine has a GPU (nvidia-smi is on PATH) but {build} at "
               f"{sys.executable} is a CPU-only build: run with a Python whose torch is a CUDA "
               "build (make gpu-check PY=/path/to/python)")
    else:
        why = f"this machine has a GPU (nvidia-smi is on PATH) but {build} cannot use it: "
    assert f"gpu-check: FAILED: {why}" in done.stdout
    assert (tmp_path / "out" / "report.md").read_text().startswith(
        f"# gradsync GPU check\n\n- FAILED: {why}")


def test_wheels_unpack_where_pip_is_missing(tmp_path):
    """A Python without pip gets the wheelhouse unpacked: the pure wheels, and of a binary one
    the build for this interpreter and machine only."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    other = "cp39" if tag != "cp39" else "cp38"
    machine = platform.machine()
    for name, module in (("pure-1.0-py3-none-any.whl", "pure"),
                         (f"native-1.0-{tag}-{tag}-manylinux2014_{machine}.whl", "native_here"),
                         (f"native-1.0-{other}-{other}-manylinux2014_{machine}.whl", "elsewhere"),
                         (f"native-1.0-{tag}-{tag}-manylinux2014_s390x.whl", "s390x")):
        with zipfile.ZipFile(wheels / name, "w") as z:
            z.writestr(f"{module}/__init__.py", "")
    site = tmp_path / "site"
    chosen = gpu_check.unpack_wheels(wheels, site)
    assert sorted(chosen) == sorted(["pure-1.0-py3-none-any.whl",
                                     f"native-1.0-{tag}-{tag}-manylinux2014_{machine}.whl"])
    assert sorted(p.name for p in site.iterdir()) == ["native_here", "pure"]


def test_the_report_lists_every_check_with_its_figures(tmp_path):
    report = gpu_check.Report(["- cuda:0: a GPU"])
    report.add("tests marked gpu").done(True, "7 passed")
    report.add("kill -9 and resume, bitwise").done(False, "parameters bitwise equal: False")
    report.add("LM tokens/s vs a hand-written loop")  # a check that never finished
    path = report.write(tmp_path / "out")
    assert path == tmp_path / "out" / "report.md"
    assert path.read_text() == "\n".join([
        "# gradsync GPU check", "", "- cuda:0: a GPU", "",
        "| check | result |", "|---|---|",
        "| tests marked gpu | pass |",
        "| kill -9 and resume, bitwise | FAIL |",
        "| LM tokens/s vs a hand-written loop | not run |", "",
        "## tests marked gpu: pass", "", "- 7 passed", "",
        "## kill -9 and resume, bitwise: FAIL", "", "- parameters bitwise equal: False", "",
        "## LM tokens/s vs a hand-written loop: not run", "", "- (nothing recorded)", ""])
    assert report.failed == ["kill -9 and resume, bitwise"]
    env = gpu_check.child_env()
    assert env["PYTHONPATH"].split(":")[0] == str(REPO / "src")
    assert "RANK" not in env and not any(k.startswith("SLURM_") for k in env)


# --- host syncs: counted on the CPU (HostSyncs), judged per policy --------------------------------
def test_the_cpu_counter_sees_reads_pageable_copies_and_those_in_backward_hooks():
    """HostSyncs counts what would wait for the GPU on CUDA, by source line, also inside the
    autograd engine (where the backward hooks, and gradsync's engine, make their reads)."""
    p = torch.nn.Parameter(torch.ones(3))
    hook = sys._getframe().f_lineno + 1
    p.register_post_accumulate_grad_hook(lambda q: [q.grad.sum().item()] and None)
    with gpu_check.HostSyncs() as counter:
        x = torch.ones(4)
        reads = sys._getframe().f_lineno + 1
        x.sum().item(), x.tolist(), bool(x.all()), float(x.sum())
        copy = sys._getframe().f_lineno + 1
        torch.tensor([1.0, 2.0], device="cpu")  # host numbers for a device: a pageable copy
        torch.tensor([1.0, 2.0]), x.to("cpu"), torch.zeros(2, device="cpu")  # none of those
        (p * 2).sum().backward()
    here = "/".join(Path(__file__).parts[-3:])  # a site: its last 3 path parts
    assert counter.sites == {f"{here}:{reads}": 4, f"{here}:{copy}": 1, f"{here}:{hook}": 1}
    assert torch.Tensor.item is torch._C.TensorBase.item  # unwrapped again


@pytest.mark.parametrize("costs", [c for c in gpu_check.POLICIES if c.cpu is not None],
                         ids=lambda c: c.label)
def test_host_syncs_per_window_are_the_documented_ones(costs, single_process_group,
                                                        monkeypatch):
    """gpu-check's policy windows on a 1-rank gloo group, counted with HostSyncs: the documented
    count and sites (docs/gpus-and-slurm.md). The noise scale's flush (AdaScale: every window;
    the adaptive schedule: every `every` steps) reads once, its numbers sent without a pageable
    copy (it was 9 per window: 5 pageable copies and 2 reads of 2 tensors); gradsync's
    find_unused_parameters reads once per synchronising backward (it was 2)."""
    monkeypatch.setattr(gpu_check.TARGET, "dry", True)
    measured = gpu_check.measure_policy(costs.overrides, torch.device("cpu"))
    assert gpu_check.judge_costs(costs, measured, dry=True) == [], measured
    assert measured["syncs"] == costs.cpu * gpu_check.WINDOWS


def test_host_sync_sites_and_counts_are_judged_per_policy():
    """A site documented for another policy is not this one's (precision.py is fp16's, not local
    SGD's); a count other than the documented one fails; stderr's syncs go to the policy whose
    mark precedes them."""
    local = next(c for c in gpu_check.POLICIES if c.label == "local SGD (every 2)")
    fine = {"syncs": 4, "sites": {"gradsync/sync/averaging.py:124": 4}}
    assert gpu_check.judge_costs(local, fine, dry=False) == []
    stray = {"syncs": 12, "sites": {"gradsync/sync/averaging.py:124": 4,
                                    "gradsync/train/precision.py:74": 8}}
    assert gpu_check.judge_costs(local, stray, dry=False) == [
        "undocumented site gradsync/train/precision.py:74", "12 in 8 windows, documented 4"]
    unknown = next(c for c in gpu_check.POLICIES if c.cuda is None)
    assert gpu_check.judge_costs(unknown, {"syncs": 3, "sites": {gpu_check.STDERR: 3}},
                                 dry=False) == []
    err = "\n".join([f"{gpu_check.MARK}always", "Warning: synchronizing CUDA operation x",
                     f"{gpu_check.MARK}PowerSGD", "other",
                     "Warning: synchronizing CUDA operation y",
                     "Warning: synchronizing CUDA operation z"])
    assert gpu_check.stderr_syncs(err) == {"always": 1, "PowerSGD": 2}


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_ranks_said_to_share_a_gpu_share_it_and_the_others_have_their_own(gpus, monkeypatch):
    """Where the worker puts the 2 ranks (Placement.device, with `gpus` GPUs visible: faked, the
    CPU has none): tests/gpu_cases.py's shared-GPU cases on cuda:0 for both ranks on any box
    (rank 1 went to cuda:1 on a box of 2 or more); gpu-check's 2-rank step on cuda:0 and cuda:1
    (nccl) where there are 2 or more, on cuda:0 for both (cuda:gloo) where there is one."""
    import gpu_cases

    monkeypatch.setattr("gradsync.run.placement.visible_gpus", lambda: gpus)
    shared = [str(gpu_cases.shared_gpu_placement("nccl", r, 2).device()) for r in (0, 1)]
    assert shared == ["cuda:0", "cuda:0"]
    layout = [gpu_check.matrix_placement(r, gpus, dry=False) for r in (0, 1)]
    devices = [str(placement.device()) for _, placement in layout]
    if gpus == 1:
        assert [g for g, _ in layout] == ["cuda:gloo"] * 2 and devices == ["cuda:0", "cuda:0"]
    else:
        assert [g for g, _ in layout] == ["nccl"] * 2 and devices == ["cuda:0", "cuda:1"]
