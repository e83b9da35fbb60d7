"""Memory under limits: a failed allocation is one line naming the step, the array and the memory the process saw.

Found by a hostile run (issue 28 item 7): ``eval`` under ``ulimit -v 1200M`` ended in numpy's ``_ArrayMemoryError``
as a traceback. Each command now turns a MemoryError into an OutOfMemoryError line (hpu_fp8_loader/memory.py):
the engine's layer loop names the model, windows and layer, the converter the tensor or shard, and the command
line any other step by the command's name. The limits here are real (RLIMIT_AS, set in a child process), sized
from what that child maps before it starts, so they hold on any machine.
"""

from __future__ import annotations

import re
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpu_fp8_loader.cli.launch import MIN_ADDRESS_SPACE
from hpu_fp8_loader.errors import OutOfMemoryError
from hpu_fp8_loader.memory import memory_seen, out_of_memory
from hpu_fp8_loader.sources.measurements import write_measurements
from hpu_fp8_loader.sources.synth import preset_config, synthetic_measurements

MEMINFO = "MemTotal:       67108864 kB\nMemAvailable:   33554432 kB\n"  # 32 GiB available


def _numpy_memory_error() -> MemoryError:
    """A real one: numpy cannot allocate 4 PiB anywhere."""
    try:
        np.empty((2**25, 2**25), np.float32)
    except MemoryError as exc:
        return exc
    raise AssertionError("numpy allocated 4 PiB")


def test_a_numpy_allocation_failure_names_the_step_the_array_and_the_memory_seen():
    error = out_of_memory("bf16: windows 0..3, layer 2", _numpy_memory_error())
    assert isinstance(error, OutOfMemoryError)
    message = str(error)
    assert message.startswith(
        "bf16: windows 0..3, layer 2: out of memory allocating 4,194,304.0 GiB for an array of shape [33554432, 33554432] "
        "(float32) ("
    )
    assert "of RAM available" in message and "\n" not in message


def test_a_plain_memory_error_names_the_step_and_the_memory_seen():
    message = str(out_of_memory("converting ernie.layers.0.mlp.down_proj.weight", MemoryError()))
    assert message.startswith("converting ernie.layers.0.mlp.down_proj.weight: out of memory (")
    assert "allocating" not in message  # nothing is known of the allocation: nothing is guessed


def _kernel_files(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("cgroup", "shown"),
    [
        ({}, None),
        ({"proc/self/cgroup": "0::/job\n", "cgroup/job/memory.max": "max\n"}, None),
        ({"proc/self/cgroup": "0::/job\n", "cgroup/job/memory.max": f"{64 * 2**30}\n"}, None),  # looser than RAM
        (
            {
                "proc/self/cgroup": "0::/job\n",
                "cgroup/job/memory.max": f"{4 * 2**30}\n",
                "cgroup/job/memory.current": f"{2**30}\n",
            },
            "3.0 GiB left under the cgroup memory limit",
        ),
    ],
    ids=["no-cgroup", "unlimited", "looser-than-ram", "container-limit"],
)
def test_the_memory_seen_names_ram_and_a_tighter_cgroup_limit(tmp_path, cgroup, shown):
    _kernel_files(tmp_path, {"proc/meminfo": MEMINFO, **cgroup})
    seen = memory_seen(tmp_path / "proc", tmp_path / "cgroup")
    assert seen.startswith("32.0 GiB of RAM available")
    assert (shown in seen) if shown else "cgroup" not in seen


def test_the_memory_seen_names_a_real_ulimit_v_and_its_use():
    """RLIMIT_AS set for real, in a child: the message gives the limit and what the process maps."""
    script = (
        "import resource; from hpu_fp8_loader.memory import memory_seen\n"
        "resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, resource.RLIM_INFINITY))\n"
        "print(memory_seen())\n"
    )
    seen = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert re.search(r"; ulimit -v \(RLIMIT_AS\) is 3\.0 GiB, [\d.,]+ (MiB|GiB) of it in use", seen), seen


# ----- commands under a real ulimit -v -----


def _baseline_bytes() -> int:
    """What a fresh `hpu-fp8` maps once its commands are imported: the limits below are this plus a margin."""
    script = (
        "import re, numpy, hpu_fp8_loader.cli.main, hpu_fp8_loader.quality.evaluate, hpu_fp8_loader.conversion.convert\n"
        "print(int(re.search(r'VmSize:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) * 1024)\n"
    )
    return int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)


