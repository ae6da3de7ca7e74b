"""``--sanitize``: compute-sanitizer's report read into findings, each given the case whose call it came from.

On the CPU the report is a fixed text in the tool's format (what the parser
must read) and the audit says why the phase cannot run; on a GPU with the
tool a planted kernel whose only bug is an out-of-bounds read fails
``memory`` while passing numerics, and the reference kernel passes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fuseaudit.audit import AuditUsageError, audit
from fuseaudit.audit_result import FAIL, PASS, SKIP
from fuseaudit.case import Case
from fuseaudit.sanitize import MARK, _Reader, find_tool, parse_tools

PLANTED = Path(__file__).parent / "planted"
KERNEL = "rms_norm_oob_kernel"

REPORT = f"""\
========= COMPUTE-SANITIZER
{MARK} begin 0
{MARK} end 0
{MARK} begin 1
========= Invalid __global__ read of size 2 bytes
=========     at {KERNEL}+0x1b0 in /tmp/x/oob_read.py:19
=========     by thread (127,0,0) in block (14,0,0)
=========     Address 0x7f3a00001ffe is out of bounds
=========     and is 2 bytes after the nearest allocation at 0x7f3a00000000 of size 8190 bytes
=========
========= Invalid __global__ read of size 2 bytes
=========     at {KERNEL}+0x1b0 in /tmp/x/oob_read.py:19
=========     by thread (126,0,0) in block (14,0,0)
=========     Address 0x7f3a00001ffc is out of bounds
the target's own print, ignored
{MARK} end 1
========= Uninitialized __global__ memory read of size 4 bytes
=========     at void at::native::copy_kernel<float>(int)+0x40 in Copy.cu:12
{MARK} begin 2
{MARK} raised 2 ValueError: no
{MARK} end 2
========= ERROR SUMMARY: 3 errors
"""


def test_the_report_is_read_into_findings_by_case() -> None:
    reader = _Reader("memcheck")
    for line in REPORT.splitlines():
        reader.feed(line)
    findings = reader.close()
    inside = [f for f in findings if f.case is not None]
    assert len(inside) == 1, findings  # two threads, one finding
    first = inside[0]
    assert (first.case, first.kernel, first.where, first.count) == (1, KERNEL, "oob_read.py:19", 2)
    assert first.what == "Invalid __global__ read of size 2 bytes"
    assert first.line() == f"memcheck: Invalid __global__ read of size 2 bytes in {KERNEL} (oob_read.py:19), 2 times"
    outside = [f for f in findings if f.case is None]
    assert [f.kernel for f in outside] == ["void at::native::copy_kernel(int)"]  # template arguments dropped
    assert reader.ended == [0, 1, 2] and reader.raised == {2: "ValueError: no"}


def test_tools_are_validated() -> None:
    assert parse_tools("") == ["memcheck", "initcheck", "racecheck"]
    assert parse_tools("racecheck,memcheck,racecheck") == ["racecheck", "memcheck"]
    with pytest.raises(ValueError, match="known: memcheck, initcheck, racecheck"):
        parse_tools("leakcheck")
    with pytest.raises(AuditUsageError, match="--sanitize: unknown sanitizer tool 'leakcheck'"):
        audit("rms_norm", "fuseaudit.kernels.rms_norm:rms_norm", device="cpu", sanitize="leakcheck")


def test_on_the_cpu_the_phase_says_why_it_cannot_run(fuseaudit_device: str) -> None:
    if fuseaudit_device != "cpu":
        pytest.skip("the CPU's answer")
    case = Case(op="rms_norm", dtype="float32", dims={"lead": (2,), "N": 33}, layouts={}, params={"eps": 1e-6})
    result = audit("rms_norm", "fuseaudit.kernels.rms_norm:rms_norm", device="cpu", case=case, sanitize=True)
    memory = result.verdicts["memory"]
    assert memory.status == SKIP and "ran on the CPU" in memory.summary
    assert result.exit_code == 0, result.render()
    assert "memory            SKIP" in result.render()


def _gpu_with_tool(device: str) -> None:
    if not device.startswith("cuda"):
        pytest.skip("compute-sanitizer checks CUDA kernels")
    if find_tool() is None:
        pytest.skip("compute-sanitizer is not installed here")


def test_an_out_of_bounds_read_numerics_cannot_see_fails_memory(fuseaudit_device: str) -> None:
    _gpu_with_tool(fuseaudit_device)
    result = audit("rms_norm", f"{PLANTED / 'oob_read.py'}:rms_norm", device=fuseaudit_device, examples=5, seed=0,
                   sanitize="memcheck", contiguous_only=True)  # no copy kernels: one launch
    text = result.render()
    assert result.verdicts["numerics"].status == PASS, text
    memory = result.verdicts["memory"]
    assert memory.status == FAIL, text
    assert "Invalid __global__ read" in memory.summary and KERNEL in memory.summary, text
    case = Case.from_json(memory.failures[0].case)
    assert case.dims["N"] & (case.dims["N"] - 1), f"a power-of-two row reads nothing past its end: {case.describe()}"
    assert memory.failures[0].replay.endswith("--sanitize memcheck")


def test_the_reference_kernel_passes_every_tool(fuseaudit_device: str) -> None:
    _gpu_with_tool(fuseaudit_device)
    result = audit("rms_norm", "fuseaudit.kernels.rms_norm:rms_norm", device=fuseaudit_device, examples=5, seed=0,
                   sanitize=True)
    assert result.verdicts["memory"].status == PASS, result.render()
