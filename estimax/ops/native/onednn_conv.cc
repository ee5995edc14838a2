// 2-D convolutions (forward, input gradient, filter gradient) for XLA:CPU, run by oneDNN.
//
// Why by hand: XLA:CPU's own convolutions run 3-10x slower than oneDNN's on the same cores
// (bench/results/conv_cpu.md), and no maintained package exposes oneDNN to JAX. This file is
// only the glue: three XLA FFI handlers that describe the convolution to oneDNN (NHWC
// activations, HWIO filters, explicit strides and pads, fp32 or bf16) and run its primitive.
// Primitives are cached by shape; per-call state (reordered filters, scratchpad) is allocated
// per call, so concurrent calls from several XLA devices are safe.
//
// Not every CPU can run every primitive: oneDNN has no fast bf16 convolutions below AVX-512
// (AMD Zen 2, or ONEDNN_MAX_CPU_ISA=AVX2): creating one throws, or yields a reference
// ("ref:") kernel tens of times slower than fp32. So Python asks first: EstimaxConvProbe
// creates (and caches) the primitive for one convolution at trace time and refuses reference
// kernels, and estimax.ops picks another formulation where it fails, instead of failing (or
// crawling) inside a step.
//
// Built by `python -m estimax.ops.native build` against oneDNN 3 from the package index
// (`pip install onednn-devel`: headers in <prefix>/include, libdnnl.so.3 in <prefix>/lib) and
// XLA's FFI headers from jaxlib. That build of oneDNN runs its CPU kernels through SYCL (on
// Intel's OpenCL CPU runtime, also from the index) with TBB threads; Python points the OpenCL
// loader at that runtime before the engine is created (estimax/ops/native/__init__.py).

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

#ifndef ESTIMAX_ONEDNN_LIBDIR
#define ESTIMAX_ONEDNN_LIBDIR ""
#endif

#if DNNL_VERSION_MAJOR < 3
#error "estimax's oneDNN kernels need oneDNN 3 (pip install onednn-devel), not an older one"
#endif

namespace ffi = xla::ffi;
using dnnl::memory;
using tag = dnnl::memory::format_tag;

namespace {

dnnl::engine& Engine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

enum class Kind { kForward, kBackwardData, kBackwardWeights };

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kForward: return "forward";
    case Kind::kBackwardData: return "input gradient";
    default: return "filter gradient";
  }
}

// The instruction set oneDNN dispatches to on this CPU (after ONEDNN_MAX_CPU_ISA). Several
// oneDNN 3 names share a value (avx10_1_512 is avx512_core_fp16), so this is no switch.
const char* IsaName() {
  using isa = dnnl::cpu_isa;
  struct Name { isa value; const char* name; };
  static const Name kNames[] = {
      {isa::sse41, "sse41"},
      {isa::avx, "avx"},
      {isa::avx2, "avx2"},
      {isa::avx2_vnni, "avx2_vnni"},
      {isa::avx2_vnni_2, "avx2_vnni_2"},
      {isa::avx512_core, "avx512_core"},
      {isa::avx512_core_vnni, "avx512_core_vnni"},
      {isa::avx512_core_bf16, "avx512_core_bf16"},
      {isa::avx512_core_fp16, "avx512_core_fp16"},
      {isa::avx512_core_amx, "avx512_core_amx"},
      {isa::avx512_core_amx_fp16, "avx512_core_amx_fp16"},
      {isa::avx10_2_512, "avx10_2_512"},
      {isa::avx10_2_512_amx_2, "avx10_2_512_amx_2"},
  };
  const isa effective = dnnl::get_effective_cpu_isa();
  for (const Name& n : kNames) {
    if (n.value == effective) return n.name;
  }
  return "unknown";
}

struct ConvShape {
  int64_t n, c, h, w;       // input, NHWC
  int64_t o, kh, kw;        // filter, HWIO
  int64_t ho, wo;           // output
  int64_t sh, sw, pt, pb, pl, pr;
  memory::data_type dt;

