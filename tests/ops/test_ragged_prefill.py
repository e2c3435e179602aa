"""ragged_prefill: the references and argument errors on the CPU; on the GPU against the fp64
reference (dtype-derived tolerance) and the reference that rounds P where the kernel does (tight),
each GPU test once per variant (family) forced with variant=: portable, and sm90a on compute
capability 9.0."""
import math

import pytest
import torch

import hmoe
from hmoe import _reference
from hmoe.ops import prefill as prefill_mod

from .prefill_reference import DTYPES, HEAD_DIMS, indptr, make_ragged, rel_err, tol
from .ptx_jit import run_forced_ptx
from .storage import in_storage

SCALE = 192 ** -0.5
VARIANT_OP = "ragged_prefill"  # the op of the variant fixture (conftest.py)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def naive(q, k, v, qo, kv, scale, causal):
    """Query by query in fp64, straight from the docstring's formulas (no shared code with _reference)."""
    H, Hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], H, v.shape[2], dtype=torch.float64)
    lse = torch.full((q.shape[0], H), -math.inf, dtype=torch.float64)
    for b in range(len(qo) - 1):
        lq, lk = int(qo[b + 1] - qo[b]), int(kv[b + 1] - kv[b])
        for i in range(lq):
            n = min(lk, i + lk - lq + 1) if causal else lk
            if n <= 0:
                continue
            for h in range(H):
                ks, vs = k[kv[b]:kv[b] + n, h // (H // Hkv)].double(), v[kv[b]:kv[b] + n, h // (H // Hkv)].double()
                s = (ks @ q[qo[b] + i, h].double()) * scale
                w = torch.exp(s - s.max())
                out[qo[b] + i, h] = (w[:, None] * vs).sum(0) / w.sum()
                lse[qo[b] + i, h] = s.max() + torch.log(w.sum())
    return out, lse


@pytest.mark.parametrize("causal", [True, False])
def test_fp64_reference_is_the_documented_math(causal):
    # empty requests, lq < lk, one query, GQA 3; non-causal also lq > lk
    q_lens, kv_lens = [5, 0, 3, 1, 4, 6], [5, 4, 0, 9, 11, 6 if causal else 2]
    q, k, v, qo, kv = make_ragged(q_lens, kv_lens, 6, 2, (64, 64), torch.float16, "cpu", gen(1))
    got, lse = _reference.prefill(q, k, v, qo, kv, 0.3, causal)
    want, want_lse = naive(q, k, v, qo, kv, 0.3, causal)
    assert float((got - want).abs().max()) < 1e-12
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    assert float((lse[fin] - want_lse[fin]).abs().max()) < 1e-12
    part, part_lse = _reference.prefill(q, k, v, qo, kv, 0.3, causal, heads=[4, 1])
    assert torch.equal(part, got[:, [4, 1]]) and torch.equal(part_lse, lse[:, [4, 1]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [16, 32, 64])
def test_rounded_p_reference_within_the_dtype_tolerance(dtype, tile):
    q, k, v, qo, kv = make_ragged([40, 0, 70], [40, 9, 150], 2, 1, (128, 128), dtype, "cpu", gen(2))
    ref, ref_lse = _reference.prefill(q, k, v, qo, kv, SCALE)
    got, lse = _reference.prefill_rounded_p(q, k, v, qo, kv, SCALE, tile_kv=tile)
    assert rel_err(got.to(dtype), ref) < tol(dtype)
    seen = torch.isfinite(ref_lse)
    assert torch.isneginf(lse[~seen]).all() and (got[~seen] == 0).all()
    assert float((lse[seen].double() - ref_lse[seen]).abs().max()) < _reference.PREFILL_LSE_ATOL


def test_tolerance_depends_on_the_dtype():
    # P rounded to bf16 is off by more than fp16's bound allows and within bf16's: a test that used
    # one dtype's tolerance for the other would be wrong in one direction or the other.
    assert tol(torch.bfloat16) == 3 * 2.0 ** -8 and tol(torch.float16) == 3 * 2.0 ** -11
    assert tol(torch.bfloat16, same_rounding=True) == 2 * 2.0 ** -8
    q, k, v, qo, kv = make_ragged([300], [300], 2, 2, (128, 128), torch.bfloat16, "cpu", gen(3))
    ref, _ = _reference.prefill(q, k, v, qo, kv, SCALE)
    err = rel_err(_reference.prefill_rounded_p(q, k, v, qo, kv, SCALE, tile_kv=64)[0].to(torch.bfloat16), ref)
    assert tol(torch.float16) < err < tol(torch.bfloat16)


def test_rounded_p_reference_follows_the_lazy_max():
    # Scores that grow along the keys: the running max moves on some tiles and not on others; the
    # emulation must still agree with the exact softmax to the output's rounding.
    q = torch.ones(4, 1, 64, dtype=torch.bfloat16)
    k = (torch.arange(96, dtype=torch.float32)[:, None, None] / 8).expand(96, 1, 64).to(torch.bfloat16).contiguous()
    v = torch.randn(96, 1, 64, generator=gen(4)).to(torch.bfloat16)
    qo, kv = indptr([4]), indptr([96])
    ref, ref_lse = _reference.prefill(q, k, v, qo, kv, 0.05, causal=False)
    got, lse = _reference.prefill_rounded_p(q, k, v, qo, kv, 0.05, causal=False, tile_kv=16)
    assert rel_err(got.to(torch.bfloat16), ref) < tol(torch.bfloat16, same_rounding=True)
    assert float((lse.double() - ref_lse).abs().max()) < _reference.PREFILL_LSE_ATOL


def test_validate_ragged_names_the_bad_entry():
    q, k = torch.zeros(10, 1, 64), torch.zeros(12, 1, 64)
    ok_qo, ok_kv = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    prefill_mod.validate_ragged(q, k, ok_qo, ok_kv, True)
    cases = [(torch.tensor([1, 4, 10]), ok_kv, r"qo_indptr\[0\] = 1"),
             (torch.tensor([0, 6, 5]), ok_kv, r"qo_indptr\[2\] = 5 is below qo_indptr\[1\] = 6"),
             (ok_qo, torch.tensor([0, 5, 11]), r"kv_indptr\[2\] = 11, expected 12"),
             (ok_qo, torch.tensor([0, 3, 12]), r"request 0 has 4 queries and 3 keys")]
    for qo, kv, msg in cases:
        with pytest.raises(ValueError, match=msg):
            prefill_mod.validate_ragged(q, k, qo.to(torch.int32), kv.to(torch.int32), True)
    prefill_mod.validate_ragged(q, k, ok_qo, torch.tensor([0, 3, 12], dtype=torch.int32), False)


def test_bad_input_without_gpu():
    q, k, v = torch.zeros(3, 2, 64, dtype=torch.bfloat16), torch.zeros(3, 2, 64, dtype=torch.bfloat16), \
        torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    ind = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        hmoe.ops.ragged_prefill([1], k, v, ind, ind, sm_scale=1.0)
    with pytest.raises(TypeError, match="q must have dtype"):
        hmoe.ops.ragged_prefill(q.float(), k, v, ind, ind, sm_scale=1.0)
    with pytest.raises(ValueError, match="q must be 3-D"):
        hmoe.ops.ragged_prefill(q[0], k, v, ind, ind, sm_scale=1.0)
    with pytest.raises(ValueError, match="must be on the CUDA"):
        hmoe.ops.ragged_prefill(q, k, v, ind, ind, sm_scale=1.0)
    assert prefill_mod.HEAD_DIMS == ((192, 128), (128, 128), (64, 64))
    # a configuration that is no index (the string reached int(); 1.7 became configuration 1)
    for config in ("abc", 1.7, True):
        with pytest.raises(TypeError, match="config must be an int"):
            prefill_mod.plan(0, 277, 2, 4, 2, 128, 128, config=config)


def test_plan_takes_the_device_by_the_name_the_readme_gives_it():
    # README: plan(device, total_q, batch, heads, kv_heads, head_dim_qk, head_dim_v); device= reaches the
    # device check (the parameter was called index: a TypeError before any check)
    with pytest.raises(ValueError, match="expected a CUDA device"):
        prefill_mod.plan(device="cpu", total_q=277, batch=2, heads=4, kv_heads=2, head_dim_qk=128, head_dim_v=128)


# --- GPU ----------------------------------------------------------------------------------------

def run_and_check(q, k, v, qo, kv, *, variant=None, causal=True, scale=SCALE, tight=True, kv_seen=None):
    """ragged_prefill (forced to `variant`) into a NaN-poisoned out, against both references;
    returns (out, lse). kv_seen: the kv_indptr the references use, where kv's entries are clamped."""
    H, dv = q.shape[1], v.shape[2]
    out = torch.full((q.shape[0], H, dv), float("nan"), dtype=q.dtype, device="cuda")
    got, lse = hmoe.ops.ragged_prefill(q, k, v, qo, kv, causal=causal, sm_scale=scale, return_lse=True, out=out,
                                       variant=variant)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr() and got.dtype == q.dtype and lse.dtype == torch.float32
    kv = kv if kv_seen is None else kv_seen
    ref, ref_lse = _reference.prefill(q, k, v, qo, kv, scale, causal)
    seen = torch.isfinite(ref_lse)
    assert (got[~seen] == 0).all() and torch.isneginf(lse[~seen]).all()
    assert rel_err(got, ref) < tol(q.dtype)
    if seen.any():
        assert float((lse[seen].double() - ref_lse[seen]).abs().max()) < _reference.PREFILL_LSE_ATOL
    if tight:
        p = prefill_mod.plan(q.get_device(), q.shape[0], len(qo) - 1, H, k.shape[1], q.shape[2], dv, variant=variant)
        near, _ = _reference.prefill_rounded_p(q, k, v, qo, kv, scale, causal, tile_kv=p.tile_kv)
        assert rel_err(got, near) < tol(q.dtype, same_rounding=True)
    return got, lse


LENS = [0, 1, 7, 127, 128, 129, 300, 33, 0, 64]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"{d[0]}x{d[1]}")
def test_ragged_lengths_and_tile_boundaries(dtype, dims, variant):
    run_and_check(*make_ragged(LENS, LENS, 4, 4, dims, dtype, "cuda", gen(dims[0])), variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [1, 4, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa(ratio, dtype, variant):
    run_and_check(*make_ragged([65, 0, 200, 3], [65, 10, 260, 3], 2 * ratio, 2, (192, 128), dtype, "cuda",
                               gen(ratio)), variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"{d[0]}x{d[1]}")
def test_fewer_queries_than_keys(causal, dims, variant):
    # chunked prefill: each request's queries are the last of its keys
    run_and_check(*make_ragged([1, 50, 128, 0, 200, 5], [700, 50, 1000, 64, 333, 129], 3, 1, dims, torch.bfloat16,
                               "cuda", gen(5)), causal=causal, variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_keys_of_other_requests_are_never_read(causal, variant):
    # request 1 has keys but no queries, and NaN in all of them: a kernel that reads past request 0's
    # keys (tile 1 ends 28 rows into them, its last 8-row group 4 rows short) or before request 2's
    # picks NaN up (0 * NaN in P V); tails of 1 to 7 rows and exact tiles too
    q_lens, kv_lens = [100, 0, 37, 3, 64], [100, 128, 261, 9, 128]
    q, k, v, qo, kv = make_ragged(q_lens, kv_lens, 2, 2, (192, 128), torch.bfloat16, "cuda", gen(12))
    k[100:228], v[100:228] = float("nan"), float("nan")
    run_and_check(q, k, v, qo, kv, causal=causal, variant=variant)


@pytest.mark.gpu
def test_tensors_taking_turns_in_one_storage(variant):
    # The TMA's tensor maps (the sm90a kernel's, and the portable kernel's on sm_90 and newer) are
    # kept per thread for a tensor at the same address with the same shape and box
    # (cuda/common/tma_host.h): q, k and v here take turns in one storage with
    # other head counts, head dims and row counts, twice over, each call against the references.
    cases = [([65, 0, 200], [65, 10, 260], 8, 2, (192, 128)), ([65, 0, 200], [65, 10, 260], 8, 8, (192, 128)),
             ([300, 7], [300, 7], 4, 4, (128, 128)), ([1, 129], [130, 129], 8, 2, (64, 64))]
    made = [make_ragged(ql, kl, H, Hkv, dims, torch.bfloat16, "cuda", gen(40 + i))
            for i, (ql, kl, H, Hkv, dims) in enumerate(cases)]
    storages = [torch.empty(max(m[j].numel() for m in made), dtype=torch.bfloat16, device="cuda") for j in range(3)]
    for _ in range(2):
        for q, k, v, qo, kv in made:
            run_and_check(*in_storage((q, k, v), storages), qo, kv, variant=variant)


@pytest.mark.gpu
def test_more_queries_than_keys(variant):
    # non-causal: allowed; causal: the first lq - lk queries see no key (out 0, lse -inf) unless
    # check_indices, which refuses it
    args = make_ragged([40, 300], [10, 129], 2, 2, (128, 128), torch.float16, "cuda", gen(6))
    run_and_check(*args, causal=False, variant=variant)
    _, lse = run_and_check(*args, causal=True, variant=variant)
    assert torch.isneginf(lse[:30]).all() and torch.isfinite(lse[30:40]).all()
    with pytest.raises(ValueError, match="request 0 has 40 queries and 10 keys"):
        hmoe.ops.ragged_prefill(*args, sm_scale=SCALE, check_indices=True)


@pytest.mark.gpu
def test_no_keys_at_all(variant):
    # every request has queries and no key (k and v have no rows): out 0, lse -inf
    args = make_ragged([3, 130], [0, 0], 2, 2, (192, 128), torch.bfloat16, "cuda", gen(13))
    _, lse = run_and_check(*args, causal=False, variant=variant)
    assert torch.isneginf(lse).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_sequences(dtype, variant):
    run_and_check(*make_ragged([8192, 100], [8192, 100], 2, 1, (192, 128), dtype, "cuda", gen(7)), variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [-0.07, 0.0, 2.5])
def test_any_scale(scale, variant):
    # c <= 0 takes the masked softmax on every tile; a large scale makes the running max move often
    run_and_check(*make_ragged([90, 130], [90, 200], 2, 2, (64, 64), torch.bfloat16, "cuda", gen(8)), scale=scale,
                  variant=variant)


def each_configuration(monkeypatch, shape, dims, variant):
    """Yields (index, plan) for every tile configuration of these head dims that this GPU holds,
    with $HMOE_PREFILL_CONFIG set to it while the caller runs; shape: (total_q, batch, heads,
    kv_heads) as prefill.plan takes them."""
    for c in range(8):
        try:
            p = prefill_mod.plan(torch.cuda.current_device(), *shape, *dims, config=c, variant=variant)
        except ValueError:  # another head dims' configuration, or one this device cannot hold
            continue
        monkeypatch.setenv("HMOE_PREFILL_CONFIG", str(c))
        yield c, p


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"{d[0]}x{d[1]}")
def test_running_max_moving_on_later_tiles(monkeypatch, causal, dims, variant):
    # Scores that grow along each request's keys by about 16 (log2 units) every 64 keys: the
    # running max moves on tiles after the first, unmasked ones included (where the portable
    # kernel's configurations with two K buffers first guess that it stays), in every
    # configuration of the head dims.
    q_lens, kv_lens = [300, 70], [300, 200]
    q, k, v, qo, kv = make_ragged(q_lens, kv_lens, 2, 2, dims, torch.bfloat16, "cpu", gen(14))
    step = 0.25 / (dims[0] * SCALE * math.log2(math.e))  # per key, so that q . k grows by 0.25 log2 units
    ramp = torch.cat([torch.arange(n, dtype=torch.float32) * step for n in kv_lens])
    q = (0.3 * q.float() + 1).to(torch.bfloat16)
    k = (0.3 * k.float() + ramp[:, None, None]).to(torch.bfloat16)
    args = [t.cuda() for t in (q, k, v, qo, kv)]
    ran = []
    for c, _ in each_configuration(monkeypatch, (370, 2, 2, 2), dims, variant):
        run_and_check(*args, causal=causal, variant=variant)
        ran.append(c)
    assert ran, dims


@pytest.mark.gpu
def test_every_configuration(monkeypatch, variant):
    idx = torch.cuda.current_device()
    for dims in HEAD_DIMS:
        monkeypatch.delenv("HMOE_PREFILL_CONFIG", raising=False)
        args = make_ragged([200, 77], [260, 77], 4, 2, dims, torch.bfloat16, "cuda", gen(dims[1]))
        default = prefill_mod.plan(idx, 277, 2, 4, 2, *dims, variant=variant)
        assert default.tile_q in (128, 256) and default.max_items == 277 // default.tile_q + 2
        ran = []
        for c, p in each_configuration(monkeypatch, (277, 2, 4, 2), dims, variant):
            assert p.config == c
            run_and_check(*args, variant=variant)
            ran.append(c)
        assert default.config in ran, (dims, ran)  # the refusals swallowed above never include the default's
    monkeypatch.setenv("HMOE_PREFILL_CONFIG", "x")
    with pytest.raises(ValueError, match="HMOE_PREFILL_CONFIG"):
        hmoe.ops.ragged_prefill(*args, sm_scale=SCALE, variant=variant)


@pytest.mark.gpu
def test_hmoe_picks_sm90a_on_hopper_and_portable_elsewhere():
    from hmoe import _build_info
    from hmoe.ops import _cuda

    idx = torch.cuda.current_device()
    hopper = torch.cuda.get_device_capability() == (9, 0)
    sel = _cuda.select("ragged_prefill", idx)
    if hopper and "sm90a" in _build_info.cuda_kernels_for("ragged_prefill"):
        assert (sel.variant, sel.reason) == ("sm90a", "native: sm_90a SASS")
    else:
        assert sel.variant == "portable"
    assert _cuda.select("paged_prefill", idx).variant == "portable"  # sm90a has no paged form


@pytest.mark.gpu
def test_nan_beyond_the_batch_and_clamped_indices(variant):
    # make_ragged puts NaN rows right after each batch's k/v; indptr entries past the rows or
    # decreasing are clamped (never read outside k/v): each request then sees the keys the clamped
    # entries give it (the docstring's rule), and check_indices names the entries instead
    q, k, v, qo, kv = make_ragged([100, 28], [100, 28], 2, 2, (192, 128), torch.bfloat16, "cuda", gen(9))
    run_and_check(q, k, v, qo, kv, variant=variant)
    for bad, seen in (([0, 100, 10**6], [0, 100, 128]), ([0, 120, 50], [0, 120, 120]), ([-5, 100, 128], [0, 100, 128])):
        kv_bad = torch.tensor(bad, dtype=torch.int32, device="cuda")
        run_and_check(q, k, v, qo, kv_bad, variant=variant, causal=False,
                      kv_seen=torch.tensor(seen, dtype=torch.int32, device="cuda"))
        with pytest.raises(ValueError, match="kv_indptr"):
            hmoe.ops.ragged_prefill(q, k, v, qo, kv_bad, sm_scale=SCALE, check_indices=True)
    with pytest.raises(ValueError, match=r"qo_indptr\[2\] = 127, expected 128"):
        hmoe.ops.ragged_prefill(q, k, v, torch.tensor([0, 100, 127], dtype=torch.int32, device="cuda"), kv,
                                sm_scale=SCALE, check_indices=True)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_cuda_graph_capture_and_replay_with_new_indptr(monkeypatch, variant):
    total = 1000
    q, k, v, qo, kv = make_ragged([600, 400], [600, 400], 4, 2, (192, 128), torch.bfloat16, "cuda", gen(10))
    hmoe.prewarm()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        hmoe.ops.ragged_prefill(q, k, v, qo, kv, sm_scale=SCALE, return_lse=True, variant=variant)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = hmoe.ops.ragged_prefill(q, k, v, qo, kv, sm_scale=SCALE, return_lse=True, variant=variant)
    for lens in ([1000, 0], [1, 999], [130, 870], [500, 500]):
        qo.copy_(indptr(lens))
        kv.copy_(indptr(lens))
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        ref, ref_lse = _reference.prefill(q, k, v, qo, kv, SCALE)
        assert rel_err(out, ref) < tol(torch.bfloat16) and out.shape[0] == total
        assert float((lse.double() - ref_lse).abs().max()) < _reference.PREFILL_LSE_ATOL
    from hmoe.ops import _cuda
    monkeypatch.setattr(_cuda, "_warm", set())
    with pytest.raises(RuntimeError, match="prewarm"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            hmoe.ops.ragged_prefill(q, k, v, qo, kv, sm_scale=SCALE, variant=variant)


PTX_CHECK = """
import torch, hmoe
from hmoe import _reference
from tests.ops.prefill_reference import make_ragged, rel_err, tol
# Under CUDA_FORCE_PTX_JIT torch's own kernels may have no PTX: only copies touch the GPU here.
# The portable family forced: the only one with PTX (sm90a is arch-specific SASS alone).
for dims, dtype in [((192, 128), torch.bfloat16), ((128, 128), torch.float16), ((64, 64), torch.bfloat16)]:
    cpu = make_ragged([0, 130, 7], [5, 130, 300], 4, 2, dims, dtype, "cpu", torch.Generator().manual_seed(1))
    out = hmoe.ops.ragged_prefill(*[t.to("cuda") for t in cpu], sm_scale=0.07, variant="portable").cpu()
    ref, _ = _reference.prefill(*cpu, 0.07)
    assert rel_err(out, ref) < tol(dtype), "PTX result differs"
print("PTX-OK")
"""


@pytest.mark.gpu
def test_ptx_path_in_a_subprocess():
    r = run_forced_ptx(PTX_CHECK, timeout=900)
    assert r.returncode == 0 and "PTX-OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.gpu
def test_bad_input_on_gpu(variant):
    q, k, v, qo, kv = make_ragged([5, 6], [5, 6], 4, 2, (128, 128), torch.bfloat16, "cuda", gen(11))
    call = lambda **kw: hmoe.ops.ragged_prefill(**{**dict(q=q, k=k, v=v, qo_indptr=qo, kv_indptr=kv,  # noqa: E731
                                                          sm_scale=SCALE, variant=variant), **kw})
    with pytest.raises(TypeError, match="k has dtype float16, q bfloat16"):
        call(k=k.half())
    with pytest.raises(TypeError, match="qo_indptr must have dtype int32"):
        call(qo_indptr=qo.long())
    with pytest.raises(ValueError, match="qo_indptr must be 1-D"):
        call(qo_indptr=qo[None])
    with pytest.raises(ValueError, match=r"kv_indptr has shape \(2,\), expected \(3,\)"):
        call(kv_indptr=kv[:2])
    with pytest.raises(ValueError, match=r"head dims \(q/k 96, v 96\) are not supported"):
        call(q=torch.zeros(11, 4, 96, dtype=torch.bfloat16, device="cuda"),
             k=torch.zeros(11, 2, 96, dtype=torch.bfloat16, device="cuda"),
             v=torch.zeros(11, 2, 96, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match=r"head dims \(q/k 128, v 64\)"):
        call(v=v[..., :64].contiguous())
    with pytest.raises(ValueError, match="k has shape .* its last dimension must be q's, 128"):
        call(k=torch.zeros(11, 2, 192, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="q has 3 heads, k 2"):
        call(q=q[:, :3].contiguous())
    with pytest.raises(ValueError, match="v has shape"):
        call(v=v[:10])
    with pytest.raises(ValueError, match="must be on the CUDA"):
        call(kv_indptr=kv.cpu())
    with pytest.raises(ValueError, match="contiguous"):
        call(k=k.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="sm_scale must be finite"):
        call(sm_scale=float("inf"))
    with pytest.raises(TypeError, match="causal must be a bool"):
        call(causal=1)
    with pytest.raises(ValueError, match="out overlaps q"):
        call(out=q.view(-1)[: 11 * 4 * 128].view(11, 4, 128))
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.empty(11, 4, 64, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="no such GPU variant of ragged_prefill"):
        call(variant="flashinfer-fa2")
    empty = hmoe.ops.ragged_prefill(q[:0], k, v, torch.zeros(1, dtype=torch.int32, device="cuda"),
                                    torch.zeros(1, dtype=torch.int32, device="cuda"), sm_scale=SCALE)
    assert empty.shape == (0, 4, 128)
