"""Tests of hmoe.hardware (GPU detection through a fake NVML)."""
