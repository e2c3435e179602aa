// ragged_prefill's and paged_prefill's entry points for a CUDA family module (host code): the
// arguments of hmoe.ops.ragged_prefill / paged_prefill checked in the order they document, the plan
// computed once per shape and cached, the output, lse and schedule workspace allocated on torch's
// allocator, and the launch on torch's current stream. The family's kernels come from
// cuda/prefill/prefill.h. Index-array contents are not read here (that would synchronise): the
// kernels clamp them, and Python checks them on request (check_indices=True).
#pragma once
#include <pybind11/pybind11.h>

#include <climits>
#include <initializer_list>
#include <string>

#include "bind/gil.h"
#include "bind/plan_cache.h"
#include "bind/scalars.h"
#include "bind/tensors.h"
#include "prefill/prefill.h"

namespace hmoe::bind {

struct PrefillCall {
  PrefillParams p{};
  TensorArg q, out;  // out.obj is None when the entry allocates it
};

inline std::string shape_of(std::initializer_list<int64_t> dims) {
  std::string s = "(";
  for (int64_t d : dims) s += (s.size() > 1 ? ", " : "") + std::to_string(d);
  return s + (dims.size() == 1 ? ",)" : ")");
}

// What both forms share, after their own tensors: dtypes, head dims, GQA, sizes, alignment, the
// scalars and out.
inline void prefill_common(PrefillCall& c, std::initializer_list<const TensorArg*> kv, const TensorArg& k,
                           const TensorArg& v, int64_t hkv, int64_t dk, std::initializer_list<const TensorArg*> all,
                           py::handle sm_scale, py::handle causal, py::handle out) {
  const TensorArg& q = c.q;
  for (const TensorArg* t : kv)
    if (t->dtype != q.dtype)
      type_error(std::string(t->name) + " has dtype " + dtype_name(t->dtype) + ", q " + dtype_name(q.dtype) +
                 ": they must match");
  const int64_t Tq = q.shape[0], H = q.shape[1], Dqk = q.shape[2], Dv = v.shape[v.ndim - 1];
  if (dk != Dqk)
    value_error(std::string(k.name) + " has shape " + k.shape_str() + ": its last dimension must be q's, " +
                std::to_string(Dqk));
  bool built = false;
  for (const auto& d : kPrefillHeadDims) built |= d[0] == Dqk && d[1] == Dv;
  if (!built) {
    std::string list;
    for (const auto& d : kPrefillHeadDims) list += (list.empty() ? "" : ", ") + shape_of({d[0], d[1]});
    value_error("head dims (q/k " + std::to_string(Dqk) + ", v " + std::to_string(Dv) +
                ") are not supported; (q/k, v) must be one of " + list);
  }
  if (H < 1 || hkv < 1 || H % hkv != 0)
    value_error("q has " + std::to_string(H) + " heads, " + k.name + " " + std::to_string(hkv) +
                ": the query heads must be a positive multiple of the key/value heads");
  if (Tq > INT32_MAX)  // int32 indptr entries cannot name more rows
    value_error("q has " + std::to_string(Tq) + " rows; prefill supports fewer than 2^31 (int32 qo_indptr)");
  for (const TensorArg* t : all)
    if (t->dtype != kI32 && reinterpret_cast<uintptr_t>(t->data) % 16)
      value_error(std::string(t->name) + " must start on a 16-byte boundary (it is a view at an odd offset)");
  c.p.sm_scale = float_arg(sm_scale, "sm_scale");
  c.p.causal = bool_arg(causal, "causal") ? 1 : 0;
  if (!out.is_none()) {
    c.out = tensor(out, "out", dtypes({q.dtype}), 3, Where::kCuda);
    const TensorArg& o = c.out;
    if (o.shape[0] != Tq || o.shape[1] != H || o.shape[2] != Dv || o.device != q.device ||
        reinterpret_cast<uintptr_t>(o.data) % 16)
      value_error("out must be a 16-byte aligned " + shape_of({Tq, H, Dv}) + " tensor on " + q.device_str() + ", got " +
                  o.shape_str() + " on " + o.device_str());
    no_overlap(o, all);  // written while they are read
  }
  PrefillParams& p = c.p;
  p.q = q.data, p.k = k.data, p.v = v.data;
  p.heads = int32_t(H), p.kv_heads = int32_t(hkv), p.head_dim_qk = int32_t(Dqk), p.head_dim_v = int32_t(Dv);
  p.total_q = int32_t(Tq), p.dtype = q.dtype;
}

inline PrefillCall ragged_prefill_args(py::handle q, py::handle k, py::handle v, py::handle qo_indptr,
                                       py::handle kv_indptr, py::handle sm_scale, py::handle causal, py::handle out) {
  PrefillCall c;
  const uint32_t i32 = dtypes({kI32});
  c.q = tensor(q, "q", kHalves, 3, Where::kCuda);
  const TensorArg kt = tensor(k, "k", kHalves, 3, Where::kCuda);
  same_device(c.q, kt);
  const TensorArg vt = tensor(v, "v", kHalves, 3, Where::kCuda);
  same_device(c.q, vt);
  const TensorArg qo = tensor(qo_indptr, "qo_indptr", i32, 1, Where::kCuda);
  same_device(c.q, qo);
  const TensorArg kvp = tensor(kv_indptr, "kv_indptr", i32, 1, Where::kCuda);
  same_device(c.q, kvp);
  const int64_t Tkv = kt.shape[0], Hkv = kt.shape[1];
  if (vt.shape[0] != Tkv || vt.shape[1] != Hkv)
    value_error("v has shape " + vt.shape_str() + ", expected (" + std::to_string(Tkv) + ", " + std::to_string(Hkv) +
                ", head_dim_v) like k " + kt.shape_str());
  if (qo.shape[0] < 1) value_error("qo_indptr has shape " + qo.shape_str() + ", expected (batch + 1,)");
  if (kvp.shape[0] != qo.shape[0])
    value_error("kv_indptr has shape " + kvp.shape_str() + ", expected " + qo.shape_str() + " like qo_indptr");
  if (Tkv > INT32_MAX)
    value_error("k has " + std::to_string(Tkv) + " rows; prefill supports fewer than 2^31 (int32 kv_indptr)");
  prefill_common(c, {&kt, &vt}, kt, vt, Hkv, kt.shape[2], {&c.q, &kt, &vt, &qo, &kvp}, sm_scale, causal, out);
  PrefillParams& p = c.p;
  p.kv = kPrefillRagged;
  p.qo_indptr = static_cast<const int32_t*>(qo.data), p.kv_indptr = static_cast<const int32_t*>(kvp.data);
  p.batch = int32_t(qo.shape[0] - 1), p.total_kv = int32_t(Tkv);
  return c;
}

inline PrefillCall paged_prefill_args(py::handle q, py::handle k_cache, py::handle v_cache, py::handle page_table,
                                      py::handle kv_lens, py::handle qo_indptr, py::handle sm_scale, py::handle causal,
                                      py::handle out) {
  PrefillCall c;
  const uint32_t i32 = dtypes({kI32});
  c.q = tensor(q, "q", kHalves, 3, Where::kCuda);
  const TensorArg kc = tensor(k_cache, "k_cache", kHalves, 4, Where::kCuda);
  same_device(c.q, kc);
  const TensorArg vc = tensor(v_cache, "v_cache", kHalves, 4, Where::kCuda);
  same_device(c.q, vc);
  const TensorArg pt = tensor(page_table, "page_table", i32, 2, Where::kCuda);
  same_device(c.q, pt);
  const TensorArg lens = tensor(kv_lens, "kv_lens", i32, 1, Where::kCuda);
  same_device(c.q, lens);
  const TensorArg qo = tensor(qo_indptr, "qo_indptr", i32, 1, Where::kCuda);
  same_device(c.q, qo);
  const int64_t P = kc.shape[0], page = kc.shape[1], Hkv = kc.shape[2];
  if (P < 1 || page < 1) value_error("k_cache has shape " + kc.shape_str() + ": no pages");
  if (vc.shape[0] != P || vc.shape[1] != page || vc.shape[2] != Hkv)
    value_error("v_cache has shape " + vc.shape_str() + ", expected " + shape_of({P, page, Hkv}) +
                " + (head_dim_v,) like k_cache " + kc.shape_str());
  if (P * page > INT32_MAX)  // the kernel indexes cache rows with int32
    value_error("k_cache has " + std::to_string(P * page) + " token rows; prefill supports fewer than 2^31");
  const int64_t B = pt.shape[0], max_pages = pt.shape[1];
  if (qo.shape[0] != B + 1)
    value_error("qo_indptr has shape " + qo.shape_str() + ", expected " + shape_of({B + 1}) + " (page_table has " +
                std::to_string(B) + " rows)");
  if (max_pages < 1)
    value_error("page_table has shape " + pt.shape_str() + ", expected [" + std::to_string(B) + ", max_pages >= 1]");
  if (lens.shape[0] != B) value_error("kv_lens has shape " + lens.shape_str() + ", expected " + shape_of({B}));
  if (max_pages * page > INT32_MAX || B * max_pages > INT32_MAX)
    value_error(
        "page_table " + pt.shape_str() + " with page size " + std::to_string(page) +
        ": a request's capacity (max_pages * page_size) and the table (batch * max_pages) must stay below 2^31");
  prefill_common(c, {&kc, &vc}, kc, vc, Hkv, kc.shape[3], {&c.q, &kc, &vc, &pt, &lens, &qo}, sm_scale, causal, out);
  PrefillParams& p = c.p;
  p.kv = kPrefillPaged;
  p.qo_indptr = static_cast<const int32_t*>(qo.data);
  p.page_table = static_cast<const int32_t*>(pt.data), p.kv_lens = static_cast<const int32_t*>(lens.data);
  p.batch = int32_t(B), p.page_size = int32_t(page), p.max_pages = int32_t(max_pages), p.num_pages = int32_t(P);
  p.total_kv = int32_t(P * page);
  return c;
}

// The family's plan for a shape, computed once per (device, shape, override).
inline PrefillPlan prefill_cached_plan(int device, int64_t total_q, int batch, int heads, int kv_heads, int dqk, int dv,
                                       int config) {
  return cached_plan<PrefillPlan>(
      std::array<int64_t, 8>{total_q, device, batch, heads, kv_heads, dqk, dv, config},
      [&] { return prefill_plan(device, total_q, batch, heads, kv_heads, dqk, dv, config); });
}

// Allocates out (unless given), lse (when asked) and the schedule workspace, and launches.
inline py::object prefill_run(PrefillCall& c, py::handle out, py::handle return_lse, int32_t config) {
  const bool want_lse = bool_arg(return_lse, "return_lse");
  PrefillParams& p = c.p;
  const int device = c.q.device;
  py::object result = py::reinterpret_borrow<py::object>(out);
  void* data = nullptr;
  if (out.is_none()) {
    result = empty({p.total_q, p.heads, p.head_dim_v}, p.dtype, device, &data);
    p.out = data;
  } else {
    p.out = c.out.data;
  }
  py::object lse;
  if (want_lse) {
    lse = empty({p.total_q, p.heads}, kF32, device, &data);
    p.lse = static_cast<float*>(data);
  }
  if (p.batch > 0 && p.total_q > 0) {
    const PrefillPlan plan =
        prefill_cached_plan(device, p.total_q, p.batch, p.heads, p.kv_heads, p.head_dim_qk, p.head_dim_v, config);
    // Under graph capture this comes from the graph's private pool: a replay never shares it.
    py::object workspace = empty({plan.workspace}, kI32, device, &data);
    p.workspace = static_cast<int32_t*>(data);
    void* stream = current_stream(device);
    without_gil([&] { prefill_launch(p, plan, device, reinterpret_cast<uintptr_t>(stream)); });
  }
  if (!want_lse) return result;
  return py::make_tuple(result, lse);
}

inline py::tuple prefill_plan_tuple(const PrefillPlan& p) {
  return py::make_tuple(p.config, p.tile_q, p.tile_kv, p.kv_stages, p.max_items, p.smem_bytes, p.ctas_per_sm,
                        p.workspace);
}

}  // namespace hmoe::bind
