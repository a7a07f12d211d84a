// bf16 x bf16 matmuls on oneDNN's CPU kernels, as XLA FFI custom calls.
//
// Built and loaded by vit_jax/models/onednn.py (which documents why). Each
// call computes op(a) x op(b) for row-major operands, 2-D or 3-D with a
// leading batch axis, op a transpose of the last two axes where the
// attribute says so (a stored (K, M) for trans_a, b stored (N, K) for
// trans_b), accumulated in float32 and written in the result's dtype (bf16:
// rounded once; f32: the accumulator). oneDNN primitives are created once
// per shape and kept; executing one is thread-safe.

#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

#if DNNL_VERSION_MAJOR < 3
#error "vit_jax's oneDNN matmul needs oneDNN 3.x (pip install onednn onednn-devel)"
#endif

namespace ffi = xla::ffi;

namespace {

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

struct Primitive {
  dnnl::matmul matmul;
  dnnl::memory::desc a, b, c;
};

// batch 0: 2-D operands.
using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, bool, int>;

const Primitive& Get(int64_t batch, int64_t m, int64_t k, int64_t n,
                     bool trans_a, bool trans_b, dt out) {
  static std::mutex mu;
  static std::map<Key, Primitive> cache;
  Key key{batch, m, k, n, trans_a, trans_b, static_cast<int>(out)};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  dnnl::memory::desc a, b, c;
  if (batch == 0) {
    a = dnnl::memory::desc({m, k}, dt::bf16, trans_a ? tag::ba : tag::ab);
    b = dnnl::memory::desc({k, n}, dt::bf16, trans_b ? tag::ba : tag::ab);
    c = dnnl::memory::desc({m, n}, out, tag::ab);
  } else {
    a = dnnl::memory::desc({batch, m, k}, dt::bf16,
                           trans_a ? tag::acb : tag::abc);
    b = dnnl::memory::desc({batch, k, n}, dt::bf16,
                           trans_b ? tag::acb : tag::abc);
    c = dnnl::memory::desc({batch, m, n}, out, tag::abc);
  }
  dnnl::matmul matmul(dnnl::matmul::primitive_desc(Engine(), a, b, c));
  return cache.emplace(key, Primitive{matmul, a, b, c}).first->second;
}

dnnl::stream& Stream() {
  thread_local dnnl::stream stream(Engine());
  return stream;
}

ffi::Error Matmul(ffi::AnyBuffer a, ffi::AnyBuffer b,
                  ffi::Result<ffi::AnyBuffer> c, bool trans_a, bool trans_b) {
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  auto cd = c->dimensions();
  const size_t rank = ad.size();
  if ((rank != 2 && rank != 3) || bd.size() != rank || cd.size() != rank ||
      a.element_type() != ffi::DataType::BF16 ||
      b.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument(
        "vit_jax_onednn_matmul takes 2-D or 3-D bf16 operands");
  }
  const size_t r = rank - 2;  // The first matrix axis.
  const int64_t batch = rank == 3 ? ad[0] : 0;
  const int64_t m = trans_a ? ad[r + 1] : ad[r];
  const int64_t k = trans_a ? ad[r] : ad[r + 1];
  const int64_t n = trans_b ? bd[r] : bd[r + 1];
  if ((trans_b ? bd[r + 1] : bd[r]) != k || cd[r] != m || cd[r + 1] != n ||
      (rank == 3 && (bd[0] != batch || cd[0] != batch))) {
    return ffi::Error::InvalidArgument(
        "vit_jax_onednn_matmul: operand shapes do not match");
  }
  dt out;
  switch (c->element_type()) {
    case ffi::DataType::BF16: out = dt::bf16; break;
    case ffi::DataType::F32: out = dt::f32; break;
    default:
      return ffi::Error::InvalidArgument(
          "vit_jax_onednn_matmul writes bf16 or f32");
  }
  try {
    const Primitive& p = Get(batch, m, k, n, trans_a, trans_b, out);
    dnnl::memory am(p.a, Engine(), a.untyped_data());
    dnnl::memory bm(p.b, Engine(), b.untyped_data());
    dnnl::memory cm(p.c, Engine(), c->untyped_data());
    dnnl::stream& stream = Stream();
    p.matmul.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm},
                              {DNNL_ARG_DST, cm}});
    stream.wait();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VitJaxOnednnMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));

// 0 where oneDNN's CPU engine can be created and has a bf16 matmul for this
// CPU, in each layout and result dtype the custom call uses (oneDNN 3.x has
// none on CPUs without AVX512-BF16, AVX2-VNNI-2 or AMX: AVX2-only ones);
// 1 where the engine fails, 2 where the bf16 matmul does; the reason in
// `message` (at most `size` bytes with the terminating NUL).
extern "C" int vit_jax_onednn_check(char* message, int size) {
  try {
    Engine();
  } catch (const std::exception& e) {
    std::snprintf(message, size, "%s", e.what());
    return 1;
  }
  const dnnl_version_t* v = dnnl_version();
  const std::string version = "oneDNN " + std::to_string(v->major) + "." +
                              std::to_string(v->minor) + "." +
                              std::to_string(v->patch);
  try {
    for (bool trans : {false, true}) {
      Get(0, 8, 8, 8, trans, trans, dt::bf16);
      Get(2, 8, 8, 8, trans, trans, dt::f32);
    }
  } catch (const std::exception& e) {
    std::snprintf(message, size, "%s: %s", version.c_str(), e.what());
    return 2;
  }
  std::snprintf(message, size, "%s", version.c_str());
  return 0;
}
