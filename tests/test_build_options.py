"""The build's options as CMake reads them (cmake/HmoeCudaMode.cmake), in CMake's script mode."""
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cmake():
    exe = shutil.which("cmake")
    if exe is None:
        try:
            import cmake  # the pip package, as the build requires it
        except ImportError:
            pytest.skip("no cmake on PATH or as a Python package")
        exe = str(pathlib.Path(cmake.CMAKE_BIN_DIR) / "cmake")
    return exe


def _mode(tmp_path, value):
    script = tmp_path / "mode.cmake"
    script.write_text(f'include("{(ROOT / "cmake" / "HmoeCudaMode.cmake").as_posix()}")\n'
                      'hmoe_cuda_mode("${VALUE}" m)\nmessage(STATUS "mode=${m}")\n')
    return subprocess.run([_cmake(), f"-DVALUE={value}", "-P", str(script)], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("value,mode", [("AUTO", "AUTO"), ("auto", "AUTO"), ("ON", "ON"), ("on", "ON"), ("1", "ON"),
                                        ("True", "ON"), ("OFF", "OFF"), ("off", "OFF"), ("0", "OFF"), ("no", "OFF"),
                                        ("", "AUTO")])
def test_hmoe_cuda_values_in_any_case(tmp_path, value, mode):
    # "off" used to read as AUTO: the CUDA modules were built wherever nvcc was found
    p = _mode(tmp_path, value)
    assert p.returncode == 0 and f"mode={mode}" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("value", ["of", "yes please", "2"])
def test_other_hmoe_cuda_values_stop_the_configure(tmp_path, value):
    p = _mode(tmp_path, value)
    assert p.returncode != 0 and f"HMOE_CUDA={value}: expected AUTO, ON or OFF" in p.stderr, p.stdout + p.stderr
