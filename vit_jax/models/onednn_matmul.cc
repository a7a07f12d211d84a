// bf16 x bf16 matmuls on oneDNN's CPU kernels, as XLA FFI custom calls.
//
// Built and loaded by vit_jax/models/onednn.py (which documents why). Each
// call computes op(a) x op(b) for 2-D row-major operands, op a transpose
// where the attribute says so (a stored (K, M) for trans_a, b stored (N, K)
// for trans_b), accumulated in float32 and written in the result's dtype
// (bf16: rounded once; f32: the accumulator). oneDNN primitives are created
// once per shape and kept; executing one is thread-safe.

#include <cstdint>
#include <cstdio>
#include <cstring>
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

using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int>;

const Primitive& Get(int64_t m, int64_t k, int64_t n, bool trans_a,
                     bool trans_b, dt out) {
  static std::mutex mu;
  static std::map<Key, Primitive> cache;
  Key key{m, k, n, trans_a, trans_b, static_cast<int>(out)};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  dnnl::memory::desc a({m, k}, dt::bf16, trans_a ? tag::ba : tag::ab);
  dnnl::memory::desc b({k, n}, dt::bf16, trans_b ? tag::ba : tag::ab);
  dnnl::memory::desc c({m, n}, out, tag::ab);
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
  if (ad.size() != 2 || bd.size() != 2 || cd.size() != 2 ||
      a.element_type() != ffi::DataType::BF16 ||
      b.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument(
        "vit_jax_onednn_matmul takes 2-D bf16 operands");
  }
  const int64_t m = trans_a ? ad[1] : ad[0], k = trans_a ? ad[0] : ad[1];
  const int64_t n = trans_b ? bd[0] : bd[1];
  if ((trans_b ? bd[1] : bd[0]) != k || cd[0] != m || cd[1] != n) {
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
    const Primitive& p = Get(m, k, n, trans_a, trans_b, out);
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

// 0 where oneDNN's CPU engine can be created; otherwise 1 and the reason
// in `message` (at most `size` bytes with the terminating NUL).
extern "C" int vit_jax_onednn_check(char* message, int size) {
  try {
    Engine();
    const dnnl_version_t* v = dnnl_version();
    std::snprintf(message, size, "oneDNN %d.%d.%d", v->major, v->minor,
                  v->patch);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(message, size, "%s", e.what());
    return 1;
  }
}