  std::string Key(Kind kind) const {
    std::ostringstream s;
    s << static_cast<int>(kind) << ':' << static_cast<int>(dt) << ':' << n << ',' << c << ','
      << h << ',' << w << ',' << o << ',' << kh << ',' << kw << ',' << ho << ',' << wo << ','
      << sh << ',' << sw << ',' << pt << ',' << pb << ',' << pl << ',' << pr;
    return s.str();
  }
  memory::desc Src(tag t = tag::nhwc) const { return {{n, c, h, w}, dt, t}; }
  memory::desc Dst(tag t = tag::nhwc) const { return {{n, o, ho, wo}, dt, t}; }
  memory::desc Wei(tag t) const { return {{o, c, kh, kw}, dt, t}; }
  memory::dims Strides() const { return {sh, sw}; }
  memory::dims PadL() const { return {pt, pl}; }
  memory::dims PadR() const { return {pb, pr}; }
  // For messages: "bf16 input [8,56,56,64] filter [3,3,64,64] (HWIO) stride 1x1 pads ...".
  std::string Describe(Kind kind) const {
    std::ostringstream s;
    s << KindName(kind) << ' ' << (dt == memory::data_type::bf16 ? "bf16" : "fp32")
      << " convolution, input [" << n << ',' << h << ',' << w << ',' << c << "] (NHWC), filter ["
      << kh << ',' << kw << ',' << c << ',' << o << "] (HWIO), stride " << sh << 'x' << sw
      << ", padding (" << pt << ',' << pb << ")x(" << pl << ',' << pr << ')';
    return s.str();
  }
};

