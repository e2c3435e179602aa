"""The `variant` fixture of the GPU op tests: a test that takes it runs once per kernel family of
its module's op (the module's VARIANT_OP), forced with variant=: portable on every GPU, sm90a on
compute capability 9.0 with a build that has it for that op."""
import pytest


@pytest.fixture(params=["portable", "sm90a"])
def variant(request):
    import torch

    from hmoe import _build_info

    op = request.module.VARIANT_OP
    if request.param == "sm90a":
        cc = torch.cuda.get_device_capability()
        if cc != (9, 0):
            pytest.skip(f"the sm90a family runs on compute capability 9.0 only; this GPU is {cc[0]}.{cc[1]}")
        if "sm90a" not in _build_info.cuda_kernels_for(op):
            pytest.skip(f"this build has no sm90a {op} module")
    return request.param
