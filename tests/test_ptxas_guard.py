"""cmake/ptxas_guard.py, the CUDA compile launcher: a compile whose ptxas notes say that it serialised
wgmma, or made it wait for a group in flight, fails (its object removed); other notes pass through.
Driven here with a stand-in compiler that prints given ptxas notes."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUARD = ROOT / "cmake" / "ptxas_guard.py"
KERNEL = "_ZN4hmoe12_GLOBAL__N_16kernelIfEEvi"

# ptxas 13.0's wording of the notes (from compiles of hmoe kernels)
SERIAL = ("ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
          f"to program dependence on compiler-inserted WG.DP in divergent path in the function '{KERNEL}'\n")
WAIT = ("ptxas info    : (C7517) warpgroup.wait is injected in around line 44300 by compiler to allow use of "
        f"registers defined by GMMA in function '{KERNEL}'\n")
ARRIVE = ("ptxas info    : (C7519) warpgroup.arrive is injected in around line 5076 by compiler to allow use of "
          f"registers in GMMA in function '{KERNEL}'\n")
PLAIN = f"ptxas info    : Used 168 registers, used 16 barriers in '{KERNEL}'\n"

FAKE = """import sys
args = sys.argv[1:]
out = args[args.index("-o") + 1]
open(out, "w").write("object")
sys.stdout.write("compiled\\n")
sys.stderr.write(open(args[0]).read())
sys.exit(int(args[1]))
"""


def _compile(tmp_path, notes, rc=0, env=None):
    (tmp_path / "fake_nvcc.py").write_text(FAKE)
    (tmp_path / "notes.txt").write_text(notes)
    obj = tmp_path / "k.o"
    cmd = [sys.executable, str(GUARD), sys.executable, str(tmp_path / "fake_nvcc.py"), str(tmp_path / "notes.txt"),
           str(rc), "-c", "cuda/k_sm90a.cu", "-o", str(obj)]
    e = {k: v for k, v in os.environ.items() if k != "HMOE_PTXAS_GUARD"}
    e.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=60), obj


@pytest.mark.parametrize("notes,code", [(SERIAL, "C7518"), (WAIT, "C7517"), (PLAIN + SERIAL + ARRIVE, "C7518")])
def test_serialised_wgmma_fails_the_compile(tmp_path, notes, code):
    p, obj = _compile(tmp_path, notes)
    assert p.returncode == 1, p.stderr
    assert not obj.exists()  # no object of the failed compile for the next build to pick up
    assert f"{code}:" in p.stderr and "cuda/k_sm90a.cu" in p.stderr and "HMOE_PTXAS_GUARD=warn" in p.stderr
    assert "kernel" in p.stderr  # the function it happened in (demangled where c++filt is installed)
    assert notes in p.stderr and "compiled" in p.stdout  # the compiler's own output passes through


def test_both_notes_are_reported(tmp_path):
    p, _ = _compile(tmp_path, SERIAL + WAIT)
    assert p.returncode == 1 and "C7518:" in p.stderr and "C7517:" in p.stderr


@pytest.mark.parametrize("notes", ["", PLAIN, ARRIVE, PLAIN + ARRIVE])
def test_other_notes_pass(tmp_path, notes):
    # C7519 (a fence the compiler adds) is in the shipped prefill kernel and costs no serialisation
    p, obj = _compile(tmp_path, notes)
    assert p.returncode == 0, p.stderr
    assert obj.read_text() == "object"
    assert p.stderr == notes and p.stdout == "compiled\n"


def test_warn_builds_anyway(tmp_path):
    p, obj = _compile(tmp_path, SERIAL, env={"HMOE_PTXAS_GUARD": "warn"})
    assert p.returncode == 0 and obj.exists()
    assert "C7518:" in p.stderr and "built anyway" in p.stderr


def test_a_failed_compile_keeps_its_status_and_output(tmp_path):
    p, _ = _compile(tmp_path, "k.cu(3): error: identifier \"x\" is undefined\n" + SERIAL, rc=2)
    assert p.returncode == 2
    assert "identifier" in p.stderr and "hmoe: ptxas" not in p.stderr


def test_no_compiler_given():
    p = subprocess.run([sys.executable, str(GUARD)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "usage" in p.stderr
