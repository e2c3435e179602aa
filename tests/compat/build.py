"""What the installed hmoe was built with, for the compat tests: several expect the verdicts of the
default CUDA targets (HMOE_CUDA_ARCHS unset, as CI and the wheels build), and skip, saying so, on a
build for fewer targets, such as a lab build for one GPU."""
import pytest

import hmoe

MANIFEST = hmoe.build_info()
HAS_CUDA = bool(MANIFEST.get("cuda_version") and MANIFEST.get("cuda_kernels"))
needs_cuda_build = pytest.mark.skipif(not HAS_CUDA, reason="this hmoe was built without CUDA")
# The SASS targets ("80", "90", ...) that every kernel of the portable family has in this build.
_portable = [set(e["sass"]) for e in MANIFEST.get("cuda_kernels", {}).values() if e["family"] == "portable"]
PORTABLE_SASS = set.intersection(*_portable) if _portable else set()


def needs_sass(*targets):
    """Skips a test whose expected verdicts need the portable kernels' SASS for `targets` when this
    build has CUDA kernels but not those targets (a build without CUDA runs it: its verdicts say
    so)."""
    missing = [t for t in targets if t not in PORTABLE_SASS]
    return pytest.mark.skipif(HAS_CUDA and bool(missing),
                              reason=f"this hmoe was built without sm_{', sm_'.join(missing)} SASS "
                                     "(HMOE_CUDA_ARCHS): the test expects the default targets' verdicts")
