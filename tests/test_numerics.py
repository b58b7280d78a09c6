"""Same config, same bits, on any machine (docs/reproducibility.md): the numerics fingerprint
read from torch's own APIs, what counts as a difference, portable bits held against another CPU
kind's ISA settings forced from outside, an outside launcher's rank without the pins refused,
and a resume across fingerprints said in one line."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_jobs import Job
from gradsync.core import numerics
from gradsync.run import sweep

TINY = ["trainer.devices=1", "trainer.max_steps=5", "trainer.progress_bar=false",
        "trainer.threads_per_worker=1"]


def params_hash(run_dir: Path) -> str:
    params = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def recorded(run_dir: Path) -> dict:
    return json.loads((run_dir / "run_info.json").read_text())["numerics"]


def _numpy_targets() -> str:
    from numpy._core._multiarray_umath import __cpu_dispatch__
    return ",".join(__cpu_dispatch__)


# As another CPU kind's native path runs, forced from outside: ATen without its vector kernels,
# MKL at most SSE4.2, oneDNN at most SSE4.1, NumPy without any of its dispatched loops.
ANOTHER_CPU = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
               "ONEDNN_MAX_CPU_ISA": "SSE41", "NPY_DISABLE_CPU_FEATURES": _numpy_targets()}


@pytest.mark.slow
def test_portable_bits_hold_under_another_cpus_isa_settings_native_bits_do_not(tmp_path,
                                                                            cli_env):
    runs = {}
    for bits in ("portable", "native"):
        for where, outside in (("here", {}), ("another", ANOTHER_CPU)):
            run_dir = tmp_path / f"{bits}-{where}"
            code, _, err = Job(run_dir, [*TINY, f"trainer.bits={bits}"],
                               cli_env | outside).finish()
            assert code == 0, err
            runs[bits, where] = params_hash(run_dir), recorded(run_dir)
    assert runs["portable", "here"][0] == runs["portable", "another"][0]
    assert runs["native", "here"][0] != runs["native", "another"][0]  # the settings bite
    # what each rank computed with, read from torch inside it
    here, another = runs["portable", "here"][1], runs["portable", "another"][1]
    assert numerics.differences(here, another) == []
    assert here["cpu"]["capability"] == "AVX2" and here["mkl"]["branch"] == "COMPATIBLE"
    assert here["onednn"]["enabled"] is False and here["threads"] == 1
    assert here["pins"] == numerics.portable_env()
    native = runs["native", "another"][1]
    assert native["cpu"]["capability"] == "DEFAULT" and native["onednn"]["enabled"] is True
    assert native["pins"]["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    assert numerics.differences(runs["native", "here"][1], native)[:1] == [
        f"cpu.capability: {runs['native', 'here'][1]['cpu']['capability']} -> DEFAULT"]


@pytest.mark.slow
def test_a_resume_whose_numerics_differ_says_so_in_one_line(tmp_path, cli_env):
    """(A resume on the machine that wrote the checkpoint says nothing: tests/test_resume.py's
    cases hold summary.json's resumed_numerics_differ to [].)"""
    run_dir = tmp_path / "run"
    code, _, err = Job(run_dir, [*TINY, "trainer.max_steps=6"], cli_env).finish()
    assert code == 0, err
    # the newest checkpoint as another CPU kind would have written it
    side = run_dir / "checkpoints" / "step_00000006.json"
    meta = json.loads(side.read_text())
    mine = dict(meta["numerics"]["cpu"])
    assert mine == recorded(run_dir)["cpu"] and meta["numerics"]["bits"] == "native"
    other = "AVX512" if mine["capability"] == "AVX2" else "AVX2"
    meta["numerics"]["cpu"] |= {"capability": other, "model": "Another CPU"}
    side.write_text(json.dumps(meta))
    code, _, err = Job(run_dir, [*TINY, "trainer.max_steps=8", "resume=auto"], cli_env).finish()
    assert code == 0, err
    said = [line for line in err.splitlines() if "numerics differ" in line]
    differ = [f"cpu.capability: {other} -> {mine['capability']}",
              f"cpu.model: Another CPU -> {mine['model']}"]
    assert len(said) == 1 and said[0].endswith(
        f"resume: the numerics differ from the checkpoint's ({'; '.join(differ)}): the "
        "continuation is not bitwise the uninterrupted run (docs/reproducibility.md)"), err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_numerics_differ"] == differ and summary["optimizer_steps"] == 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_an_outside_launchers_rank_without_the_pins_is_refused_and_runs_with_them(tmp_path,
                                                                                cli_env):
    """A rank torchrun or srun started is one process that already loaded torch: portable
    bits need the pins in its environment from the start, as the refusal says how."""
    rank = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    args = [*TINY, "trainer.bits=portable"]
    code, _, err = Job(tmp_path / "run", args, cli_env | rank).finish()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("gradsync: config error: trainer.bits=portable: this rank "
                               "(torchrun) was started without the pins (ATEN_CPU_CAPABILITY="
                               "avx2;"), err
    assert lines[0].endswith("start the ranks with `env $(python -m gradsync.core.numerics) "
                             "torchrun ...`")
    assert not (tmp_path / "run").exists()
    printed = subprocess.run([sys.executable, "-m", "gradsync.core.numerics"], env=cli_env,
                             capture_output=True, text=True, check=True).stdout.split()
    env = cli_env | rank
    while printed[0] == "-u":  # as env(1) reads it
        env.pop(printed[1], None)
        printed = printed[2:]
    env |= dict(shlex.split(word)[0].split("=", 1) for word in printed)
    code, _, err = Job(tmp_path / "run", args, env).finish()
    assert code == 0, err
    assert recorded(tmp_path / "run")["cpu"]["capability"] == "AVX2"