dnnl::primitive_attr UserScratchpad() {
  dnnl::primitive_attr attr;
  // A caller-owned scratchpad per call: the cached primitive can then run on several
  // threads (XLA devices) at once.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

// A primitive whose kernel is oneDNN's reference implementation ("ref:any"): correct but tens
// of times slower than the fp32 kernels (what oneDNN 3 offers for bf16 on AVX2-only CPUs).
struct ReferenceKernel : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename Pd>
void RefuseReference(const Pd& pd, const ConvShape& s, Kind kind) {
  const char* impl = pd.impl_info_str();
  if (std::strncmp(impl, "ref", 3) == 0) {
    throw ReferenceKernel(std::string("oneDNN has only its reference kernel (") + impl +
                          ") for this " + s.Describe(kind) + " on " + IsaName());
  }
}

dnnl::convolution_forward::primitive_desc ForwardPd(const ConvShape& s) {
  // Activations stay NHWC (no reorder of the large tensors); the filter layout is left to
  // oneDNN (`any`) and reordered per call, which is cheap.
  return dnnl::convolution_forward::primitive_desc(
      Engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
      s.Src(), s.Wei(tag::any), s.Dst(), s.Strides(), s.PadL(), s.PadR(), UserScratchpad());
}

struct Cached {
  dnnl::primitive prim;
  std::string impl;           // oneDNN's name for the kernel, e.g. "brg_conv_fwd:avx512_core"
  memory::desc wei_md;        // the filter layout the primitive wants
  memory::desc scratch_md;
};

std::mutex cache_mu;
std::unordered_map<std::string, std::shared_ptr<Cached>>& Cache() {
  static auto* cache = new std::unordered_map<std::string, std::shared_ptr<Cached>>();
  return *cache;
}

std::shared_ptr<Cached> Build(const ConvShape& s, Kind kind) {
  auto fwd_pd = ForwardPd(s);
  auto out = std::make_shared<Cached>();
  if (kind == Kind::kForward) {
    RefuseReference(fwd_pd, s, kind);
    out->prim = dnnl::convolution_forward(fwd_pd);
    out->wei_md = fwd_pd.weights_desc();
    out->scratch_md = fwd_pd.scratchpad_desc();
    out->impl = fwd_pd.impl_info_str();
  } else if (kind == Kind::kBackwardData) {
    dnnl::convolution_backward_data::primitive_desc pd(
        Engine(), dnnl::algorithm::convolution_direct, s.Src(), s.Wei(tag::any), s.Dst(),
        s.Strides(), s.PadL(), s.PadR(), fwd_pd, UserScratchpad());
    RefuseReference(pd, s, kind);
    out->prim = dnnl::convolution_backward_data(pd);
    out->wei_md = pd.weights_desc();
    out->scratch_md = pd.scratchpad_desc();
    out->impl = pd.impl_info_str();
  } else {
    dnnl::convolution_backward_weights::primitive_desc pd(
        Engine(), dnnl::algorithm::convolution_direct, s.Src(), s.Wei(tag::any), s.Dst(),
        s.Strides(), s.PadL(), s.PadR(), fwd_pd, UserScratchpad());
    RefuseReference(pd, s, kind);
    out->prim = dnnl::convolution_backward_weights(pd);
    out->wei_md = pd.diff_weights_desc();
    out->scratch_md = pd.scratchpad_desc();
    out->impl = pd.impl_info_str();
  }
  return out;
}

// Per-thread scratch memory, grown as needed and reused: a fresh (zero-filled, page-faulted)
// buffer per call made the MNIST CNN's training step 47 ms instead of 38 ms. One set per
// calling thread keeps concurrent calls (several XLA devices) apart.
struct ThreadBuffers {
  std::unique_ptr<char[]> data[2];
  size_t size[2] = {0, 0};
  char* Get(int which, size_t bytes) {
    if (bytes > size[which]) {
      data[which].reset(new char[bytes + 64]);  // uninitialised on purpose
      size[which] = bytes;
    }
    // 64-byte alignment, as oneDNN prefers.
    auto p = reinterpret_cast<uintptr_t>(data[which].get());
    return reinterpret_cast<char*>((p + 63) & ~uintptr_t{63});
  }
};

char* Scratch(int which, size_t bytes) {
  thread_local ThreadBuffers buffers;
  return buffers.Get(which, bytes);
}

std::shared_ptr<Cached> Get(const ConvShape& s, Kind kind) {
  const std::string key = s.Key(kind);
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    auto it = Cache().find(key);
    if (it != Cache().end()) return it->second;
  }
  auto built = Build(s, kind);  // outside the lock: creation can take milliseconds
  std::lock_guard<std::mutex> lock(cache_mu);
  return Cache().emplace(key, built).first->second;
}

ffi::Error DataType(ffi::DataType t, memory::data_type* out) {
  if (t == ffi::DataType::F32) {
    *out = memory::data_type::f32;
  } else if (t == ffi::DataType::BF16) {
    *out = memory::data_type::bf16;
  } else {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "estimax oneDNN convolution: only float32 and bfloat16 are supported");
  }
  return ffi::Error::Success();
}

ffi::Error Shape(ffi::AnyBuffer x, ffi::AnyBuffer wei, ffi::AnyBuffer y, int64_t sh,
                 int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr, ConvShape* s) {
  auto xd = x.dimensions();
  auto wd = wei.dimensions();
  auto yd = y.dimensions();
  if (xd.size() != 4 || wd.size() != 4 || yd.size() != 4) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "estimax oneDNN convolution: expected rank-4 NHWC/HWIO/NHWC operands");
  }
  *s = ConvShape{xd[0], xd[3], xd[1], xd[2], wd[3], wd[0], wd[1], yd[1], yd[2],
                 sh,    sw,    pt,    pb,    pl,    pr,    memory::data_type::undef};
  return DataType(x.element_type(), &s->dt);
}

std::mutex run_mu;