def _run_limited(argv: list[object], limit: int, cwd: Path, launcher: bool = True) -> subprocess.CompletedProcess:
    """``hpu-fp8 ARGV`` under ``ulimit -v limit``; without ``launcher``, the command line itself (``python -m
    hpu_fp8_loader.cli.main``), past the executable's start-up floor (cli/launch.py), as a library caller runs it."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    cli = [str(Path(sys.executable).with_name("hpu-fp8"))] if launcher else [sys.executable, "-m", "hpu_fp8_loader.cli.main"]
    return subprocess.run([*cli, *map(str, argv)], capture_output=True, text=True, preexec_fn=cap, cwd=cwd, timeout=600)


def _one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("hpu-fp8: error: ")
    return lines[0]


@pytest.mark.slow
def test_eval_under_ulimit_v_names_the_layer_the_array_and_the_limit(tmp_path, source_factory, spec_factory):
    """The issue's case: attention over 2048 tokens needs 256 MiB arrays; 300 MiB above the start cannot hold them."""
    limit = _baseline_bytes() + 300 * 2**20
    argv = ["eval", source_factory("qwen2-tiny"), spec_factory("qwen2-tiny"), "--samples", "64", "--seq-len", "2048"]
    line = _one_line(_run_limited(argv, limit, tmp_path))
    assert re.search(r": windows \d+\.\.\d+, layer 0: out of memory allocating [\d.,]+ MiB for an array of shape \[", line), line
    assert "ulimit -v (RLIMIT_AS) is" in line and "of RAM available" in line


@pytest.mark.slow
def test_convert_under_ulimit_v_is_one_line_and_publishes_nothing(tmp_path, source_factory):
    """A limit the converter's first steps already overrun: one line, no OUT; the same command then runs."""
    write_measurements(tmp_path / "m.json", synthetic_measurements(preset_config("qwen2-tiny")))
    argv = ["convert", source_factory("qwen2-tiny"), tmp_path / "out", "--measurements", tmp_path / "m.json", "--workers", "2"]
    line = _one_line(_run_limited(argv, _baseline_bytes() + 2 * 2**20, tmp_path, launcher=False))
    assert ": out of memory" in line and "ulimit -v (RLIMIT_AS) is" in line
    assert not (tmp_path / "out").exists()
    again = subprocess.run(
        [str(Path(sys.executable).with_name("hpu-fp8")), *map(str, argv), "-q"], capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize("mib", [120, 200, 250])
def test_an_address_space_too_small_to_start_in_is_one_line_of_ours(tmp_path, mib):
    """Issue 39 item 5: below about 250 MiB the line was OpenBLAS's ("Memory allocation still failed after 10
    retries, giving up") as numpy loaded, or a pydantic traceback; now the executable refuses first."""
    line = _one_line(_run_limited(["validate", "qwen2-bytes"], mib * 2**20, tmp_path))
    assert line == (
        f"hpu-fp8: error: ulimit -v (RLIMIT_AS) is {mib} MiB; hpu-fp8 needs at least {MIN_ADDRESS_SPACE >> 20} MiB of "
        "address space to start (Python, numpy and its BLAS library): raise it with `ulimit -v`"
    )


def test_blas_buffers_that_do_not_fit_are_one_line_of_ours_and_the_process_lives():
    """Past the start, a limit that leaves OpenBLAS no room for its work buffers: it would print its own line and exit
    the process from inside the first product; the forked trial makes it an OutOfMemoryError, and the same call
    passes once the limit allows the buffers."""
    script = (
        "import re, resource\n"
        "from hpu_fp8_loader.memory import reserve_blas_buffers\n"
        "from hpu_fp8_loader.errors import OutOfMemoryError\n"
        "vm = int(re.search(r'VmSize:\\s+(\\d+)', open('/proc/self/status').read())[1]) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (8 << 20), resource.RLIM_INFINITY))\n"
        "try:\n"
        "    reserve_blas_buffers('the first matrix product', 2)\n"
        "except OutOfMemoryError as exc:\n"
        "    print(exc)\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))\n"
        "reserve_blas_buffers('the first matrix product', 2)\n"
        "print('fits')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "OpenBLAS error" not in done.stdout + done.stderr, done.stdout + done.stderr
    refusal, fits = done.stdout.splitlines()
    assert refusal.startswith("the first matrix product: out of memory for the work buffers of the BLAS library")
    assert "ulimit -v (RLIMIT_AS) is" in refusal and fits == "fits"