# --- the fingerprint and its comparison (no process) -----------------------------------------
def test_the_fingerprint_is_what_torch_says_this_process_computes_with(monkeypatch):
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    threads = torch.get_num_threads()
    fp = numerics.fingerprint("native")
    assert fp["bits"] == "native" and fp["torch"] == str(torch.__version__)
    assert fp["torch_git"] == torch.version.git_version
    assert fp["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert fp["threads"] == threads
    assert fp["deterministic"]["algorithms"] == torch.are_deterministic_algorithms_enabled()
    assert fp["pins"]["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert fp["mkl"]["version"] is not None and fp["mkl"]["version"][:4].isdigit()
    if "MKL_CBWR" not in os.environ:  # MKL's reproducibility mode is off unless asked for
        assert fp["mkl"]["branch"] == "OFF"
    assert fp["onednn"]["version"] is not None and fp["cuda"] is None
    json.dumps(fp)  # plain data: it goes into JSON files and weights_only checkpoints


def _fp(bits: str, capability: str = "AVX2", model: str = "AMD EPYC", threads: int = 1) -> dict:
    return {"bits": bits, "torch": "2.13.0", "cpu": {"model": model, "vendor": "v",
                                                     "flags": ["avx2"], "capability": capability},
            "threads": threads}


def test_portable_bits_compare_everything_but_the_cpu_native_bits_everything():
    intel, amd = _fp("portable", model="Intel Xeon"), _fp("portable", model="AMD EPYC")
    assert numerics.differences(intel, amd) == []
    assert numerics.key(intel) == numerics.key(amd)
    assert numerics.differences(intel, amd | {"threads": 2}) == ["threads: 1 -> 2"]
    native = _fp("native", "AVX512", "Intel Xeon"), _fp("native", "AVX2", "AMD EPYC")
    assert numerics.differences(*native) == ["cpu.capability: AVX512 -> AVX2",
                                             "cpu.model: Intel Xeon -> AMD EPYC"]
    assert numerics.key(native[0]) != numerics.key(native[1])
    assert numerics.differences(None, amd) == ["numerics: unrecorded -> recorded"]
    assert numerics.differences(_fp("native"), amd) == ["bits: native -> portable"]


def test_portable_bits_refuse_a_cpu_without_the_baseline_and_an_unpinned_outside_rank():
    with pytest.raises(numerics.NumericsError, match=r"^trainer.bits=portable needs a CPU with "
                       r"AVX2 and FMA; this one \(Old CPU\) lacks avx2, fma \(use "):
        numerics.check_portable_cpu({"arch": "x86_64", "flags": [], "model": "Old CPU"})
    with pytest.raises(numerics.NumericsError, match="this machine is aarch64"):
        numerics.check_portable_cpu({"arch": "aarch64", "flags": [], "model": "Arm"})
    numerics.check_portable(None)  # this CPU has the baseline; gradsync pins its own ranks
    with pytest.raises(numerics.NumericsError, match=r"this rank \(srun\) was started without "
                       r"the pins .*MKL_CBWR=COMPATIBLE,STRICT"):
        numerics.check_portable("srun")  # this test process loaded torch without them


def test_a_sweep_says_which_jobs_computed_with_other_numerics(tmp_path):
    def job(num: int, fp: dict) -> sweep.Job:
        s = {"status": "completed", "world_size": 2, "micro_batch_size": 8, "window_size": 1,
             "optimizer_steps": 1, "final_train_loss": 1.0, "eval": {}, "numerics": fp,
             "samples_per_s": 1.0, "sync_backwards": [1], "allreduce_calls": [1],
             "allreduce_bytes": [4], "peak_rss_mb": 1.0}
        return sweep.Job(num, tmp_path / str(num), {"lr": str(num)}, s, [])

    amd, intel = _fp("native", "AVX512", "AMD EPYC"), _fp("native", "AVX2", "Intel Xeon")
    for fps, said in (([amd, amd], False), ([amd, intel, amd], True)):
        jobs = [job(n, fp) for n, fp in enumerate(fps)]
        columns, rows = sweep.table(jobs)
        text = sweep.markdown(tmp_path, jobs, columns, rows)
        assert [r["numerics"] for r in rows] == [numerics.key(fp) for fp in fps]
        line = ("The jobs computed with 2 different numerics (their bits differ by more than "
                "what was swept; the CSV's numerics column): jobs 0, 2: AMD EPYC, AVX512, "
                "bits=native, torch 2.13.0, 1 threads; job 1: Intel Xeon, AVX2, bits=native, "
                "torch 2.13.0, 1 threads.")
        assert (line in text) is said, text