ffi::Error Run(const ConvShape& s, Kind kind, void* src, void* wei, void* dst) {
  // One oneDNN call at a time, each on all of oneDNN's threads (TBB's; OpenMP's in builds
  // with it): XLA may run independent ops (a layer's input and filter gradients) on several
  // threads at once, and one parallel region per caller would oversubscribe the cores. Neutral on an idle machine
  // (ResNet-50 and MNIST steps within 2%); what hurts is other processes on the same cores,
  // which stall OpenMP's barriers (ResNet-50 bf16 filter gradients 5x slower with one busy
  // neighbour process), as they do PyTorch's.
  std::lock_guard<std::mutex> serial(run_mu);
  try {
    auto c = Get(s, kind);
    dnnl::engine& eng = Engine();
    // One stream for all calls (they are serialised above): on this SYCL build a stream is a
    // SYCL queue, too costly to create per call.
    static dnnl::stream* stream = new dnnl::stream(eng);
    dnnl::stream& strm = *stream;
    memory user_wei(s.Wei(tag::hwio), eng, wei);
    memory prim_wei = user_wei;
    const bool reorder = c->wei_md != user_wei.get_desc();
    if (reorder) {
      prim_wei = memory(c->wei_md, eng, Scratch(0, c->wei_md.get_size()));
      if (kind != Kind::kBackwardWeights) {
        dnnl::reorder(user_wei, prim_wei).execute(strm, user_wei, prim_wei);
      }
    }
    memory scratch_mem(c->scratch_md, eng, Scratch(1, c->scratch_md.get_size()));
    memory src_mem(s.Src(), eng, src);
    memory dst_mem(s.Dst(), eng, dst);
    if (kind == Kind::kForward) {
      c->prim.execute(strm, {{DNNL_ARG_SRC, src_mem}, {DNNL_ARG_WEIGHTS, prim_wei},
                             {DNNL_ARG_DST, dst_mem}, {DNNL_ARG_SCRATCHPAD, scratch_mem}});
    } else if (kind == Kind::kBackwardData) {
      c->prim.execute(strm, {{DNNL_ARG_DIFF_SRC, src_mem}, {DNNL_ARG_WEIGHTS, prim_wei},
                             {DNNL_ARG_DIFF_DST, dst_mem}, {DNNL_ARG_SCRATCHPAD, scratch_mem}});
    } else {
      c->prim.execute(strm, {{DNNL_ARG_SRC, src_mem}, {DNNL_ARG_DIFF_WEIGHTS, prim_wei},
                             {DNNL_ARG_DIFF_DST, dst_mem}, {DNNL_ARG_SCRATCHPAD, scratch_mem}});
      if (reorder) dnnl::reorder(prim_wei, user_wei).execute(strm, prim_wei, user_wei);
    }
    strm.wait();
  } catch (const std::exception& e) {
    // Python probes every convolution before choosing this kernel, so this is a bug or an
    // unusual oneDNN build: say what failed, where, and how to carry on without the library.
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("estimax oneDNN convolution failed: ") + e.what() + " (" +
                          s.Describe(kind) + "; oneDNN " + IsaName() +
                          " kernels). Set ESTIMAX_ONEDNN=0 (or pass --nocpu_fast_ops) to use "
                          "XLA's convolutions instead.");
  }
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                       int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr) {
  ConvShape s;
  if (auto e = Shape(x, w, *y, sh, sw, pt, pb, pl, pr, &s); e.failure()) return e;
  return Run(s, Kind::kForward, x.untyped_data(), w.untyped_data(), y->untyped_data());
}

ffi::Error BackwardDataImpl(ffi::AnyBuffer g, ffi::AnyBuffer w,
                            ffi::Result<ffi::AnyBuffer> dx, int64_t sh, int64_t sw, int64_t pt,
                            int64_t pb, int64_t pl, int64_t pr) {
  ConvShape s;
  if (auto e = Shape(*dx, w, g, sh, sw, pt, pb, pl, pr, &s); e.failure()) return e;
  return Run(s, Kind::kBackwardData, dx->untyped_data(), w.untyped_data(), g.untyped_data());
}

ffi::Error BackwardWeightsImpl(ffi::AnyBuffer x, ffi::AnyBuffer g,
                               ffi::Result<ffi::AnyBuffer> dw, int64_t sh, int64_t sw,
                               int64_t pt, int64_t pb, int64_t pl, int64_t pr) {
  ConvShape s;
  if (auto e = Shape(x, *dw, g, sh, sw, pt, pb, pl, pr, &s); e.failure()) return e;
  return Run(s, Kind::kBackwardWeights, x.untyped_data(), dw->untyped_data(),
             g.untyped_data());
}

}  // namespace

#define ESTIMAX_CONV_BINDING(first, second, result)                         \
  ffi::Ffi::Bind()                                                          \
      .Arg<ffi::AnyBuffer>()                                                \
      .Arg<ffi::AnyBuffer>()                                                \
      .Ret<ffi::AnyBuffer>()                                                \
      .Attr<int64_t>("sh")                                                  \
      .Attr<int64_t>("sw")                                                  \
      .Attr<int64_t>("pt")                                                  \
      .Attr<int64_t>("pb")                                                  \
      .Attr<int64_t>("pl")                                                  \
      .Attr<int64_t>("pr")

XLA_FFI_DEFINE_HANDLER_SYMBOL(EstimaxConvForward, ForwardImpl,
                              ESTIMAX_CONV_BINDING(x, w, y));
XLA_FFI_DEFINE_HANDLER_SYMBOL(EstimaxConvBackwardData, BackwardDataImpl,
                              ESTIMAX_CONV_BINDING(g, w, dx));
XLA_FFI_DEFINE_HANDLER_SYMBOL(EstimaxConvBackwardWeights, BackwardWeightsImpl,
                              ESTIMAX_CONV_BINDING(x, g, dw));

// 1 if oneDNN can run this convolution on this CPU with a real (not reference) kernel (the
// primitive is then cached, and its kernel's name written to `msg`), else 0 with oneDNN's
// reason in `msg`. kind: 0 forward, 1 input gradient, 2 filter gradient; dtype: 0 fp32,
// 1 bf16; dims as in ConvShape.
extern "C" int EstimaxConvProbe(int kind, int dtype, const int64_t* dims, char* msg,
                                int msg_len) {
  ConvShape s{dims[0], dims[1], dims[2], dims[3], dims[4],  dims[5],  dims[6],  dims[7],
              dims[8], dims[9], dims[10], dims[11], dims[12], dims[13], dims[14],
              dtype == 1 ? memory::data_type::bf16 : memory::data_type::f32};
  try {
    auto c = Get(s, static_cast<Kind>(kind));
    if (msg_len > 0) std::snprintf(msg, msg_len, "%s", c->impl.c_str());
    return 1;
  } catch (const std::exception& e) {
    if (msg_len > 0) std::snprintf(msg, msg_len, "%s", e.what());
    return 0;
  }
}

extern "C" const char* EstimaxOneDnnIsa() { return IsaName(); }

// The directory of the libdnnl.so.3 this library was built against (and found through its
// RPATH): Python finds the OpenCL CPU runtime beside it.
extern "C" const char* EstimaxOneDnnLibDir() { return ESTIMAX_ONEDNN_LIBDIR; }

// 0 if oneDNN runs its CPU kernels with OpenMP or TBB directly, 1 if through SYCL.
extern "C" int EstimaxOneDnnSycl() {
  return dnnl_version()->cpu_runtime == DNNL_RUNTIME_SYCL ? 1 : 0;
}

extern "C" int EstimaxOneDnnVersion() {
  const dnnl_version_t* v = dnnl_version();
  return v->major * 10000 + v->minor * 100 + v->patch;
}
